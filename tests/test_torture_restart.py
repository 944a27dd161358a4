"""The broker SIGKILLed at random points, 50 times, while clients loop short jobs
(scripts/torture_restart.py; run it with --kills 200 for the long round): every run
exits 0, every job ran exactly once to completion, no two jobs were ever on one device
at the same instant (intervals recorded from inside the jobs), the queue came back in
the order it had just before each kill, and no process was granted a second lease while
it held one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_fifty_kills_lose_no_job_no_place_and_never_share_a_device():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "torture_restart.py"), "--kills", "50",
                          "--clients", "5", "--gpus", "2", "--json"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.stdout, out.stderr
    report = json.loads(out.stdout)
    examples = report["examples"]
    assert report["kills"] == 50
    assert report["runs"] > 0, report
    assert report["exit_codes"] == {"0": report["runs"]}, examples["failures"]
    assert report["jobs_not_run_exactly_once"] == 0, examples["not_once"]
    assert report["overlaps"] == 0, examples["overlaps"]
    assert report["queue_reordered"] == 0, examples["reordered"]
    assert report["processes_granted_twice"] == 0, examples["granted_twice"]
    assert report["restored_waiting"] > 0, "no kill found anyone waiting: the queue's survival went untested"
    assert out.returncode == 0

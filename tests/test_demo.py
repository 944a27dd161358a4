"""`make demo`, the README's main job, as a newcomer runs it: it must finish and show
what it promises (real students as root, a refused foreign release, a refused contract,
a crashed holder's GPU handed on), and leave no demo users behind."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("torch")


def test_the_demo_runs_and_shows_what_it_promises():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--quick"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "demo finished" in out
    assert "no device on this host meets the contract" in out  # grace, refused at once
    if os.geteuid() == 0:
        # Each student by the name the broker (and so the queue lines) gives them, the real user.
        assert "demo-bob's GPU went to demo-dave" in out
        assert "exit 137 (killed by SIGKILL)" in out  # bob's vaccel run, as a shell and the README say it
        assert "the students are real Unix users" in out
        assert "belongs to demo-alice; only they, root or the admin group may release it" in out
        assert "queue: demo-carol, demo-dave, demo-erin" in out or "position" in out
        assert f"-- {Path(sys.executable).name} -m torch.distributed.run" in out  # with its interpreter, as run
        leftovers = [u.pw_name for u in pwd.getpwall() if u.pw_name.startswith("demo-")]
        assert leftovers == []
    else:
        assert "bob's GPU went to dave" in out
        assert "one Unix user (you)" in out

"""bench.lab.simulate: lab traces through the lease manager on a simulated clock. Shape and
sanity (every job served once, in order, the figures in range), no timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.lab import plan
from bench.lab.metrics import figures
from bench.lab.simulate import simulate
from bench.lab.trace import generate

ROOT = Path(__file__).resolve().parent.parent


def test_every_job_is_served_once_after_its_submission_for_its_hold():
    jobs = {j.id: j for j in generate(3, 24, 20)}
    holds = {s.job.id: s.hold_s for s in plan.steps(list(jobs.values()), "vaccel", plan.Compression(180.0))}
    outcomes = simulate(3, "vaccel")
    assert sorted(o.job_id for o in outcomes) == sorted(jobs)
    for o in outcomes:
        assert o.start_s >= jobs[o.job_id].submit_s
        assert abs(o.end_s - o.start_s - holds[o.job_id]) < 1e-6
    # Never more devices held at once than the host has.
    moments = sorted({o.start_s for o in outcomes})
    assert all(sum(o.gpus for o in outcomes if o.running(t)) <= 8 for t in moments)


def test_the_cap_holds_every_user_to_half_the_host():
    outcomes = simulate(4, "vaccel-policy-nolend")
    cap = max(4, max(o.gpus for o in outcomes))
    for t in sorted({o.start_s for o in outcomes}):
        held: dict[str, int] = {}
        for o in outcomes:
            if o.running(t):
                held[o.user] = held.get(o.user, 0) + o.gpus
        assert max(held.values()) <= cap


def test_the_command_prints_figures_per_seed_and_their_mean_with_a_baseline(tmp_path: Path):
    done = subprocess.run([sys.executable, "-m", "bench.lab.simulate", "--seeds", "1-2", "--systems", "vaccel",
                           "--baseline", str(ROOT), "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    ours = result["systems"]["vaccel"]
    assert set(ours["seeds"]) == {"1", "2"} and set(ours["mean"]) == {"utilization", "idle_while_waiting_s", "jain"}
    assert 0 < ours["mean"]["utilization"] <= 1 and 0 < ours["mean"]["jain"] <= 1
    assert result["baseline"]["vaccel"] == ours  # the same tree as its own baseline: the same figures
    assert ours["seeds"]["1"] == {k: v for k, v in figures(simulate(1, "vaccel"), 8).items() if k in ours["mean"]}

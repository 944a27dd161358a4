"""Lab traces through vaccel's lease manager itself, on a simulated clock: the scheduler's
figures for many seeds in seconds, where `python -m bench.lab` replays one seed for real in
ten minutes a system. For tuning the queue's rules; the replay of record stays bench.lab
(real daemon, real clients, real Slurm to compare with).

    python -m bench.lab.simulate                          # seeds 1-30, vaccel and vaccel-policy
    python -m bench.lab.simulate --seeds 1,4,9 --baseline /path/to/other/checkout
    python -m bench.lab.simulate --seeds 1-30 --systems vaccel --json

Every job holds its devices from its grant for its hold (bench/lab/plan.py: its duration,
cut at its time limit) and gives them back; the manager runs with the bench's settings
(fair_half_life 24 h, aging 24 h, time_default 24 h, the policy's cap). Lending's call-backs
need a job that checkpoints, which this loop does not model: the cap is simulated without
lend_idle. A seed replayed here mostly gives the figures bench.lab's vaccel system gives
for it to within a few thousandths (seed 1: utilisation 0.680, idle-while-waiting 14.4
against 14.5 device-hours, Jain 0.847 on the same commit), not always: where a real grant
lands a moment differently the day can take another branch (seed 2 gave 0.653 for real
against 0.714 here). `--baseline TREE` runs the same seeds
with TREE's lease manager in the same run, for ratios taken within one run.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from bench.lab import plan
from bench.lab.metrics import Outcome, figures
from bench.lab.trace import HOUR, generate
from brokerd.base.process import Holder
from brokerd.contract import Requirement
from brokerd.devices.model import Device
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Ask, Lease, UserLimits

SYSTEMS = ("vaccel", "vaccel-policy-nolend")
KEYS = ("utilization", "idle_while_waiting_s", "jain")


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _device(i: int) -> Device:
    return Device(index=i, uuid=f"GPU-{i}", vendor="nvidia", name="NVIDIA A100-SXM4-80GB", memory_mib=81920,
                  backend="cuda", arch="sm_80", simulated=True)


def simulate(seed: int, system: str, devices: int = 8, speed: float = 180.0, hours: float = 24.0,
             users: int = 20) -> list[Outcome]:
    """One seed's jobs as the lease manager serves them (lab seconds), with bench.lab's
    time-limit rounding at `speed` so that the figures match its replay."""
    jobs = generate(seed, hours, users)
    compression = plan.Compression(speed)
    clock = _Clock()
    counter = itertools.count()
    manager = LeaseManager([_device(i) for i in range(devices)], clock=clock, ttl_s=float("inf"),
                           new_id=lambda prefix: f"{prefix}{next(counter)}")
    manager.usage.half_life_s, manager.aging_s = 24 * HOUR, 24 * HOUR
    cap = max(max(j.gpus for j in jobs), devices // 2) if "-policy" in system else 0
    default_limit = compression.limit(plan.DEFAULT_LIMIT_S)
    uids = {user: 61001 + i for i, user in enumerate(sorted({j.user for j in jobs}))}
    events: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    for step in plan.steps(jobs, system, compression):
        heapq.heappush(events, (step.job.submit_s, next(order), "ask", step))
    waiting: dict[str, plan.Step] = {}
    holding: dict[str, plan.Step] = {}
    started: dict[int, float] = {}
    ended: dict[int, float] = {}

    def granted(step: plan.Step, lease: Lease) -> None:
        started[step.job.id], holding[lease.id] = clock.now, step
        heapq.heappush(events, (clock.now + step.hold_s, next(order), "end", lease.id))

    while events:
        clock.now, _, kind, what = heapq.heappop(events)
        if kind == "ask":
            uid = uids[what.job.user]
            holder = Holder(uid, uid, 100000 + what.job.id, 1, what.job.user)
            ask = Ask(time_limit_s=what.time_limit_s or default_limit, reservation=what.reservation)
            outcome = manager.submit(holder, Requirement(what.job.gpus), wait=True, ask=ask,
                                     limits=UserLimits(max_devices=cap))
            if isinstance(outcome, Lease):
                granted(what, outcome)
            else:
                waiting[outcome.id] = what
        elif what in manager.leases:
            manager.release(what, manager.leases[what].holder.uid)
            ended[holding[what].job.id] = clock.now
        for lease in manager.expire():  # a job cut at its limit ends there
            ended[holding[lease.id].job.id] = clock.now
        for grant in manager.pump():
            granted(waiting.pop(grant.request.id), grant.lease)
    return [Outcome(j.id, j.user, j.gpus, j.submit_s, started[j.id], ended[j.id]) for j in jobs]


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out += list(range(int(low), int(high or low) + 1))
    return out


def run(seeds: list[int], systems: list[str], devices: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for system in systems:
        per_seed = {seed: {k: figures(simulate(seed, system, devices), devices)[k] for k in KEYS}
                    for seed in seeds}
        result[system] = {"seeds": per_seed,
                          "mean": {k: statistics.mean(f[k] for f in per_seed.values()) for k in KEYS}}
    return result


def _baseline(tree: str, argv: list[str]) -> dict[str, Any]:
    """The same seeds through another checkout's lease manager (and bench.lab), with this
    file's loop, in a child whose imports come from that checkout."""
    runner = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", runner, os.path.abspath(__file__), *argv, "--json"],
                          env={**os.environ, "PYTHONPATH": os.path.abspath(tree)}, cwd=tree,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench.lab.simulate: the baseline {tree} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)["systems"]


def render(result: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    lines = [f"{'':24}{'seed':>6}{'util':>8}{'idle dev-h':>12}{'Jain':>8}"]
    for system, got in result.items():
        for seed, f in [*got["seeds"].items(), ("mean", got["mean"])]:
            idle_h = f["idle_while_waiting_s"] / HOUR
            row = f"{system:<24}{seed:>6}{f['utilization']:>8.3f}{idle_h:>12.1f}{f['jain']:>8.3f}"
            if baseline and system in baseline:
                b = baseline[system]["mean"] if seed == "mean" else baseline[system]["seeds"][str(seed)]
                row += (f"   baseline {b['utilization']:.3f} {b['idle_while_waiting_s'] / HOUR:5.1f} {b['jain']:.3f}")
            lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=_seeds, default=list(range(1, 31)), help="e.g. 1,4,9 or 1-30 (default 1-30)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"from {','.join(SYSTEMS)}")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--baseline", metavar="TREE", help="another checkout: its lease manager on the same seeds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if unknown := [s for s in systems if s not in SYSTEMS]:
        parser.error(f"unknown system {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    result = run(args.seeds, systems, args.devices)
    baseline = None
    if args.baseline:
        forwarded = ["--seeds", ",".join(map(str, args.seeds)), "--systems", ",".join(systems),
                     "--devices", str(args.devices)]
        baseline = _baseline(args.baseline, forwarded)
    if args.json:
        print(json.dumps({"systems": result, **({"baseline": baseline} if baseline else {})}, indent=2))
    else:
        print(render(result, baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())

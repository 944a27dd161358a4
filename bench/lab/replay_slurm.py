"""Replay a trace against a real single-node Slurm with backfill (bench/testbeds/slurm.py:
Debian's slurm-wlm, fake GPUs as GRES) on as many GPUs as the vaccel replay.

Each job is an `sbatch --gres=gpu:N [--time=M]` submitted at its moment; its script stamps
its start and end (bash's $EPOCHREALTIME, the same clock the vaccel drivers read) around a
`sleep` of its hold. Slurm's launch and clean-up are outside the stamps: a GPU is busy, for
these figures, while the job's own command runs, as for vaccel between grant and release.

Slurm as a lab would set it, with its clocks scaled to the replay (`settings`):
- sched/backfill, priority/basic: first come, first served plus backfill. A lab would add
  priority/multifactor fair-share, which needs slurmdbd and a database; the test cluster
  has no accounting, so there is none here (vaccel's fair queue has no such counterpart
  on this side: say so when comparing fairness);
- partition DefaultTime 24 h and MaxTime 7 d (vaccel's time_default and time_max), in
  whole real minutes;
- SchedulerParameters: bf_interval, sched_interval and bf_resolution at their minimum
  (1 s; the defaults 30 s, 60 s and 60 s divided by any useful speed are below it),
  bf_window as long as MaxTime (the man page's advice), bf_continue, and a queue depth
  that tests every pending job.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lab.metrics import Outcome
from bench.lab.plan import DEFAULT_LIMIT_S, MAX_LIMIT_S, Compression, Step
from bench.lab.replay_vaccel import START_MARGIN_S, ReplayError

JOB_SCRIPT = """#!/bin/bash
echo "start $EPOCHREALTIME" > "$1"
sleep "$2"
echo "end $EPOCHREALTIME" >> "$1"
"""
SUBMITTERS = 4  # sbatch calls in flight at once: a burst is not queued behind one sbatch


def settings(compression: Compression) -> tuple[str, str]:
    """(slurm.conf lines, partition limits) for this speed."""
    longest = compression.minutes(MAX_LIMIT_S)
    lines = ("PriorityType=priority/basic\n"
             f"SchedulerParameters=bf_interval=1,sched_interval=1,bf_resolution=1,bf_window={longest},"
             "bf_continue,bf_max_job_test=10000,default_queue_depth=10000")
    return lines, f"DefaultTime={compression.minutes(DEFAULT_LIMIT_S)} MaxTime={longest}"


def _submit(cluster: Any, step: Step, script: Path, stamps: Path, compression: Compression) -> str:
    args = ["sbatch", "--parsable", "--quiet", f"--job-name=lab{step.job.id}", "--output=/dev/null",
            "--ntasks=1", "--cpus-per-task=1", f"--gres=gpu:{step.job.gpus}"]
    if step.time_limit_s:
        args.append(f"--time={compression.minutes(step.time_limit_s)}")
    done = cluster.run(*args, str(script), str(stamps / f"{step.job.id}"), f"{compression.real(step.hold_s):.3f}",
                       timeout=60)
    if done.returncode:
        return f"job {step.job.id}: sbatch failed: {done.stderr.strip()}"
    return ""


def _read_stamps(path: Path) -> tuple[float, float] | None:
    try:
        words = path.read_text().split()
    except OSError:
        return None
    if len(words) != 4 or words[0] != "start" or words[2] != "end":
        return None
    return float(words[1]), float(words[3])


def replay(steps: list[Step], compression: Compression, devices: int,
           timeout_s: float) -> tuple[list[Outcome], dict[str, Any]]:
    """Run the steps on a fresh cluster; the jobs' outcomes and how it was set up."""
    from bench.testbeds.slurm import SlurmCluster  # the tests' cluster: needs root and slurm-wlm

    root = Path(tempfile.mkdtemp(prefix="vaccel-bench-lab-slurm-"))
    conf, partition = settings(compression)
    cluster = SlurmCluster(root / "cluster", gpus=devices, cpus=2 * devices, settings=conf, partition=partition)
    try:
        cluster.start()
        script, stamps = root / "job.sh", root / "stamps"
        script.write_text(JOB_SCRIPT)
        script.chmod(0o755)
        stamps.mkdir()
        start = time.time() + START_MARGIN_S
        errors = _submit_all(cluster, steps, script, stamps, compression, start)
        if errors:
            raise ReplayError(f"slurm: {len(errors)} submission(s) failed: {'; '.join(errors[:3])}")
        deadline = start + timeout_s
        while True:
            seen = {s.job.id: _read_stamps(stamps / f"{s.job.id}") for s in steps}
            if all(seen.values()):
                break
            if time.time() > deadline:
                late = [i for i, v in seen.items() if v is None]
                raise ReplayError(f"slurm: {len(late)} job(s) had not ended after {timeout_s:.0f} s "
                                  f"(first: {late[:5]})\n{cluster.logs()[-2000:]}")
            time.sleep(1.0)
        outcomes = [Outcome(s.job.id, s.job.user, s.job.gpus, s.job.submit_s,
                            compression.lab(seen[s.job.id][0] - start),  # type: ignore[index]
                            compression.lab(seen[s.job.id][1] - start))  # type: ignore[index]
                    for s in steps]
        return outcomes, {"slurm.conf": f"{conf}\nPartitionName=... {partition}"}
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _submit_all(cluster: Any, steps: list[Step], script: Path, stamps: Path, compression: Compression,
                start: float) -> list[str]:
    """Submit each job at its moment; the sbatch failures."""
    with concurrent.futures.ThreadPoolExecutor(SUBMITTERS) as pool:
        pending = []
        for step in sorted(steps, key=lambda s: s.job.submit_s):
            while (left := start + compression.real(step.job.submit_s) - time.time()) > 0:
                time.sleep(left)
            pending.append(pool.submit(_submit, cluster, step, script, stamps, compression))
        return [error for future in pending if (error := future.result())]

"""Replay a trace against a real single-node Slurm with backfill (bench/testbeds/slurm.py:
Debian's slurm-wlm, fake GPUs as GRES) on as many GPUs as the vaccel replay.

Each job is an `sbatch --gres=gpu:N [--time=M]` submitted at its moment; its script stamps
its start and end (bash's $EPOCHREALTIME, the same clock the vaccel drivers read) around a
`sleep` of its hold. Slurm's launch and clean-up are outside the stamps: a GPU is busy, for
these figures, while the job's own command runs, as for vaccel between grant and release.

Slurm as a lab would set it, with its clocks scaled to the replay (`settings`):
- "slurm-fs" (the comparison of record): sched/backfill with priority/multifactor fair
  share through slurmdbd on a MariaDB the replay starts (bench/testbeds/slurm_accounting.py),
  one association per lab user with equal shares, each job submitted under its user's own
  uid (a Unix account `vlab-NAME` per lab user, made when missing), PriorityDecayHalfLife
  at vaccel's fair_half_life (24 h) and PriorityMaxAge at 4 h (the age factor, a tenth of
  fair share's weight, is full after 4 h, as in every comparison of record; vaccel weighs
  each hour waited against its user's use instead), both scaled to the replay (whole real
  minutes, at least 1), PriorityCalcPeriod at its 1-minute minimum (the
  coarsest clock left: at 180x, fair share is recomputed every 3 lab hours). With
  "-policy", a QOS caps each user's GPUs at vaccel-policy's max_devices;
- "slurm": priority/basic, first come, first served plus backfill, all jobs as root;
- partition DefaultTime 24 h and MaxTime 7 d (vaccel's time_default and time_max), in
  whole real minutes;
- SchedulerParameters: bf_interval, sched_interval and bf_resolution at their minimum
  (1 s; the defaults 30 s, 60 s and 60 s divided by any useful speed are below it),
  bf_window as long as MaxTime (the man page's advice), bf_continue, and a queue depth
  that tests every pending job.
"""

from __future__ import annotations

import concurrent.futures
import pwd
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lab.metrics import Outcome
from bench.lab.plan import DEFAULT_LIMIT_S, MAX_LIMIT_S, Compression, Step
from bench.lab.replay_vaccel import START_MARGIN_S, ReplayError
from bench.lab.trace import HOUR

FAIR_HALF_LIFE_S = 24 * HOUR  # vaccel's fair_half_life, as the replay gives it
MAX_AGE_S = 4 * HOUR  # Slurm's PriorityMaxAge, as every comparison of record ran it

JOB_SCRIPT = """#!/bin/bash
echo "start $EPOCHREALTIME" > "$1"
sleep "$2"
echo "end $EPOCHREALTIME" >> "$1"
"""
SUBMITTERS = 4  # sbatch calls in flight at once: a burst is not queued behind one sbatch


def settings(compression: Compression, fair_share: bool = False) -> tuple[str, str]:
    """(slurm.conf lines, partition limits) for this speed (with fair share, the priority
    lines are the accounting's: bench/testbeds/slurm_accounting.py)."""
    longest = compression.minutes(MAX_LIMIT_S)
    lines = ("" if fair_share else "PriorityType=priority/basic\n") + (
             f"SchedulerParameters=bf_interval=1,sched_interval=1,bf_resolution=1,bf_window={longest},"
             "bf_continue,bf_max_job_test=10000,default_queue_depth=10000")
    return lines, f"DefaultTime={compression.minutes(DEFAULT_LIMIT_S)} MaxTime={longest}"


def unix_name(user: str) -> str:
    """The Unix account a lab user's jobs run under on slurm-fs."""
    return "vlab-" + re.sub(r"[^a-z0-9-]", "-", user.lower())[:24]


def _submit(cluster: Any, step: Step, script: Path, stamps: Path, compression: Compression,
            as_user: list[str]) -> str:
    args = [*as_user, "sbatch", "--parsable", "--quiet", f"--job-name=lab{step.job.id}", "--output=/dev/null",
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


def _accounting(steps: list[Step], compression: Compression, devices: int,
                system: str) -> tuple[Any, dict[str, list[str]]]:
    """slurm-fs's accounting (None for FIFO Slurm) and each lab user's `setpriv` prefix."""
    from bench.testbeds.slurm_accounting import Accounting, as_user_argv, ensure_users

    users = sorted({s.job.user for s in steps})
    if not system.startswith("slurm-fs"):
        return None, {user: [] for user in users}
    names = {user: unix_name(user) for user in users}
    uids = ensure_users(list(names.values()))
    prefix = {user: as_user_argv(uids[name], pwd.getpwnam(name).pw_gid, []) for user, name in names.items()}
    cap = max(max(s.job.gpus for s in steps), devices // 2) if system.endswith("-policy") else 0
    accounting = Accounting(list(names.values()), half_life_min=compression.minutes(FAIR_HALF_LIFE_S),
                            max_age_min=compression.minutes(MAX_AGE_S), user_gpus=cap)
    return accounting, prefix


def replay(steps: list[Step], compression: Compression, devices: int,
           timeout_s: float, system: str = "slurm") -> tuple[list[Outcome], dict[str, Any]]:
    """Run the steps on a fresh cluster; the jobs' outcomes and how it was set up."""
    from bench.testbeds.slurm import SlurmCluster  # the tests' cluster: needs root and slurm-wlm

    root = Path(tempfile.mkdtemp(prefix="vaccel-bench-lab-slurm-"))
    root.chmod(0o755)  # the lab users' jobs reach the script and their stamps here
    accounting, as_user = _accounting(steps, compression, devices, system)
    conf, partition = settings(compression, fair_share=accounting is not None)
    cluster = SlurmCluster(root / "cluster", gpus=devices, cpus=2 * devices, settings=conf, partition=partition,
                           accounting=accounting)
    try:
        cluster.start(timeout=180)
        script, stamps = root / "job.sh", root / "stamps"
        script.write_text(JOB_SCRIPT)
        script.chmod(0o755)
        stamps.mkdir()
        stamps.chmod(0o1777)
        start = time.time() + START_MARGIN_S
        errors = _submit_all(cluster, steps, script, stamps, compression, start, as_user)
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
        setup: dict[str, Any] = {"slurm.conf": f"{conf}\nPartitionName=... {partition}"}
        if accounting is not None:
            setup["slurm.conf"] += "\n" + accounting.slurm_conf(Path("MUNGE_SOCKET")) + accounting.partition()
            # Each association's fair-share figures at the end (sshare -P: Account|User|RawShares|
            # NormShares|RawUsage|EffectvUsage|FairShare): that fair share was in force.
            setup["sshare"] = cluster.run("sshare", "-a", "-P", timeout=30).stdout.splitlines()
            # The QOS its jobs ran under (the cap of slurm-fs-policy is its MaxTRESPerUser).
            setup["qos"] = cluster.run("sacctmgr", "-n", "-P", "show", "qos", "normal", "format=Name,MaxTRESPU",
                                       timeout=30).stdout.strip()
        return outcomes, setup
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _submit_all(cluster: Any, steps: list[Step], script: Path, stamps: Path, compression: Compression,
                start: float, as_user: dict[str, list[str]]) -> list[str]:
    """Submit each job at its moment; the sbatch failures."""
    with concurrent.futures.ThreadPoolExecutor(SUBMITTERS) as pool:
        pending = []
        for step in sorted(steps, key=lambda s: s.job.submit_s):
            while (left := start + compression.real(step.job.submit_s) - time.time()) > 0:
                time.sleep(left)
            pending.append(pool.submit(_submit, cluster, step, script, stamps, compression, as_user[step.job.user]))
        return [error for future in pending if (error := future.result())]

"""How a lab trace is compressed for a replay, the same way for every system.

`speed` lab seconds pass per real second. Slurm counts time limits in whole minutes, so
every time limit any system sees (a job's `--time`, the default for jobs that give none,
the ceiling) is rounded up to whole *real* minutes: both systems then know exactly as much
about when a job will end. A job ends by itself at its duration or at its time limit,
whichever comes first (the trace's overrunning jobs are cut at the limit on both systems:
Slurm's own kill only comes at its next 30 s time-limit sweep, which at this speed would be
up to `30 * speed` lab seconds late).

The systems differ only in what their users say:
- "vaccel" and "slurm": the trace as it is (most jobs give no `--time`; they get the lab's
  default time limit, 24 h);
- "vaccel-policy" (docs/policy.md's advice: a per-user cap with [policy] lend_idle; and
  "vaccel-policy-nolend", the cap alone): every job gives `--time`: the one it gave, else
  what a user who must give one says: twice the duration, rounded up to the hour (a 10 min
  job says 1 h);
- "slurm-policy" (not run unless asked for): Slurm with the same `--time` on every job, to
  tell what the lab's policy buys from what vaccel does with it.
"slurm-fs" and "slurm-fs-policy" are Slurm as a shared lab runs it (fair share through
slurmdbd, bench/lab/replay_slurm.py), the comparison of record; "-policy" there also caps
each user's GPUs through the QOS, as vaccel-policy's max_devices does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.lab.trace import HOUR, INTERACTIVE, Job

DEFAULT_LIMIT_S = 24 * HOUR  # vaccel's time_default, and the Slurm partition's DefaultTime
MAX_LIMIT_S = 7 * 86400.0  # vaccel's time_max, and the partition's MaxTime
SYSTEMS = ("vaccel", "vaccel-policy", "slurm-fs", "slurm-fs-policy", "vaccel-policy-nolend", "slurm", "slurm-policy")
DEFAULT_SYSTEMS = SYSTEMS[:3]  # the comparison of record: vaccel and vaccel-policy against slurm-fs


@dataclass(frozen=True)
class Compression:
    speed: float  # lab seconds per real second

    @property
    def limit_step_s(self) -> float:
        """The time-limit granularity in lab seconds: one real minute."""
        return 60.0 * self.speed

    def limit(self, lab_s: float) -> float:
        """A time limit in lab seconds, rounded up to whole real minutes (0 stays 0)."""
        return math.ceil(lab_s / self.limit_step_s - 1e-9) * self.limit_step_s if lab_s > 0 else 0.0

    def real(self, lab_s: float) -> float:
        return lab_s / self.speed

    def lab(self, real_s: float) -> float:
        return real_s * self.speed

    def minutes(self, lab_s: float) -> int:
        """A rounded time limit as Slurm's whole real minutes."""
        return round(self.limit(lab_s) / self.limit_step_s)


@dataclass(frozen=True)
class Step:
    """One job as a system replays it, in lab seconds."""

    job: Job
    hold_s: float  # how long it holds the devices once it has them
    time_limit_s: float  # the --time it gives, rounded (0: none, the default applies)

    @property
    def reservation(self) -> bool:
        return self.job.kind == INTERACTIVE


def stated_limit(job: Job, system: str) -> float:
    """The --time the job's user gives on `system`, in lab seconds (0: none)."""
    if job.time_limit_s or "-policy" not in system:
        return job.time_limit_s
    return min(max(HOUR, math.ceil(2 * job.duration_s / HOUR) * HOUR), MAX_LIMIT_S)


def steps(jobs: list[Job], system: str, compression: Compression) -> list[Step]:
    """What each job does on `system`: its hold ends at its duration or at the time limit
    it runs under (its own, else the default), rounded as every system sees it."""
    out = []
    for job in jobs:
        limit = compression.limit(stated_limit(job, system))
        ceiling = limit or compression.limit(DEFAULT_LIMIT_S)
        out.append(Step(job, min(job.duration_s, ceiling), limit))
    return out

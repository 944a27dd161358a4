"""What a system did with a trace, as a lab head reads it: pure functions of the jobs'
observed moments (lab seconds from the trace's start), the same for every system.

- utilization: device-seconds held / (devices x makespan); makespan runs from the trace's
  start to the last job's end.
- idle_while_waiting_s: device-seconds during which a device was free while a waiting
  request that fits the free devices waited: at each moment, min(free devices, the GPUs
  asked by the waiting requests of at most that many GPUs). A 4-GPU request waiting while
  3 are free adds nothing (it cannot start there); a 1-GPU request waiting while 3 are
  free adds 1 (the other 2 had nobody to serve). Requests a policy limit holds back count:
  the device is idle all the same.
- wait p50/p90/max: granted - submitted, over the jobs.
- jain: Jain's fairness index over users of their service rate, the share of their jobs'
  time in the system that they ran, GPU-weighted: sum(gpus x run) / sum(gpus x (wait + run)).
  1.0 when every user is served alike (all never waited, or all waited in proportion).
- slowdown: each user's mean bounded slowdown, max(1, (wait + run) / max(run, 10 min)); the
  summary is its median and maximum over users.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.stats import median, percentile

SLOWDOWN_FLOOR_S = 600.0  # a 1-minute job that waited 10 minutes is not "11x slower"


@dataclass(frozen=True)
class Outcome:
    """One job as a system ran it, in lab seconds from the trace's start."""

    job_id: int
    user: str
    gpus: int
    submit_s: float
    start_s: float  # its first start
    end_s: float  # its last end
    # When it ran in pieces (a borrowed lease called back, the rest run on a new lease):
    # each piece's (start, end); empty for one piece from start_s to end_s.
    runs: tuple[tuple[float, float], ...] = ()

    @property
    def pieces(self) -> tuple[tuple[float, float], ...]:
        return self.runs or ((self.start_s, self.end_s),)

    @property
    def run_s(self) -> float:
        return sum(max(0.0, end - start) for start, end in self.pieces)

    @property
    def wait_s(self) -> float:
        """Its time in the system not running: before its start, and between its pieces."""
        return max(0.0, self.end_s - self.submit_s - self.run_s)

    def running(self, at: float) -> bool:
        return any(start <= at < end for start, end in self.pieces)

    def waiting(self, at: float) -> bool:
        return self.submit_s <= at < self.end_s and not self.running(at)


def _moments(outcomes: Sequence[Outcome]) -> list[float]:
    return sorted({t for o in outcomes for t in (o.submit_s, o.end_s, *(x for run in o.pieces for x in run))})


def idle_while_waiting(outcomes: Sequence[Outcome], devices: int) -> float:
    """Device-seconds free while a waiting request that fits them waited (see above)."""
    moments = _moments(outcomes)
    total = 0.0
    for begin, end in itertools.pairwise(moments):
        middle = (begin + end) / 2
        held = sum(o.gpus for o in outcomes if o.running(middle))
        free = max(0, devices - held)
        if not free:
            continue
        asked = sum(o.gpus for o in outcomes if o.gpus <= free and o.waiting(middle))
        total += min(free, asked) * (end - begin)
    return total


def jain(values: Iterable[float]) -> float:
    """Jain's index: (sum x)^2 / (n sum x^2), 1.0 = all equal, 1/n = one gets everything."""
    xs = list(values)
    squares = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * squares) if squares else 1.0


def service_rates(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Each user's GPU-weighted share of their jobs' time in the system spent running."""
    ran: dict[str, float] = {}
    stayed: dict[str, float] = {}
    for o in outcomes:
        ran[o.user] = ran.get(o.user, 0.0) + o.gpus * o.run_s
        stayed[o.user] = stayed.get(o.user, 0.0) + o.gpus * (o.wait_s + o.run_s)
    return {user: ran[user] / stayed[user] if stayed[user] else 1.0 for user in sorted(ran)}


def slowdowns(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Each user's mean bounded slowdown."""
    per_user: dict[str, list[float]] = {}
    for o in outcomes:
        per_user.setdefault(o.user, []).append(max(1.0, (o.wait_s + o.run_s) / max(o.run_s, SLOWDOWN_FLOOR_S)))
    return {user: sum(v) / len(v) for user, v in sorted(per_user.items())}


def figures(outcomes: Sequence[Outcome], devices: int) -> dict[str, object]:
    """Every figure of one system's run (the --json shape of one system)."""
    makespan = max((o.end_s for o in outcomes), default=0.0)
    held = sum(o.gpus * o.run_s for o in outcomes)
    waits = [o.wait_s for o in outcomes]
    slow = slowdowns(outcomes)
    rates = service_rates(outcomes)
    return {
        "jobs": len(outcomes),
        "utilization": held / (devices * makespan) if makespan else 0.0,
        "idle_while_waiting_s": idle_while_waiting(outcomes, devices),
        "wait_p50_s": median(waits),
        "wait_p90_s": percentile(waits, 90),
        "wait_max_s": max(waits, default=0.0),
        "jain": jain(rates.values()),
        "slowdown_user_median": median(list(slow.values())),
        "slowdown_user_max": max(slow.values(), default=0.0),
        "makespan_s": makespan,
        "device_hours": held / 3600.0,
        "per_user": {user: {"service": rate, "slowdown": slow[user]} for user, rate in rates.items()},
    }


# Ratios vaccel / Slurm; for each, whether above 1 is better for vaccel.
RATIO_KEYS = {"utilization": True, "idle_while_waiting_s": False, "wait_p50_s": False, "wait_p90_s": False,
              "wait_max_s": False, "jain": True, "slowdown_user_median": False, "makespan_s": False}


def ratios(systems: dict[str, dict[str, object]], reference: str = "slurm") -> dict[str, dict[str, float | None]]:
    """Each other system's figures divided by the reference's (None where it is 0)."""
    if reference not in systems:
        return {}
    base = systems[reference]
    out: dict[str, dict[str, float | None]] = {}
    for name, values in systems.items():
        if name == reference:
            continue
        out[name] = {}
        for key in RATIO_KEYS:
            denominator = float(base[key])  # type: ignore[arg-type]
            out[name][key] = float(values[key]) / denominator if denominator else None  # type: ignore[arg-type]
    return out

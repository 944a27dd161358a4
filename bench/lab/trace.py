"""A lab trace: who asked for how many GPUs when, for how long, and whether they said how
long (`--time`). Generated from a seed, or read from a file (JSON lines or CSV).

Every time is in lab seconds: `submit_s` from the trace's start, `duration_s` how long the
job would run if nothing stopped it, `time_limit_s` the `--time` it gave (0: none, the
system's default applies). `kind` is "batch" or "interactive" (a `vaccel reserve` /
`salloc` hold, released by hand when the person is done, idle part of the time).

The generator models a lab of `users` people over `hours` of lab time starting at 09:00:
- arrivals follow the day (busy 09-19 h, quieter in the evening, few at night), each user
  at their own rate: 3 heavy users, 12 regular, the rest light;
- one deadline per lab day (at 21:00): in the 8 h before it half the users submit 3x as often;
- 1, 2 or 4 GPUs (heavy users ask for more);
- batch durations are log-normal (median 40 min, heavy users 80 min), 10 min to 24 h, and
  clipped so that a job started at once ends by the trace's end (the replay's length is
  then the trace's plus the queue's drain);
- 30 % of batch jobs (half of the heavy users') give `--time`: most of them twice or so
  what they need rounded up to the hour, one in ten less than they need (they hit it);
- 12 % of the light and regular users' jobs are interactive holds of 20 min to 8 h, each with
  a `--time` of the hold rounded up to 2, 4 or 8 h (they give it back early).
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path

HOUR = 3600.0
MINUTE = 60.0
BATCH, INTERACTIVE = "batch", "interactive"
KINDS = (BATCH, INTERACTIVE)
DAY_START_H = 9.0  # lab time 0 is 09:00
DEADLINE_H = 21.0  # one deadline each lab day
BURST_H = 8.0  # how long before a deadline the rush starts
SHORTEST_S = 10 * MINUTE
LONGEST_S = 24 * HOUR


@dataclass(frozen=True)
class Job:
    id: int
    user: str
    submit_s: float
    gpus: int
    duration_s: float
    time_limit_s: float = 0.0  # the --time it gave; 0 = none
    kind: str = BATCH


class TraceError(ValueError):
    """A trace file cannot be used; the message says which line and why."""


# -- generation -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Profile:
    name: str
    rate_per_h: float  # submissions per lab hour at the busiest time of day
    gpus_weights: tuple[float, float, float]  # for 1, 2, 4 GPUs
    median_s: float
    limit_given: float  # share of batch jobs that give --time
    interactive: float  # share of jobs that are interactive holds
    rushes: bool  # submits more before a deadline


def _profiles(users: int, rng: random.Random) -> list[_Profile]:
    heavy = min(3, users)
    light = max(0, users - heavy - 12)
    rushing = set(rng.sample(range(users), users // 2))
    out = []
    for i in range(users):
        kind = "heavy" if i < heavy else "light" if i >= users - light else "regular"
        rate, gpus, median, given, interactive = {
            "heavy": (0.3, (0.4, 0.35, 0.25), 80 * MINUTE, 0.4, 0.0),
            "regular": (0.09, (0.75, 0.2, 0.05), 40 * MINUTE, 0.25, 0.12),
            "light": (0.04, (0.85, 0.15, 0.0), 40 * MINUTE, 0.25, 0.12),
        }[kind]
        out.append(_Profile(f"user{i + 1:02d}", rate, gpus, median, given, interactive, i in rushing))
    return out


def _day_factor(t_s: float) -> float:
    """How busy the lab is at lab time t (1.0 = the busiest hours)."""
    hour = (DAY_START_H + t_s / HOUR) % 24
    if 9 <= hour < 19:
        return 1.0
    if 19 <= hour < 24:
        return 0.6
    return 0.15


def _rushing(t_s: float) -> bool:
    hour = (DAY_START_H + t_s / HOUR) % 24
    return DEADLINE_H - BURST_H <= hour < DEADLINE_H


def _round_up(seconds: float, step: float) -> float:
    return math.ceil(seconds / step) * step


def _job(profile: _Profile, submit_s: float, hours: float, rng: random.Random) -> tuple[str, int, float, float]:
    """(kind, gpus, duration, time limit) of one submission."""
    room = max(hours * HOUR - submit_s, SHORTEST_S)
    if rng.random() < profile.interactive:
        hold = min(math.exp(rng.gauss(math.log(90 * MINUTE), 0.7)), 8 * HOUR)
        hold = min(max(hold, 20 * MINUTE), room)
        limit = next(h * HOUR for h in (2, 4, 8) if h * HOUR >= hold)
        return INTERACTIVE, 1, round(hold), limit
    gpus = rng.choices((1, 2, 4), weights=profile.gpus_weights)[0]
    duration = math.exp(rng.gauss(math.log(profile.median_s), 1.5))
    duration = min(max(duration, SHORTEST_S), LONGEST_S, room)
    limit = 0.0
    if rng.random() < profile.limit_given:
        factor = rng.uniform(0.5, 0.9) if rng.random() < 0.1 else math.exp(rng.gauss(math.log(2.0), 0.4))
        limit = max(HOUR, _round_up(duration * factor, HOUR))
    return BATCH, gpus, round(duration), limit


def generate(seed: int, hours: float, users: int = 20) -> list[Job]:
    """A trace of `users` people over `hours` of lab time, the same for the same seed."""
    rng = random.Random(seed)
    end_s = hours * HOUR
    arrivals: list[tuple[float, _Profile]] = []
    for profile in _profiles(users, rng):
        peak = profile.rate_per_h * (3.0 if profile.rushes else 1.0) / HOUR
        t = 0.0
        while True:  # a Poisson process at the peak rate, thinned to the time of day
            t += rng.expovariate(peak)
            if t >= end_s:
                break
            rate = profile.rate_per_h * _day_factor(t) * (3.0 if profile.rushes and _rushing(t) else 1.0) / HOUR
            if rng.random() < rate / peak:
                arrivals.append((round(t), profile))
    arrivals.sort(key=lambda a: (a[0], a[1].name))
    jobs = []
    for number, (submit_s, profile) in enumerate(arrivals, start=1):
        kind, gpus, duration, limit = _job(profile, submit_s, hours, rng)
        jobs.append(Job(number, profile.name, float(submit_s), gpus, float(duration), float(limit), kind))
    return jobs


# -- files ------------------------------------------------------------------------------

FIELDS = tuple(f.name for f in fields(Job))


def _checked(raw: dict[str, object], where: str) -> Job:
    missing = [name for name in ("user", "submit_s", "gpus", "duration_s") if raw.get(name) in (None, "")]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    try:
        job = Job(id=int(raw.get("id") or 0), user=str(raw["user"]), submit_s=float(raw["submit_s"]),  # type: ignore[arg-type]
                  gpus=int(raw["gpus"]), duration_s=float(raw["duration_s"]),  # type: ignore[arg-type]
                  time_limit_s=float(raw.get("time_limit_s") or 0.0),  # type: ignore[arg-type]
                  kind=str(raw.get("kind") or BATCH))
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: {exc}") from None
    if job.gpus < 1 or job.duration_s <= 0 or job.submit_s < 0 or job.time_limit_s < 0:
        raise TraceError(f"{where}: gpus must be >= 1, duration_s > 0, submit_s and time_limit_s >= 0")
    if job.kind not in KINDS:
        raise TraceError(f"{where}: kind must be one of {', '.join(KINDS)}, got {job.kind!r}")
    return job


def _numbered(jobs: list[Job]) -> list[Job]:
    """Sorted by submission, with ids 1.. where the file gave none (or repeated one)."""
    jobs = sorted(jobs, key=lambda j: (j.submit_s, j.id))
    if len({j.id for j in jobs}) == len(jobs) and all(j.id > 0 for j in jobs):
        return jobs
    return [Job(**{**asdict(j), "id": i}) for i, j in enumerate(jobs, start=1)]


def parse(text: str, name: str = "<trace>") -> list[Job]:
    """A trace from JSON lines (one object per line) or CSV with a header line."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise TraceError(f"{name}: no jobs in it")
    if lines[0].lstrip().startswith("{"):
        jobs = []
        for number, line in enumerate(lines, start=1):
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{name}: line {number}: not JSON ({exc.msg})") from None
            if not isinstance(raw, dict):
                raise TraceError(f"{name}: line {number}: not a JSON object")
            jobs.append(_checked(raw, f"{name}: line {number}"))
    else:
        reader = csv.DictReader(io.StringIO("\n".join(lines)))
        jobs = [_checked(row, f"{name}: row {number}") for number, row in enumerate(reader, start=1)]
    return _numbered(jobs)


def read(path: Path) -> list[Job]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None
    return parse(text, str(path))


def to_jsonl(jobs: list[Job]) -> str:
    return "".join(json.dumps(asdict(job)) + "\n" for job in jobs)


def summary(jobs: list[Job], devices: int) -> dict[str, float]:
    """The trace's shape: counts, and the load it offers the devices over its span."""
    span = max((j.submit_s for j in jobs), default=0.0) or 1.0
    demand = sum(j.gpus * j.duration_s for j in jobs)
    return {"jobs": len(jobs), "users": len({j.user for j in jobs}),
            "with_time": sum(1 for j in jobs if j.time_limit_s > 0),
            "interactive": sum(1 for j in jobs if j.kind == INTERACTIVE),
            "gpu_hours": demand / HOUR, "offered_load": demand / (devices * span)}

"""Usage figures over a period, from the accounting rows (brokerd/state/accounting.py): pure
functions of their inputs, so the report's arithmetic is tested without a daemon.

One population per row: the leases that held devices at some moment of the row's
period. Their device-hours (and idle device-hours) are clipped to the period; their
waits give the percentiles; each is counted once under its end state ("active" while it
runs), so a row's end reasons add up to its leases. `by="day"` splits a lease across the
local days it spans; `by="lease"` gives each lease its own row, carrying the lease
(`ReportRow.lease`: who, when asked, granted and ended, its devices and time limit), the
export a lab replays (bench/lab/convert.py).

A long period is mostly whole days and months, and the leases within them come summed
per user (`DaySummary`, kept by brokerd/state/usage_days.py): their hours, idle hours,
lease count, end states and wait maximum exactly, their waits as a histogram of 1 % wide
buckets, so a percentile that falls among them is right to within 0.5 %.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

BY = ("user", "group", "device", "day", "lease")
STILL_ACTIVE = "active"  # the end state a report shows for a lease that still runs


@dataclass(frozen=True)
class UsageRow:
    """One lease as accounting keeps it. `ended_at` is the report's "now" for a lease that
    still runs (state "active"); `idle_device_s` is None where no probe reported
    utilisation for its devices."""

    lease_id: str
    uid: int
    user: str
    gid: int
    devices: tuple[str, ...]
    granted_at: float
    ended_at: float
    wait_s: float
    state: str
    end_reason: str = ""
    reservation: bool = False
    util_mean_pct: float | None = None
    idle_device_s: float | None = None
    weight: float | None = None  # devices it counted as, a memory share its part of its device; None: its devices
    time_limit_s: float = 0.0  # the time limit it was granted with (0: none)

    @property
    def device_weight(self) -> float:
        return float(len(self.devices)) if self.weight is None else self.weight


@dataclass
class DaySummary:
    """Leases of one uid (named `user`, counted under `gid`) summed as a report needs them:
    their seconds within the local day starting at `day`, and their lease figures."""

    day: float
    uid: int
    user: str
    gid: int
    device_s: float = 0.0
    idle_s: float = 0.0
    leases: int = 0
    wait_max: float = 0.0
    ends: dict[str, int] = field(default_factory=dict)
    waits: dict[int, int] = field(default_factory=dict)  # wait_bucket -> leases
    measured: int = 0  # pieces whose idleness a probe measured (0: the idle figure is unknown, not 0)

    def add(self, row: UsageRow, start: float, end: float) -> None:
        """Count a lease's part [start, end) of the day (as _Tally.add does)."""
        span, full = end - start, row.ended_at - row.granted_at
        self.device_s += row.device_weight * span
        if row.idle_device_s is not None:
            self.measured += 1
        if row.idle_device_s is not None and full > 0:
            self.idle_s += row.idle_device_s * (span / full) * row.device_weight / len(row.devices)
        self.leases += 1
        self.wait_max = max(self.wait_max, row.wait_s)
        self.ends[row.state] = self.ends.get(row.state, 0) + 1
        bucket = wait_bucket(row.wait_s)
        self.waits[bucket] = self.waits.get(bucket, 0) + 1

    def merge(self, other: DaySummary) -> None:
        self.device_s += other.device_s
        self.idle_s += other.idle_s
        self.measured += other.measured
        self.leases += other.leases
        self.wait_max = max(self.wait_max, other.wait_max)
        for state, n in other.ends.items():
            self.ends[state] = self.ends.get(state, 0) + n
        for bucket, n in other.waits.items():
            self.waits[bucket] = self.waits.get(bucket, 0) + n


_BUCKET_FLOOR_S = 0.001
_BUCKET_LOG = math.log(1.01)


def wait_bucket(wait_s: float) -> int:
    """The histogram bucket of a wait: 0 below a millisecond, else 1 % wide buckets."""
    if wait_s < _BUCKET_FLOOR_S:
        return 0
    return 1 + int(math.log(wait_s / _BUCKET_FLOOR_S) / _BUCKET_LOG)


def bucket_wait(bucket: int) -> float:
    """The wait a bucket stands for: its geometric middle (within 0.5 % of any wait in it)."""
    return 0.0 if bucket <= 0 else _BUCKET_FLOOR_S * math.exp((bucket - 0.5) * _BUCKET_LOG)


@dataclass(frozen=True)
class ReportRow:
    key: str
    device_hours: float = 0.0
    leases: int = 0
    wait_p50_s: float = 0.0
    wait_p90_s: float = 0.0
    wait_max_s: float = 0.0
    idle_device_hours: float = 0.0
    end_reasons: dict[str, int] = field(default_factory=dict)
    idle_measured: bool = False  # a probe measured the idleness of one of its leases (else the 0 is unknown)
    lease: UsageRow | None = None  # by lease: the lease the row is


@dataclass(frozen=True)
class Report:
    since: float
    until: float
    by: str
    rows: tuple[ReportRow, ...]
    total: ReportRow
    rows_hidden: bool = False  # per-user rows of other users were withheld from this viewer


def percentile(values: Sequence[float], q: int) -> float:
    """Nearest rank, as bench/stats.py: the ceil(q/100 * n)-th smallest value (integer
    arithmetic, so p90 of 10 values is the 9th, never the 10th); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = -(-q * len(ordered) // 100)
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def day_start(ts: float) -> float:
    """Local midnight at or before `ts` (a day is 23 or 25 hours across a DST change)."""
    t = time.localtime(ts)
    return time.mktime((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0, 0, 0, -1))


def next_day(start: float) -> float:
    # Noon of the day plus a day lands safely inside the next day whatever DST does.
    return day_start(start + 36 * 3600)


def _day_key(start: float) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(start))


class _Tally:
    """A row being summed: clipped hours, and each lease's wait and end state once."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.idle_seconds = 0.0
        self.idle_measured = False
        self.waits: dict[str, float] = {}
        self.ends: dict[str, str] = {}
        self.summed: DaySummary | None = None  # whole days' leases, summed (DaySummary)

    def merge(self, day: DaySummary) -> None:
        if self.summed is None:
            self.summed = DaySummary(0.0, 0, "", 0)
        self.summed.merge(day)
        self.seconds += day.device_s
        self.idle_seconds += day.idle_s
        self.idle_measured = self.idle_measured or day.measured > 0

    def _percentile(self, waits: list[float], q: int) -> float:
        """Nearest rank over the exact waits and the summed ones' buckets together."""
        if self.summed is None or not self.summed.waits:
            return percentile(waits, q)
        counted = sorted([*((w, 1) for w in waits), *((bucket_wait(b), n) for b, n in self.summed.waits.items())])
        rank = -(-q * sum(n for _, n in counted) // 100)
        for value, n in counted:
            rank -= n
            if rank <= 0:
                return value
        return counted[-1][0]

    def add(self, row: UsageRow, start: float, end: float, devices: float) -> None:
        span = end - start
        self.seconds += devices * span
        if row.idle_device_s is not None:
            self.idle_measured = True
            full = row.ended_at - row.granted_at
            # Idle time is kept per lease, not per moment: a clipped share is pro rata.
            share = span / full if full > 0 else 0.0
            self.idle_seconds += row.idle_device_s * share * devices / len(row.devices)
        self.waits[row.lease_id] = row.wait_s
        self.ends[row.lease_id] = row.state

    def row(self, key: str) -> ReportRow:
        waits = list(self.waits.values())
        summed = self.summed or DaySummary(0.0, 0, "", 0)
        reasons: dict[str, int] = dict(summed.ends)
        for state in self.ends.values():
            reasons[state] = reasons.get(state, 0) + 1
        return ReportRow(key=key, device_hours=self.seconds / 3600, leases=len(waits) + summed.leases,
                         wait_p50_s=self._percentile(waits, 50), wait_p90_s=self._percentile(waits, 90),
                         wait_max_s=max(max(waits, default=0.0), summed.wait_max),
                         idle_device_hours=self.idle_seconds / 3600, end_reasons=dict(sorted(reasons.items())),
                         idle_measured=self.idle_measured)


def clip(row: UsageRow, since: float, until: float) -> tuple[float, float] | None:
    """The part of the lease inside [since, until), None when it has none. Half open, so
    a lease that ends at midnight is not one of the next day's; a lease that lasted no
    time at all (refused at its grant) belongs to the period it happened in."""
    if row.ended_at > row.granted_at:
        inside = row.granted_at < until and row.ended_at > since
    else:
        inside = since <= row.granted_at < until
    return (max(row.granted_at, since), min(max(row.ended_at, row.granted_at), until)) if inside else None


class _Days:
    """The local midnights of a period, found once: a lease finds its days by bisection
    (mktime for each of 100,000 leases was most of a year's report)."""

    def __init__(self, since: float, until: float) -> None:
        self.starts = [day_start(since)]
        while self.starts[-1] < until:
            self.starts.append(next_day(self.starts[-1]))
        self.keys = [_day_key(s) for s in self.starts]

    def add(self, tallies: dict[str, _Tally], row: UsageRow, start: float, end: float) -> None:
        i = bisect.bisect_right(self.starts, start) - 1
        while True:
            following = self.starts[i + 1]
            tallies.setdefault(self.keys[i], _Tally()).add(row, start, min(end, following), row.device_weight)
            if end <= following:
                return
            i, start = i + 1, following


def lease_row(row: UsageRow, start: float, end: float) -> ReportRow:
    """A report's row for one lease (by lease), its part of the period [start, end): what
    _Tally gives one lease, made directly (an export makes a million of these)."""
    span, full, weight = end - start, row.ended_at - row.granted_at, row.device_weight
    idle = 0.0
    if row.idle_device_s is not None and full > 0:
        idle = row.idle_device_s * (span / full) * weight / len(row.devices)
    return ReportRow(key=row.lease_id, device_hours=weight * span / 3600, leases=1, wait_p50_s=row.wait_s,
                     wait_p90_s=row.wait_s, wait_max_s=row.wait_s, idle_device_hours=idle / 3600,
                     end_reasons={row.state: 1}, idle_measured=row.idle_device_s is not None, lease=row)


def build_report(
    rows: Iterable[UsageRow],
    since: float,
    until: float,
    by: str,
    group_of: Callable[[int], str],
    hide_other_users_for_uid: int | None,
    days: Iterable[DaySummary] = (),
    days_once: Iterable[DaySummary] | None = None,
) -> Report:
    """The figures for [since, until] keyed `by` user, group, device or day. With
    `hide_other_users_for_uid`, per-person rows (by user, by group) count only that
    user's leases; the total always counts everyone's. `days`: whole days inside the
    period, summed (by user, group or day only), whose leases are not among `rows`; by day
    a lease counts on each of its days there, so `days_once` has them once, for the total."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}, got {by!r}")
    total = _Tally()
    tallies: dict[str, _Tally] = {}
    hidden = False
    personal = by in ("user", "group", "lease")
    leases: dict[str, UsageRow] = {}
    for summary in days:
        if by not in ("user", "group", "day"):
            raise ValueError(f"a report by {by} cannot use day summaries")
        if days_once is None:
            total.merge(summary)
        if by != "day" and hide_other_users_for_uid is not None and summary.uid != hide_other_users_for_uid:
            hidden = True
            continue
        key = (summary.user or str(summary.uid) if by == "user" else group_of(summary.gid) if by == "group"
               else _day_key(summary.day))
        tallies.setdefault(key, _Tally()).merge(summary)
    for summary in days_once or ():
        total.merge(summary)
    split = _Days(since, until) if by == "day" else None
    for row in rows:
        clipped = clip(row, since, until)
        if clipped is None:
            continue
        start, end = clipped
        total.add(row, start, end, row.device_weight)
        if personal and hide_other_users_for_uid is not None and row.uid != hide_other_users_for_uid:
            hidden = True
            continue
        if by == "user":
            tallies.setdefault(row.user or str(row.uid), _Tally()).add(row, start, end, row.device_weight)
        elif by == "group":
            tallies.setdefault(group_of(row.gid), _Tally()).add(row, start, end, row.device_weight)
        elif by == "device":
            for uuid in row.devices:
                tallies.setdefault(uuid, _Tally()).add(row, start, end, row.device_weight / len(row.devices))
        elif by == "lease":
            leases[row.lease_id] = row
            tallies.setdefault(row.lease_id, _Tally()).add(row, start, end, row.device_weight)
        elif split is not None:
            split.add(tallies, row, start, end)
    if by == "lease":  # oldest first, each row carrying its lease
        keyed = sorted(tallies.items(), key=lambda item: (leases[item[0]].granted_at, item[0]))
        rows = tuple(replace(t.row(k), lease=leases[k]) for k, t in keyed)
    else:
        keyed = sorted(tallies.items()) if by == "day" else sorted(
            tallies.items(), key=lambda item: (-item[1].seconds, item[0]))
        rows = tuple(t.row(k) for k, t in keyed)
    return Report(since=since, until=until, by=by, rows=rows, total=total.row("total"), rows_hidden=hidden)


def row_json(row: ReportRow) -> dict[str, Any]:
    return {"key": row.key, "device_hours": round(row.device_hours, 6), "leases": row.leases,
            "wait_p50_s": round(row.wait_p50_s, 3), "wait_p90_s": round(row.wait_p90_s, 3),
            "wait_max_s": round(row.wait_max_s, 3), "idle_device_hours": round(row.idle_device_hours, 6),
            "idle_measured": row.idle_measured, "end_reasons": dict(row.end_reasons)}


def report_json(report: Report) -> dict[str, Any]:
    """The `vaccel report --json` shape (DESIGN.md, "Interface, second round")."""
    return {"since": report.since, "until": report.until, "by": report.by,
            "rows": [row_json(r) for r in report.rows], "total": row_json(report.total),
            "rows_hidden": report.rows_hidden}

"""The accounting's day summaries (issue 46): a year's report read 10^6 rows and took 12 s;
it now sums a few thousand summary rows in SQLite and reads the rows at its edges only.

`usage_day` has one row per (day, start_day, end_day, uid, user, gid): the leases of that
user that began on local day `start_day` and ended on `end_day`, their part of `day` (device
and idle seconds), with their lease figures (count, end states, longest wait, waits as 1 %
buckets) on every day they span. A report of [since, until) takes from it the leases that
lie within its whole days [first, last) (start_day >= first, end_day < last): their
seconds from every row, their lease figures once (from the row of their end day), or by
day from each day they span; and reads the rows of the leases that began before `first`
or end after `last`, found by the time indexes.

Rows and summaries are written in one transaction on the accounting's writer thread: a new
lease is added to its days' rows; a replaced or pruned lease has its end day summed again
from the rows that end that day. A file without summaries, or whose summaries do not count
its rows (a daemon from before them wrote it meanwhile), gains them at start, on the
writer, before any new row; until then reports read rows.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator

from brokerd.state.report import DaySummary, UsageRow, day_start, next_day
from brokerd.state.usage_rows import COLUMNS, MARKS, from_db, values

DAYS_READY = "days"  # meta key: '1' once usage_day matches the rows
LONGEST = "longest_s"  # meta key: the longest lease stored (bounds a report's edge reads)
SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_day (
    day REAL NOT NULL, start_day REAL NOT NULL, end_day REAL NOT NULL,
    month REAL,  -- the local month the leases began and ended in, NULL when they span two
    uid INTEGER NOT NULL, user TEXT NOT NULL, gid INTEGER NOT NULL,
    device_s REAL NOT NULL, idle_s REAL NOT NULL, leases INTEGER NOT NULL, wait_max REAL NOT NULL,
    ends TEXT NOT NULL, waits TEXT NOT NULL, measured INTEGER NOT NULL,
    PRIMARY KEY (day, start_day, end_day, uid, user, gid)
);
CREATE INDEX IF NOT EXISTS usage_day_end ON usage_day(end_day);
CREATE TABLE IF NOT EXISTS usage_month (
    month REAL NOT NULL, uid INTEGER NOT NULL, user TEXT NOT NULL, gid INTEGER NOT NULL,
    device_s REAL NOT NULL, idle_s REAL NOT NULL, leases INTEGER NOT NULL, wait_max REAL NOT NULL,
    ends TEXT NOT NULL, waits TEXT NOT NULL, measured INTEGER NOT NULL,
    PRIMARY KEY (month, uid, user, gid)
);
CREATE INDEX IF NOT EXISTS usage_granted ON usage(granted_at, lease_id)
"""
_KEY = "day, start_day, end_day, month, uid, user, gid"
_MONTH_KEY = "month, uid, user, gid"
_FIGURES = "device_s, idle_s, leases, wait_max, ends, waits, measured"


def end_day(granted_at: float, ended_at: float) -> float:
    """The local day a lease's last moment fell on (a lease ending at midnight ended the
    day before; one that lasted no time, the day it happened)."""
    last = day_start(ended_at)
    return day_start(last - 1) if last == ended_at and ended_at > granted_at else last


def pieces(row: UsageRow) -> Iterator[tuple[float, float, float]]:
    """(day, start, end): the lease's part of each local day it spans."""
    day = day_start(row.granted_at)
    if row.ended_at <= row.granted_at:
        yield day, row.granted_at, row.granted_at
        return
    while day < row.ended_at:
        following = next_day(day)
        yield day, max(row.granted_at, day), min(row.ended_at, following)
        day = following


def month_start(ts: float) -> float:
    t = time.localtime(ts)
    return time.mktime((t.tm_year, t.tm_mon, 1, 0, 0, 0, 0, 0, -1))


def next_month(start: float) -> float:
    return month_start(start + 32 * 86400)  # the 1st plus 32 days is in the next month


class _Sums:
    """Summaries being made: day rows by their key, month rows by theirs."""

    def __init__(self) -> None:
        self.days: dict[tuple, DaySummary] = {}
        self.months: dict[tuple, DaySummary] = {}

    def add(self, row: UsageRow) -> None:
        first, last = day_start(row.granted_at), end_day(row.granted_at, row.ended_at)
        month = month_start(first)
        month = month if month_start(last) == month else None
        for day, start, end in pieces(row):
            key = (day, first, last, month, row.uid, row.user, row.gid)
            if key not in self.days:
                self.days[key] = DaySummary(day, row.uid, row.user, row.gid)
            self.days[key].add(row, start, end)
        if month is not None:  # within one month: the month's row has it whole
            key = (month, row.uid, row.user, row.gid)
            if key not in self.months:
                self.months[key] = DaySummary(month, row.uid, row.user, row.gid)
            self.months[key].add(row, row.granted_at, row.ended_at)


def _load(r: tuple) -> DaySummary:
    return DaySummary(0.0, 0, "", 0, r[0], r[1], r[2], r[3], json.loads(r[4]),
                      {int(b): n for b, n in json.loads(r[5]).items()}, r[6])


def _save(conn: sqlite3.Connection, table: str, key: tuple, s: DaySummary, *, add: bool = False) -> None:
    """Write a summary row; `add`: added to what the row has already."""
    names = _KEY if table == "usage_day" else _MONTH_KEY
    if add:
        where = " AND ".join(f"{n} IS ?" for n in names.split(", "))  # IS: a NULL month is a key too
        found = conn.execute(f"SELECT {_FIGURES} FROM {table} WHERE {where}", key).fetchone()
        if found is not None:
            s, new = _load(found), s
            s.merge(new)
    conn.execute(f"INSERT OR REPLACE INTO {table} ({names}, {_FIGURES}) VALUES ({','.join('?' * (len(key) + 7))})",
                 (*key, s.device_s, s.idle_s, s.leases, s.wait_max, json.dumps(s.ends, sort_keys=True),
                  json.dumps(s.waits, sort_keys=True), s.measured))


def _save_all(conn: sqlite3.Connection, sums: _Sums, *, add: bool = False) -> None:
    for key, summary in sums.days.items():
        _save(conn, "usage_day", key, summary, add=add)
    for key, summary in sums.months.items():
        _save(conn, "usage_month", key, summary, add=add)


def _longest(conn: sqlite3.Connection, rows: Iterable[UsageRow]) -> None:
    longest = max((r.ended_at - r.granted_at for r in rows), default=0.0)
    known = conn.execute("SELECT value FROM meta WHERE key = ?", (LONGEST,)).fetchone()
    if known is None or longest > float(known[0]):
        conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (LONGEST, repr(max(longest, 0.0))))


def record(conn: sqlite3.Connection, rows: list[UsageRow], *, replace: bool) -> None:
    """Write ended leases' rows and their summaries. `replace`: a row already there is
    replaced (a lease's end), else kept (the backfill after a crash)."""
    sums = _Sums()
    redo: set[float] = set()
    written = []
    for row in rows:
        old = conn.execute("SELECT granted_at, ended_at FROM usage WHERE lease_id = ?", (row.lease_id,)).fetchone()
        if old is not None and not replace:
            continue
        conn.execute(f"INSERT OR REPLACE INTO usage ({COLUMNS}) VALUES ({MARKS})", values(row))
        written.append(row)
        if old is not None:  # its old figures are summed already: sum both end days again
            redo.update((end_day(*old), end_day(row.granted_at, row.ended_at)))
        else:
            sums.add(row)
    _longest(conn, written)
    if redo:  # rare (a lease's end recorded twice): sum everything they touch again
        resum(conn, redo | {end_day(r.granted_at, r.ended_at) for r in written})
    else:
        _save_all(conn, sums, add=True)


def resum(conn: sqlite3.Connection, end_days: Iterable[float] | None) -> None:
    """Sum again, from their rows, the leases that ended on `end_days` (None: all) and the
    months those days are in."""
    devices: dict[str, tuple[str, ...]] = {}
    sums = _Sums()
    if end_days is None:
        conn.execute("DELETE FROM usage_day")
        conn.execute("DELETE FROM usage_month")
        for r in conn.execute(f"SELECT {COLUMNS} FROM usage"):
            sums.add(from_db(r, devices))
        _save_all(conn, sums)
        return
    days = sorted(set(end_days))
    months = sorted({month_start(d) for d in days})
    for day in days:
        conn.execute("DELETE FROM usage_day WHERE end_day = ?", (day,))
        for r in conn.execute(f"SELECT {COLUMNS} FROM usage WHERE ended_at >= ? AND ended_at <= ?",
                              (day, next_day(day))):
            row = from_db(r, devices)
            if end_day(row.granted_at, row.ended_at) == day:
                sums.add(row)
    sums.months.clear()  # each month whole, from every lease that ended in it
    for month in months:
        conn.execute("DELETE FROM usage_month WHERE month = ?", (month,))
        for r in conn.execute(f"SELECT {COLUMNS} FROM usage WHERE ended_at >= ? AND ended_at <= ?",
                              (month, next_month(month))):
            row = from_db(r, devices)
            if month_start(end_day(row.granted_at, row.ended_at)) == month:
                month_only = _Sums()
                month_only.add(row)
                for key, summary in month_only.months.items():
                    sums.months.setdefault(key, DaySummary(*key)).merge(summary)
    _save_all(conn, sums)


def ensure(conn: sqlite3.Connection) -> None:
    """Give the file summaries that count its rows (the writer's first op at start)."""
    for statement in SCHEMA.split(";"):  # not executescript: that commits the writer's transaction
        conn.execute(statement)
    ready = conn.execute("SELECT value FROM meta WHERE key = ?", (DAYS_READY,)).fetchone()
    rows = conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0]
    summed = conn.execute("SELECT COALESCE(SUM(leases), 0) FROM usage_day WHERE day = end_day").fetchone()[0]
    if ready is not None and ready[0] == "1" and rows == summed:
        return
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (LONGEST, repr(conn.execute(
        "SELECT COALESCE(MAX(ended_at - granted_at), 0) FROM usage").fetchone()[0])))
    resum(conn, None)
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, '1')", (DAYS_READY,))


def prune(conn: sqlite3.Connection, cutoff: float, ceiling: int) -> int:
    """Drop rows that ended before `cutoff`, then the oldest beyond `ceiling` rows (0: no
    ceiling), and their summaries; returns the rows dropped. Both drop the rows that ended
    first, so the summaries to drop end before the first end day left, and that day's are
    summed again."""
    dropped = conn.execute("DELETE FROM usage WHERE ended_at < ?", (cutoff,)).rowcount
    excess = conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0] - ceiling
    if ceiling > 0 and excess > 0:
        dropped += conn.execute("DELETE FROM usage WHERE lease_id IN (SELECT lease_id FROM usage "
                                "ORDER BY ended_at LIMIT ?)", (excess,)).rowcount
    if dropped:
        first = conn.execute("SELECT granted_at, ended_at FROM usage ORDER BY ended_at LIMIT 1").fetchone()
        if first is None:
            conn.execute("DELETE FROM usage_day")
            conn.execute("DELETE FROM usage_month")
        else:
            conn.execute("DELETE FROM usage_day WHERE end_day < ?", (end_day(*first),))
            conn.execute("DELETE FROM usage_month WHERE month < ?", (month_start(end_day(*first)),))
            resum(conn, [end_day(*first)])
    return dropped


def whole_days(conn: sqlite3.Connection, first: float, last: float, by: str) -> list[DaySummary]:
    """The summed figures of the leases within the whole days [first, last): per user (by
    user or group; each lease's figures once) or per day (by day; a lease's on each day).
    By user or group the whole months inside come from their month rows, whose leases'
    day rows are then left out."""
    per_day = by == "day"
    key = "day" if per_day else "uid, user, gid"
    found: dict[tuple, DaySummary] = {}
    args = {"first": first, "last": last, "mfirst": first, "mlast": first}
    inside = "day >= :first AND day < :last AND start_day >= :first AND end_day < :last"
    if not per_day:
        mfirst = first if month_start(first) == first else next_month(month_start(first))
        if mfirst < month_start(last):
            args.update(mfirst=mfirst, mlast=month_start(last))
            _summed(conn, "usage_month", "month >= :mfirst AND month < :mlast", key, "", args, found, per_day)
        inside += " AND (month IS NULL OR month < :mfirst OR month >= :mlast)"
    _summed(conn, "usage_day", inside, key, "" if per_day else " AND day = end_day", args, found, per_day)
    return list(found.values())


def _summed(conn: sqlite3.Connection, table: str, where: str, key: str, once: str, args: dict,
            found: dict[tuple, DaySummary], per_day: bool) -> None:
    """Add to `found` the figures of `table`'s rows `where`, summed by SQLite per `key`
    (`once`: the rows that carry each lease's own figures)."""
    def summary(k: tuple) -> DaySummary:
        if k not in found:
            found[k] = DaySummary(k[0], 0, "", 0) if per_day else DaySummary(0.0, *k)
        return found[k]

    for *k, device_s, idle_s, measured in conn.execute(
            f"SELECT {key}, SUM(device_s), SUM(idle_s), SUM(measured) FROM {table} WHERE {where} GROUP BY {key}",
            args):
        s = summary(tuple(k))
        s.device_s, s.idle_s, s.measured = s.device_s + device_s, s.idle_s + idle_s, s.measured + measured
    for *k, leases, wait_max in conn.execute(
            f"SELECT {key}, SUM(leases), MAX(wait_max) FROM {table} WHERE {where}{once} GROUP BY {key}", args):
        s = summary(tuple(k))
        s.leases, s.wait_max = s.leases + leases, max(s.wait_max, wait_max)
    for column in ("ends", "waits"):  # the JSON maps summed by SQLite, not decoded row by row here
        for *k, name, n in conn.execute(
                f"SELECT {key}, j.key, SUM(j.value) FROM {table}, json_each({table}.{column}) AS j "
                f"WHERE {where}{once} GROUP BY {key}, j.key", args):
            into = getattr(summary(tuple(k)), column)
            name = int(name) if column == "waits" else name
            into[name] = into.get(name, 0) + n

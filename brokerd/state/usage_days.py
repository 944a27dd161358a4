"""The accounting's day summaries (issue 46): a year's report read 10^6 rows and took 12 s;
it now reads one summary per user and whole day, and the rows of the days at its edges.

Each row of `usage` carries `day`: the local midnight of the day the lease began, when it
also ended within that day (most do), else NULL (a lease across midnight, always read as a
row). `usage_day` keeps, per (day, uid, user, gid), what brokerd/state/report.py needs of
those leases (DaySummary). It is written in the same transaction as the rows, on the
accounting's writer thread: a new row is added to its day's summary, a replaced or pruned
row has its days summed again from their rows, so a summary always equals its rows.

A file from before the summaries (no meta `days`) gains them at the first start, on the
writer thread, before any row that comes after; until that is done reports read rows.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable

from brokerd.state.report import DaySummary, UsageRow, day_start
from brokerd.state.usage_rows import COLUMNS, MARKS, from_db, values

DAYS_READY = "days"  # meta key: '1' once every row has its day and usage_day matches them
# The indexes a report reads by: the day summaries, the rows of a day, the rows across
# midnight by their end, and the leases in the order an export lists them.
SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_day (
    day REAL NOT NULL, uid INTEGER NOT NULL, user TEXT NOT NULL, gid INTEGER NOT NULL,
    device_s REAL NOT NULL, idle_s REAL NOT NULL, leases INTEGER NOT NULL, wait_max REAL NOT NULL,
    ends TEXT NOT NULL, waits TEXT NOT NULL,
    PRIMARY KEY (day, uid, user, gid)
);
CREATE INDEX IF NOT EXISTS usage_by_day ON usage(day);
CREATE INDEX IF NOT EXISTS usage_across ON usage(ended_at) WHERE day IS NULL;
CREATE INDEX IF NOT EXISTS usage_granted ON usage(granted_at, lease_id);
"""
DAY_COLUMNS = "day, uid, user, gid, device_s, idle_s, leases, wait_max, ends, waits"


def day_of(granted_at: float, ended_at: float) -> float | None:
    """The local midnight of the day a lease lies within, None when it crosses midnight."""
    start = day_start(granted_at)
    # Noon plus a day lands in the next day whatever DST does (report.py: next_day).
    return start if ended_at <= day_start(start + 36 * 3600) else None


def summary_from_db(r: tuple) -> DaySummary:
    return DaySummary(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8]),
                      {int(b): n for b, n in json.loads(r[9]).items()})


def _save(conn: sqlite3.Connection, s: DaySummary) -> None:
    conn.execute(f"INSERT OR REPLACE INTO usage_day ({DAY_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                 (s.day, s.uid, s.user, s.gid, s.device_s, s.idle_s, s.leases, s.wait_max,
                  json.dumps(s.ends, sort_keys=True), json.dumps(s.waits, sort_keys=True)))


def record(conn: sqlite3.Connection, rows: Iterable[UsageRow], *, replace: bool) -> None:
    """Write ended leases' rows and their days' summaries. `replace`: a row already there
    is replaced (a lease's end), else kept (the backfill after a crash)."""
    added: dict[tuple[float, int, str, int], list[UsageRow]] = {}
    redo: set[float] = set()
    for row in rows:
        old = conn.execute("SELECT day FROM usage WHERE lease_id = ?", (row.lease_id,)).fetchone()
        if old is not None and not replace:
            continue
        day = day_of(row.granted_at, row.ended_at)
        conn.execute(f"INSERT OR REPLACE INTO usage ({COLUMNS}, day) VALUES ({MARKS},?)", (*values(row), day))
        if old is not None:  # its old figures are in a summary: sum both days again
            redo.update(d for d in (old[0], day) if d is not None)
        elif day is not None:
            added.setdefault((day, row.uid, row.user, row.gid), []).append(row)
    for (day, uid, user, gid), new in added.items():
        if day in redo:
            continue
        found = conn.execute(f"SELECT {DAY_COLUMNS} FROM usage_day WHERE day=? AND uid=? AND user=? AND gid=?",
                             (day, uid, user, gid)).fetchone()
        summary = summary_from_db(found) if found else DaySummary(day, uid, user, gid)
        for row in new:
            summary.add(row)
        _save(conn, summary)
    resum(conn, redo)


def resum(conn: sqlite3.Connection, days: Iterable[float] | None) -> int:
    """Sum `days` (None: every day) again from their rows; returns the rows read."""
    if days is None:
        conn.execute("DELETE FROM usage_day")
        batches: Iterable[tuple[str, tuple]] = [(f"SELECT {COLUMNS}, day FROM usage WHERE day IS NOT NULL", ())]
    else:
        days = sorted(set(days))
        for day in days:
            conn.execute("DELETE FROM usage_day WHERE day = ?", (day,))
        batches = [(f"SELECT {COLUMNS}, day FROM usage WHERE day = ?", (day,)) for day in days]
    sums: dict[tuple[float, int, str, int], DaySummary] = {}
    devices: dict[str, tuple[str, ...]] = {}
    read = 0
    for query, args in batches:
        for r in conn.execute(query, args):
            row, day = from_db(r, devices), r[-1]
            key = (day, row.uid, row.user, row.gid)
            summary = sums.get(key)
            if summary is None:
                summary = sums[key] = DaySummary(*key)
            summary.add(row)
            read += 1
    for summary in sums.values():
        _save(conn, summary)
    return read


def ensure(conn: sqlite3.Connection) -> None:
    """Give a file from before the summaries its days and summaries (the writer's first op)."""
    for statement in SCHEMA.split(";"):  # not executescript: that commits the writer's transaction
        if statement.strip():
            conn.execute(statement)
    ready = conn.execute("SELECT value FROM meta WHERE key = ?", (DAYS_READY,)).fetchone()
    if ready is not None and ready[0] == "1":
        return
    todo = conn.execute("SELECT lease_id, granted_at, ended_at FROM usage").fetchall()
    conn.executemany("UPDATE usage SET day = ? WHERE lease_id = ?",
                     [(day_of(granted, ended), lease_id) for lease_id, granted, ended in todo])
    resum(conn, None)
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, '1')", (DAYS_READY,))


def prune(conn: sqlite3.Connection, cutoff: float, ceiling: int) -> int:
    """Drop rows that ended before `cutoff`, then the oldest beyond `ceiling` rows (0: no
    ceiling), and sum their days again; returns the rows dropped."""
    touched = {d for (d,) in conn.execute("SELECT DISTINCT day FROM usage WHERE ended_at < ? AND day IS NOT NULL",
                                          (cutoff,))}
    dropped = conn.execute("DELETE FROM usage WHERE ended_at < ?", (cutoff,)).rowcount
    excess = conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0] - ceiling
    if ceiling > 0 and excess > 0:
        oldest = "SELECT lease_id FROM usage ORDER BY ended_at LIMIT ?"
        touched.update(d for (d,) in conn.execute(
            f"SELECT DISTINCT day FROM usage WHERE lease_id IN ({oldest}) AND day IS NOT NULL", (excess,)))
        dropped += conn.execute(f"DELETE FROM usage WHERE lease_id IN ({oldest})", (excess,)).rowcount
    resum(conn, touched)
    return dropped

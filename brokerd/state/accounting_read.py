"""Reports read on their own (issue 46): each on a connection of its own, on a small pool of
threads of its own, never on the accounting's writer thread. WAL lets the writer commit the
rows of leases that end meanwhile; each report reads one snapshot (one read transaction).

A period's whole days come from their day summaries (brokerd/state/usage_days.py) by user,
group or day; the rows read are those of the days at its edges and of the leases across
midnight. By lease (and by device) the rows are read, as a stream: `lease_pages` yields a
page at a time in the order of the export, so a million leases never make one message or
one list. SQLite steps a statement without the GIL, and the connection is closed at the end
of each report: its cache goes back.

Reports are bounded per user like every other costly call (brokerd/edge/work_guard.py): at
most PER_USER of one user's at once, the next refused at once (Busy), and POOL threads for
everyone, so three users asking at once each get theirs without waiting for a writer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import heapq
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from brokerd.leasing.errors import Busy
from brokerd.state.report import (
    DaySummary,
    Report,
    ReportRow,
    UsageRow,
    build_report,
    clip,
    day_start,
    lease_row,
    next_day,
)
from brokerd.state.usage_days import DAYS_READY, LONGEST, end_day, whole_days
from brokerd.state.usage_rows import COLUMNS, from_db

POOL = 4
PER_USER = 2
PAGE_ROWS = 4000  # leases per page of an export: about 600 KB, far below gRPC's 4 MiB


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator does what it does
        return None


_TRIM = _malloc_trim()


def give_back() -> None:
    """Hand the heap pages a report freed back to the system: glibc keeps them for reuse
    otherwise, and a year's export left the daemon ~40 MB larger for good."""
    if _TRIM is not None:
        _TRIM(0)


class Reads:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=POOL, thread_name_prefix="vaccel-report")
        self._lock = threading.Lock()
        self._running: dict[int, int] = {}

    @contextlib.contextmanager
    def admitted(self, uid: int) -> Iterator[None]:
        with self._lock:
            running = self._running.get(uid, 0)
            if running >= PER_USER:
                raise Busy(f"{running} reports of yours are running already; wait for them to finish")
            self._running[uid] = running + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._running[uid] - 1
                if left:
                    self._running[uid] = left
                else:
                    del self._running[uid]

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA query_only=1")
        conn.execute("BEGIN")  # one snapshot for the whole report
        return conn

    def build(self, since: float, until: float, by: str, live: list[UsageRow], hide_uid: int | None,
              group_of: Callable[[int], str]) -> Report:
        """The report (blocking: on `pool`, or a caller's own thread)."""
        conn = self._connect()
        try:
            live_ids = {row.lease_id for row in live}
            days, once, stored = _plan(conn, since, until, by, live_ids)
            devices: dict[str, tuple[str, ...]] = {}
            rows = (r for r in (from_db(s, devices) for s in stored) if r.lease_id not in live_ids)
            return build_report(_chain(live, rows), since, until, by, group_of, hide_uid, days, once)
        finally:
            conn.close()
            give_back()

    def lease_pages(self, since: float, until: float, live: list[UsageRow], hide_uid: int | None,
                    page: int = PAGE_ROWS) -> Iterator[tuple[ReportRow, ...]]:
        """The period's leases, oldest first, `page` at a time (at least one page, maybe
        empty); `hide_uid`: only that user's. Each next() blocks: step it on `pool`."""
        conn = self._connect()
        try:
            mine = " AND uid = ?" if hide_uid is not None else ""
            stored = conn.execute(f"SELECT {COLUMNS} FROM usage WHERE granted_at < ? AND ended_at >= ?{mine} "
                                  "ORDER BY granted_at, lease_id",
                                  (until, since, *(() if hide_uid is None else (hide_uid,))))
            live_ids = {row.lease_id for row in live}
            devices: dict[str, tuple[str, ...]] = {}
            rows = (r for r in (from_db(s, devices) for s in stored) if r.lease_id not in live_ids)
            shown = sorted((r for r in live if hide_uid is None or r.uid == hide_uid),
                           key=lambda r: (r.granted_at, r.lease_id))
            out: list[ReportRow] = []
            for row in heapq.merge(shown, rows, key=lambda r: (r.granted_at, r.lease_id)):
                clipped = clip(row, since, until)
                if clipped is not None:
                    out.append(lease_row(row, *clipped))
                    if len(out) >= page:
                        yield tuple(out)
                        out = []
            yield tuple(out)
        finally:
            conn.close()
            give_back()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _chain(first: Iterable, then: Iterable) -> Iterator:
    yield from first
    yield from then


def _plan(conn: sqlite3.Connection, since: float, until: float, by: str, live_ids: set[str]
          ) -> tuple[list[DaySummary], list[DaySummary] | None, Iterable[tuple]]:
    """What a report of [since, until) reads: the whole days' summed figures (by day: and
    each lease's once, for the total), the stored rows."""
    every = (f"SELECT {COLUMNS} FROM usage WHERE ended_at >= ? AND granted_at < ?", (since, until))
    meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN (?, ?)", (DAYS_READY, LONGEST)))
    first = since if day_start(since) == since else next_day(day_start(since))
    last = day_start(until)
    if by not in ("user", "group", "day") or meta.get(DAYS_READY) != "1" or first >= last:
        return [], None, _rows(conn, [every])
    if live_ids:  # a live lease with a row already (never expected): read rows, as before
        marks = ",".join("?" * len(live_ids))
        if conn.execute(f"SELECT 1 FROM usage WHERE lease_id IN ({marks}) LIMIT 1", (*live_ids,)).fetchone():
            return [], None, _rows(conn, [every])
    longest = float(meta.get(LONGEST, "0"))
    edges = [  # began before the whole days (by the granted index), or ended after them (by the ended one)
        (f"SELECT {COLUMNS} FROM usage WHERE granted_at >= ? AND granted_at < ? AND ended_at >= ?",
         (since - longest - 1, first, since)),
        (f"SELECT {COLUMNS} FROM usage WHERE ended_at >= ? AND ended_at <= ? AND granted_at >= ? AND granted_at < ?",
         (last, until + longest + 1, first, until)),
    ]
    tail = _rows(conn, edges[1:])
    after = (r for r in tail if end_day(r[5], r[6]) >= last)  # one that ended at midnight `last` is summed
    once = whole_days(conn, first, last, "user") if by == "day" else None
    return whole_days(conn, first, last, by), once, _chain(_rows(conn, edges[:1]), after)


def _rows(conn: sqlite3.Connection, queries: list[tuple[str, tuple]]) -> Iterator[tuple]:
    for query, args in queries:
        yield from conn.execute(query, args)

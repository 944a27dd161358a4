"""Durable usage accounting: one row per lease (who, which devices, granted, ended, how
long it waited, how it ended, and its devices' utilisation where a probe reports it) in
its own SQLite file, `accounting.db` in the state directory, kept `accounting.keep`
(400 days) and at most `accounting.max_rows` rows.

Accounting follows the lease path and never sits on it: rows are written by one writer
thread (brokerd/state/accounting_writer.py, which survives any one failure; WAL,
synchronous=NORMAL: a crash of the daemon loses nothing committed, a power cut may lose
the last moments, which the backfill below restores from the lease store's own history),
a failure is logged, and a lease is recorded when it ends. Leases still
running are reported from memory with "now" as their end, so a report mid-lease is right.
After a restart, leases the lease store saw end but this file missed (a kill -9 between
the two) are filled in from the store's recently ended leases.

Utilisation: at each probe refresh (a new snapshot object) every live lease's devices
are sampled; a device reading 0 % counts as idle for the time since the last refresh.
Probes that report no utilisation (simulated, CPU) leave the columns NULL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import grp
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brokerd.base.clock import wall
from brokerd.config.loader import Config
from brokerd.config.policy import counted_gid
from brokerd.devices.model import UTILISATION_KEY, Snapshot
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.model import Lease
from brokerd.state import usage_days
from brokerd.state.accounting_read import Reads
from brokerd.state.accounting_writer import AccountingWriter
from brokerd.state.report import STILL_ACTIVE, Report, UsageRow
from brokerd.state.usage_rows import COLUMNS, MARKS, values

log = logging.getLogger("vaccel.brokerd")

DB_NAME = "accounting.db"
# The day summaries (usage_days.py) are a table of their own, added and checked against the
# rows at each start: a daemon from before them may go on using the file.
SCHEMA_VERSION = 3
# Columns older files lack (version 1: both, 2: the time limit), added in place when the file
# is opened: found by name, so a file of any older version (or none) gets exactly those.
_ADDED_COLUMNS = (("weight", "ALTER TABLE usage ADD COLUMN weight REAL"),
                  ("time_limit_s", "ALTER TABLE usage ADD COLUMN time_limit_s REAL NOT NULL DEFAULT 0"))
PRUNE_EVERY_S = 86400.0
DEFAULT_SPAN_S = 7 * 86400.0  # a report that names no start covers the last week
UNWRITTEN_MAX = 100_000  # rows kept in memory while the file takes none (~30 MB at most)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS usage (
    lease_id TEXT PRIMARY KEY,
    uid INTEGER NOT NULL, user TEXT NOT NULL, gid INTEGER NOT NULL,
    devices TEXT NOT NULL,
    granted_at REAL NOT NULL, ended_at REAL NOT NULL, wait_s REAL NOT NULL,
    state TEXT NOT NULL, end_reason TEXT NOT NULL, reservation INTEGER NOT NULL,
    util_mean_pct REAL, idle_device_s REAL,
    weight REAL,  -- a memory share's part of its device (device-hours x this); NULL: its devices
    time_limit_s REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS usage_ended ON usage(ended_at);
"""

@dataclass
class _Live:
    """A running lease and what the probes have said about its devices so far."""

    lease: Lease
    sampled_s: float = 0.0  # device-seconds with a utilisation reading
    util_s: float = 0.0  # utilisation percent x device-seconds
    idle_s: float = 0.0  # device-seconds read at 0 %


def usage_row(lease: Lease, live: _Live | None, now: float, gid: int) -> UsageRow:
    """The row a lease makes, ended or (with `now` as its end) still running; `gid` is the
    group it counts under (brokerd/config/policy.py counted_gid)."""
    sampled = live is not None and live.sampled_s > 0
    holder = lease.holder
    return UsageRow(
        lease_id=lease.id, uid=holder.uid, user=holder.user, gid=gid, devices=tuple(lease.devices),
        granted_at=lease.granted_at, ended_at=max(now if lease.active else lease.ended_at, lease.granted_at),
        wait_s=max(0.0, lease.granted_at - lease.requested_at) if lease.requested_at else 0.0,
        state=STILL_ACTIVE if lease.active else lease.state, end_reason=lease.end_reason,
        reservation=lease.reservation,
        util_mean_pct=live.util_s / live.sampled_s if sampled and live else None,
        idle_device_s=live.idle_s if sampled and live else None,
        weight=lease.weight if lease.share_mib else None,
        time_limit_s=lease.time_limit_s,
    )


def _open(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        # Before any table exists, so that pruning can hand freed pages back to the disk.
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is not None and row[0] not in {str(v) for v in range(1, SCHEMA_VERSION + 1)}:
            raise sqlite3.DatabaseError(f"schema version {row[0]}, this daemon knows {SCHEMA_VERSION}")
        present = {c[1] for c in conn.execute("PRAGMA table_info(usage)")}
        for column, statement in _ADDED_COLUMNS:
            if column not in present:
                conn.execute(statement)
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    except sqlite3.DatabaseError:
        conn.close()
        raise
    return conn


def open_database(path: Path, clock: Callable[[], float] = wall) -> sqlite3.Connection:
    """Open (or create) the accounting file. One it cannot read is moved aside, kept for a
    person to look at, and a fresh one started: accounting must never stop the daemon."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        return _open(path)
    except sqlite3.DatabaseError as exc:
        if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            # A full disk says nothing about the file: moving it aside lost a lab's
            # accounting (issue 46's faulted replay). Open it as it is; the rows it cannot
            # take yet are kept in memory and written when the disk has room (`_write`).
            log.error("accounting: %s cannot be written to (%s); rows wait in memory", path, exc)
            return sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        aside = path.with_name(f"{path.name}.unreadable-{int(clock())}")
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                Path(f"{path}{suffix}").rename(f"{aside}{suffix}")
        log.error("accounting: %s cannot be used (%s); moved it to %s and started a new one", path, exc, aside)
        return _open(path)


class Accounting(LeaseHook):
    """The accounting hook: live leases in memory, ended ones on disk, reports over both."""

    name = "accounting"

    def __init__(
        self,
        state_dir: Path,
        config: Callable[[], Config],
        *,
        snapshot: Callable[[], Snapshot] | None = None,
        recently_ended: Callable[[], Iterable[Lease]] = tuple,
        clock: Callable[[], float] = wall,
    ) -> None:
        self.path = Path(state_dir) / DB_NAME
        self._config = config  # read at each use: keep, max_rows and who sees what are reloadable
        self._snapshot = snapshot
        self._recently_ended = recently_ended
        self._clock = clock
        self._writer = AccountingWriter(open_database(self.path, clock))
        self._logged(self._writer.submit(usage_days.ensure), "the day summaries")  # first: before any row
        self._reads = Reads(self.path)
        self._live: dict[str, _Live] = {}
        self._last_snapshot: Snapshot | None = None
        self._last_sample_at: float | None = None
        self._last_prune_at = 0.0
        self._unwritten: list[tuple[UsageRow, bool]] = []  # (row, replace) the file did not take
        self._unwritten_lock = threading.Lock()  # the writer thread adds, the loop takes
        self._task: asyncio.Task[None] | None = None

    # -- the lease's moments (on the event loop; never raise) ---------------------------

    def restored(self, active: Iterable[Lease]) -> None:
        self._live = {lease.id: _Live(lease) for lease in active}
        now = self._clock()
        missed = [usage_row(lease, None, now, self._gid(lease)) for lease in self._recently_ended()
                  if not lease.active]
        if missed:
            self._write(missed, "the leases that ended before this start", replace=False)
        self.prune()

    def granted(self, lease: Lease) -> None:
        self._live[lease.id] = _Live(lease)

    def ended(self, lease: Lease) -> None:
        row = usage_row(lease, self._live.pop(lease.id, None), self._clock(), self._gid(lease))
        self._write([row], f"the end of lease {lease.id}", replace=True, gather=True)

    def _write(self, rows: list[UsageRow], what: str, *, replace: bool, gather: bool = False) -> None:
        """Write rows on the writer thread. Rows the file does not take (a full disk, issue
        46) are kept in memory, up to UNWRITTEN_MAX, and written again at each tick of `run`
        until it takes them: a lease that ends while the disk is full is not lost."""
        def check(done: concurrent.futures.Future[Any]) -> None:
            error = None if done.cancelled() else done.exception()
            if error is None:
                return
            with self._unwritten_lock:
                kept = [(row, replace) for row in rows[:max(0, UNWRITTEN_MAX - len(self._unwritten))]]
                self._unwritten.extend(kept)
                waiting = len(self._unwritten)
            if not what.startswith("again:"):
                log.error("accounting could not record %s: %s; %d row(s) kept in memory, written when the "
                          "file takes them again%s", what, error, waiting,
                          "" if len(kept) == len(rows) else f" ({len(rows) - len(kept)} dropped: too many)")

        future = self._writer.submit(gather=gather, op=lambda conn: usage_days.record(conn, rows, replace=replace))
        future.add_done_callback(check)

    def _catch_up(self) -> None:
        """Write the rows the file did not take before, once more."""
        with self._unwritten_lock:
            unwritten, self._unwritten = self._unwritten, []
        for replace in (True, False):
            rows = [row for row, again in unwritten if again is replace]
            if rows:
                self._write(rows, "again: rows kept in memory", replace=replace)
        count = len(unwritten)
        self._writer.submit(lambda conn: None).add_done_callback(lambda _: self._caught_up(count))

    def _caught_up(self, n: int) -> None:
        with self._unwritten_lock:
            left = len(self._unwritten)
        if not left:
            log.info("accounting: the %d row(s) kept in memory are written", n)

    def _gid(self, lease: Lease) -> int:
        return counted_gid(self._config().policy, lease.holder.user, lease.holder.gid)

    @staticmethod
    def _logged(future: concurrent.futures.Future[Any], what: str) -> None:
        def check(done: concurrent.futures.Future[Any]) -> None:
            if done.exception() is not None:
                log.error("accounting could not record %s: %s", what, done.exception())
        future.add_done_callback(check)

    # -- utilisation and retention -------------------------------------------------------

    def sample(self) -> None:
        """Credit each live lease's devices with what the latest probe read, for the time
        since the previous probe (at most three refresh intervals: a longer gap is a
        probe that was not believed, and its readings say nothing about the gap)."""
        if self._snapshot is None:
            return
        snapshot, now = self._snapshot(), self._clock()
        if snapshot is self._last_snapshot:
            return
        previous, self._last_snapshot, self._last_sample_at = self._last_sample_at, snapshot, now
        if previous is None:
            return
        floor = max(previous, now - 3 * max(self._config().probe_interval_s, 1.0))
        devices = snapshot.by_uuid()
        for live in self._live.values():
            span = now - max(floor, live.lease.granted_at)
            if span <= 0:
                continue
            for uuid in live.lease.devices:
                device = devices.get(uuid)
                util = device.extra.get(UTILISATION_KEY) if device is not None else None
                if isinstance(util, int | float) and not isinstance(util, bool):
                    live.sampled_s += span
                    live.util_s += float(util) * span
                    if util <= 0:
                        live.idle_s += span

    def prune(self) -> concurrent.futures.Future[int]:
        """Drop rows that ended before the keep period, then the oldest beyond the row
        ceiling. Live leases have no row yet, so pruning never touches them."""
        config, now = self._config(), self._clock()
        self._last_prune_at = now
        cutoff, ceiling = now - config.accounting_keep_s, config.accounting_max_rows

        def prune(conn: sqlite3.Connection) -> int:
            dropped = usage_days.prune(conn, cutoff, ceiling)
            # Hand the freed pages back to the filesystem. Python's sqlite3 steps a
            # statement with no result columns once, and each step frees one page.
            for _ in range(conn.execute("PRAGMA freelist_count").fetchone()[0] if dropped else 0):
                conn.execute("PRAGMA incremental_vacuum(1)")
            return dropped

        future = self._writer.submit(prune)
        self._logged(future, "the pruning of old rows")
        return future

    async def run(self) -> None:
        """Sample at the probe's pace and prune once a day, until cancelled."""
        while True:
            await asyncio.sleep(max(self._config().probe_interval_s, 0.5))
            try:
                self.sample()
                if self._unwritten:
                    self._catch_up()
                if self._clock() - self._last_prune_at >= PRUNE_EVERY_S:
                    self.prune()
            except Exception:
                log.exception("accounting: sampling failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="accounting")

    async def close(self) -> None:
        """Stop sampling, commit what is queued, close the file."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.get_running_loop().run_in_executor(None, self._writer.close)
        self._reads.close()

    # -- reports ---------------------------------------------------------------------------

    def _asked(self, since: float, until: float, viewer_uid: int, viewer_is_admin: bool
               ) -> tuple[float, float, list[UsageRow], int | None]:
        """(since, until) with their defaults, the live leases' rows (copied here, on the
        caller's thread: no other thread reads live state), whose rows to show."""
        now = self._clock()
        until = until or now
        since = since or until - DEFAULT_SPAN_S
        live = [usage_row(live.lease, live, now, self._gid(live.lease)) for live in list(self._live.values())
                if live.lease.active]
        everyone = viewer_is_admin or self._config().accounting_per_user_report == "everyone"
        return since, until, live, None if everyone else viewer_uid

    def _written(self) -> concurrent.futures.Future[None]:
        """Settles once every row submitted before it is committed: a report reads them."""
        return self._writer.submit(lambda conn: None)

    def report(self, since: float, until: float, by: str, viewer_uid: int, viewer_is_admin: bool) -> Report:
        """The figures for [since, until) (0 = a week before `until`; 0 = now) as
        `viewer_uid` may see them. Blocks on the database: call it off the event loop,
        or await `areport` on it."""
        since, until, live, hide = self._asked(since, until, viewer_uid, viewer_is_admin)
        self._written().result()
        return self._reads.build(since, until, by, live, hide, _group_names())

    async def areport(self, since: float, until: float, by: str, viewer_uid: int, viewer_is_admin: bool) -> Report:
        """`report` for the event loop: the query runs on a report thread (accounting_read.py),
        within the user's share (Busy beyond it)."""
        with self._reads.admitted(viewer_uid):
            return await self._areport(since, until, by, viewer_uid, viewer_is_admin)

    async def _areport(self, since: float, until: float, by: str, viewer_uid: int, viewer_is_admin: bool) -> Report:
        since, until, live, hide = self._asked(since, until, viewer_uid, viewer_is_admin)
        await asyncio.wrap_future(self._written())
        return await asyncio.get_running_loop().run_in_executor(
            self._reads.pool, self._reads.build, since, until, by, live, hide, _group_names())

    async def areport_pages(self, since: float, until: float, by: str, viewer_uid: int, viewer_is_admin: bool
                            ) -> AsyncIterator[Report]:
        """The report in pages: by lease, PAGE_ROWS leases a page, each page with the
        whole period's total; by anything else, one page."""
        with self._reads.admitted(viewer_uid):
            whole = await self._areport(since, until, "user" if by == "lease" else by, viewer_uid, viewer_is_admin)
            if by != "lease":
                yield whole
                return
            _, _, live, hide = self._asked(whole.since, whole.until, viewer_uid, viewer_is_admin)
            loop = asyncio.get_running_loop()
            pages = self._reads.lease_pages(whole.since, whole.until, live, hide)
            try:
                while (page := await loop.run_in_executor(self._reads.pool, next, pages, None)) is not None:
                    yield Report(since=whole.since, until=whole.until, by=by, rows=page, total=whole.total,
                                 rows_hidden=whole.rows_hidden)
            finally:
                await loop.run_in_executor(self._reads.pool, pages.close)


def _group_names() -> Callable[[int], str]:
    """gid -> group name, looked up once per report (the lookup may go to LDAP)."""
    names: dict[int, str] = {}

    def name(gid: int) -> str:
        if gid not in names:
            try:
                names[gid] = grp.getgrgid(gid).gr_name
            except (KeyError, OverflowError):
                names[gid] = str(gid)
        return names[gid]

    return name


def fill(state_dir: Path, rows: Iterable[UsageRow]) -> int:
    """Write ended leases' rows straight into a broker's accounting file, with their day
    summaries, in one transaction (bench/scale_accounting.py fills a year this way; the
    broker must not be running). Returns the rows in the file."""
    conn = open_database(Path(state_dir) / DB_NAME)
    try:
        conn.execute("BEGIN")
        conn.executemany(f"INSERT OR IGNORE INTO usage ({COLUMNS}) VALUES ({MARKS})", (values(r) for r in rows))
        conn.execute("DELETE FROM meta WHERE key = ?", (usage_days.DAYS_READY,))
        usage_days.ensure(conn)
        conn.execute("COMMIT")
        return conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0]
    finally:
        conn.close()

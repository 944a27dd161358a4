"""Durable lease state: SQLite in WAL mode.

A grant or release is committed before the client hears of it. Writes commit in order,
those that come together in one transaction (group commit): on the event loop in its
next turn when they need no fsync and the writer thread is idle, else on the writer
thread (brokerd/state/writer.py says why).

How far a commit goes (docs/durability.md has the argument and the measurements):
- durability = "crash" (the default): WAL with synchronous=NORMAL. A commit has been
  written to the WAL file (the kernel's page cache) before the client hears of it, so the
  daemon's crash or `kill -9` loses nothing; only the host losing power can lose the last
  commits, and then every holder process died with the host anyway. What is not tied to
  a process outlives that: reservations (their grant and end) and drains are fsync'd.
- durability = "power": every commit is fsync'd (synchronous=FULL).

The `holdings` table has the device uuid as its primary key, so the database itself
refuses a second live lease on a device even if the manager had a bug. A memory share
(brokerd/leasing/shares.py) holds no row there: its lease row says its device and share. The wait queue is
kept the same way: a waiting request is on disk before its client hears its position.

At start-up the store refuses a file it cannot trust (not SQLite, failed integrity
check, unknown schema, holdings out of step with leases) with a message that says what
to do, rather than guessing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from dataclasses import asdict
from pathlib import Path

from brokerd.base.process import Holder, ProcessId
from brokerd.contract import CheckLine
from brokerd.leasing.model import ACTIVE, Lease, LeaseTerms
from brokerd.state.container_row import container_from_text, container_text
from brokerd.state.queue_record import WaitRecord
from brokerd.state.schema import MIGRATIONS, SCHEMA, SCHEMA_VERSION, migrate
from brokerd.state.writer import Commits, Op, StateError, Then

__all__ = ["DB_NAME", "DURABILITY", "SCHEMA_VERSION", "LeaseStore", "StateError"]

log = logging.getLogger("vaccel.brokerd")

DB_NAME = "leases.db"
_HISTORY_DAYS = 30



DURABILITY = ("crash", "power")


def _lease_row(lease: Lease) -> tuple:
    h = lease.holder
    return (
        lease.id, lease.state, h.uid, h.gid, h.pid, h.start_time, h.user, h.command,
        json.dumps(list(lease.devices)), lease.backend, lease.granted_at, lease.expires_at,
        lease.ended_at, lease.end_reason, json.dumps(asdict(lease.terms)),
        json.dumps([asdict(w) for w in lease.warnings]), int(lease.simulated),
        json.dumps(sorted(lease.members)), lease.requested_at, int(lease.reservation), lease.notice,
        lease.time_limit_s, lease.ending_state, lease.request_key, container_text(lease.container),
        lease.share_mib, lease.share_of_mib, int(lease.borrowed),
    )


def _grant_op(lease: Lease, request_id: str) -> Op:
    """The write of a grant as it is now: a lease that has already ended gets its row but
    never a device holding."""
    row = _lease_row(lease)
    holdings = [(u, lease.id) for u in lease.devices] if lease.active and not lease.share_mib else []

    def op(conn: sqlite3.Connection) -> None:
        conn.execute(f"INSERT INTO leases VALUES ({','.join('?' * len(row))})", row)
        conn.executemany("INSERT INTO holdings VALUES (?, ?)", holdings)
        if request_id:
            conn.execute("UPDATE queue SET lease_id=? WHERE id=?", (lease.id, request_id))

    return op


def _lease_from_row(row: sqlite3.Row) -> Lease:
    return Lease(
        id=row["id"],
        holder=Holder(row["uid"], row["gid"], row["pid"], row["start_time"], row["user"], row["command"]),
        devices=tuple(json.loads(row["devices"])),
        backend=row["backend"],
        granted_at=row["granted_at"],
        expires_at=row["expires_at"],
        terms=LeaseTerms(**json.loads(row["terms"])),
        warnings=tuple(CheckLine(**w) for w in json.loads(row["warnings"])),
        simulated=bool(row["simulated"]),
        state=row["state"],
        end_reason=row["end_reason"],
        ended_at=row["ended_at"],
        members={ProcessId(int(p), int(s)) for p, s in json.loads(row["members"])},
        requested_at=row["requested_at"],
        reservation=bool(row["reservation"]),
        notice=row["notice"],
        time_limit_s=row["time_limit_s"],
        ending_state=row["ending_state"],
        request_key=row["request_key"],
        container=container_from_text(row["container"]),
        share_mib=row["share_mib"],
        share_of_mib=row["share_of_mib"],
        borrowed=bool(row["borrowed"]),
    )


class LeaseStore:
    def __init__(self, state_dir: Path, durability: str = "crash") -> None:
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {', '.join(DURABILITY)}, got {durability!r}")
        self.path = Path(state_dir) / DB_NAME
        self._commits = Commits(fsync_all=durability == "power")

    # -- start-up (synchronous: runs before the daemon serves anyone) -------------------

    def open(self) -> tuple[list[Lease], list[Lease], dict[str, str]]:
        """Open and verify the database; return (active leases, recently ended leases,
        drained devices with their reasons)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.DatabaseError as exc:
            raise StateError(self._refusal(f"it cannot be opened ({exc})")) from exc
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=5000")
            # Read-only checks first: a file that is refused is left exactly as it was.
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise StateError(self._refusal(f"SQLite integrity check failed: {check}"))
            found = self._check_schema_version(conn)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StateError(self._refusal(f"it is not a usable SQLite database ({exc})")) from exc
        except StateError:
            conn.close()
            raise
        if found is not None and found < SCHEMA_VERSION:
            migrate(conn, found)
        conn.executescript(SCHEMA)
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        # One read transaction, one snapshot: a file something else commits to meanwhile (a
        # test reading a live daemon's file) must not show the leases of one moment and the
        # holdings of the next, which looks exactly like a file that cannot be trusted.
        conn.execute("BEGIN")
        try:
            active = [_lease_from_row(r) for r in conn.execute("SELECT * FROM leases WHERE state=?", (ACTIVE,))]
            ended = [
                _lease_from_row(r)
                for r in conn.execute(
                    "SELECT * FROM leases WHERE state<>? ORDER BY ended_at DESC LIMIT 1000", (ACTIVE,))
            ][::-1]
            holdings = {r[0]: r[1] for r in conn.execute("SELECT device_uuid, lease_id FROM holdings")}
            drained = {r[0]: r[1] for r in conn.execute("SELECT device_uuid, reason FROM drained")}
        except (sqlite3.DatabaseError, ValueError, TypeError, KeyError) as exc:
            raise StateError(self._refusal(f"a lease record is malformed ({exc})")) from exc
        finally:
            conn.execute("COMMIT")
        expected = {u: lease.id for lease in active if not lease.share_mib for u in lease.devices}
        if holdings != expected:
            raise StateError(self._refusal("its device holdings do not match its active leases"))
        conn.execute(
            "DELETE FROM leases WHERE state<>? AND ended_at < strftime('%s','now') - ?",
            (ACTIVE, _HISTORY_DAYS * 86400),
        )
        self._commits.start(conn, str(self.path))
        return active, ended, drained

    def _check_schema_version(self, conn: sqlite3.Connection) -> int | None:
        """Before anything is written: only an empty file is new (None). A file with tables
        but no version, or a version this daemon does not know, is refused as it is (no
        schema added, nothing stamped); an older known version is returned for migration."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            return None
        version = None
        if "meta" in tables:
            version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if version is None:
            raise StateError(self._refusal("it has tables but no schema version (not written by vaccel?)"))
        known = {str(v) for v in MIGRATIONS} | {str(SCHEMA_VERSION)}
        if version[0] not in known:
            raise StateError(self._refusal(
                f"it has schema version {version[0]}, this daemon knows {SCHEMA_VERSION} "
                "(was it written by a newer vaccel?)"))
        return int(version[0])

    def _refusal(self, why: str) -> str:
        return (
            f"refusing to start: the lease database {self.path} cannot be trusted: {why}. "
            f"Nothing was changed. Inspect it, or move it aside (mv {self.path} {self.path}.bad) "
            "to start with no leases; holders of old leases will then have to ask again."
        )

    # -- writes (async API; brokerd/state/writer.py commits them) ------------------------

    def _submit(self, op: Op, *, fsync: bool = False) -> asyncio.Future[None]:
        return self._commits.submit(op, fsync)

    def hold(self) -> None:
        """Hold the writes submitted from now on, until release_held() hands them over as
        one item: one transaction (one by one only if that fails). A lease's end and the
        grants of the devices it freed then reach the disk, and their waiter, at once;
        without this the end could commit alone before the pump had queued the grants."""
        self._commits.hold()

    def release_held(self) -> None:
        self._commits.release_held()

    def save_grant(self, lease: Lease, request_id: str = "") -> asyncio.Future[None]:
        """Record a grant (of queued request `request_id`, if any): _grant_op."""
        return self._submit(_grant_op(lease, request_id), fsync=lease.reservation)

    def save_grant_then(self, lease: Lease, request_id: str, then: Then) -> None:
        """save_grant, with `then(error or None)` called as it commits, ahead of the
        futures of its transaction (Commits.submit_then): the pump's grants."""
        self._commits.submit_then(_grant_op(lease, request_id), lease.reservation, then)

    def save_end(self, lease: Lease) -> asyncio.Future[None]:
        args = (lease.state, lease.ended_at, lease.end_reason, lease.id)

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM holdings WHERE lease_id=?", (lease.id,))
            conn.execute("UPDATE leases SET state=?, ended_at=?, end_reason=? WHERE id=?", args)
            conn.execute("DELETE FROM queue WHERE lease_id=?", (lease.id,))

        return self._submit(op, fsync=lease.reservation)

    def save_ending(self, lease: Lease) -> asyncio.Future[None]:
        """The lease now ends early at its expires_at, for the reason in its notice."""
        args = (lease.expires_at, lease.notice, lease.ending_state, lease.id)

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE leases SET expires_at=?, notice=?, ending_state=? WHERE id=?", args)

        return self._submit(op, fsync=lease.reservation)

    def save_times(self, leases: list[Lease]) -> asyncio.Future[None]:
        """The wall clock stepped and the leases' times moved with it (brokerd/core/clock_steps.py)."""
        args = [(lease.granted_at, lease.expires_at, lease.requested_at, lease.id) for lease in leases]

        def op(conn: sqlite3.Connection) -> None:
            conn.executemany("UPDATE leases SET granted_at=?, expires_at=?, requested_at=? WHERE id=?", args)

        return self._submit(op)

    def save_holder(self, lease: Lease) -> asyncio.Future[None]:
        """The lease was applied to a container, which may hold it now (its init the holder)."""
        args = (lease.holder.pid, lease.holder.start_time, container_text(lease.container), lease.id)

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE leases SET pid=?, start_time=?, container=? WHERE id=?", args)

        return self._submit(op)

    def save_members(self, lease: Lease) -> asyncio.Future[None]:
        args = (json.dumps(sorted(lease.members)), lease.id)

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE leases SET members=? WHERE id=?", args)

        return self._submit(op)

    def save_queued(self, record: WaitRecord) -> asyncio.Future[None]:
        """A request joins the end of the queue."""
        h = record.holder
        row = (record.request_id, record.key, h.uid, h.gid, h.pid, h.start_time, h.user, h.command,
               record.since, record.deadline, record.spec)

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO queue VALUES (?,?,?,?,?,?,?,?,?,?,?,'')", row)

        return self._submit(op)

    def save_dequeued(self, request_id: str) -> asyncio.Future[None]:
        """A request left the queue (gave up, its process exited) or its waiter has its grant."""
        def op(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM queue WHERE id=?", (request_id,))

        return self._submit(op)

    def queued(self) -> list[WaitRecord]:
        """After open(): the recorded queue in order, granted-but-undelivered requests
        (`lease_id` set, their lease still active) among them. Rows of grants whose lease
        has ended are dropped."""
        conn = self._conn
        assert conn is not None, "open() first"
        try:
            records = [
                WaitRecord(r["id"], r["request_key"],
                           Holder(r["uid"], r["gid"], r["pid"], r["start_time"], r["user"], r["command"]),
                           r["since"], r["deadline"], bytes(r["spec"]), r["lease_id"])
                for r in conn.execute("SELECT * FROM queue ORDER BY rowid")
            ]
        except (sqlite3.DatabaseError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise StateError(self._refusal(f"a queue record is malformed ({exc})")) from exc
        active = {r[0] for r in conn.execute("SELECT id FROM leases WHERE state=?", (ACTIVE,))}
        stale = [r.request_id for r in records if r.lease_id and r.lease_id not in active]
        conn.executemany("DELETE FROM queue WHERE id=?", [(i,) for i in stale])
        return [r for r in records if r.request_id not in stale]

    def committed(self) -> asyncio.Future[None]:
        """Done once every write submitted before it is on disk (the writer commits in order)."""
        return self._submit(lambda conn: None)

    def save_drain(self, uuid: str, reason: str, undo: bool) -> asyncio.Future[None]:
        def op(conn: sqlite3.Connection) -> None:
            if undo:
                conn.execute("DELETE FROM drained WHERE device_uuid=?", (uuid,))
            else:
                conn.execute("INSERT OR REPLACE INTO drained VALUES (?, ?)", (uuid, reason))

        return self._submit(op, fsync=True)

    def close(self) -> None:
        self._commits.close()

    # The writes' side (store_writer.Commits), as the daemon and tests see it.

    @property
    def _conn(self) -> sqlite3.Connection | None:
        return self._commits.conn

    @_conn.setter
    def _conn(self, conn: sqlite3.Connection | None) -> None:
        self._commits.conn = conn

    @property
    def commits(self) -> int:
        return self._commits.commits

    @property
    def fsync_all(self) -> bool:
        return self._commits.fsync_all

    @fsync_all.setter
    def fsync_all(self, value: bool) -> None:  # SIGHUP with a new durability
        self._commits.fsync_all = value

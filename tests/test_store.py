"""LeaseStore on its own, on a temp dir: what is on disk once a save's future resolves,
group commit, the batch-failure fallback, and the refusal of state it cannot trust.

The writer thread is steered with `WriterGate` (hold it at its next transaction, count
commits), never with sleeps or timed assertions."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from brokerd.base.process import Holder, ProcessId
from brokerd.contract import CheckLine
from brokerd.leasing.model import RELEASED, ContainerHold, Lease, LeaseTerms
from brokerd.state.store import DB_NAME, SCHEMA_VERSION, LeaseStore, StateError
from tests.store_gate import WriterGate

ROOT = Path(__file__).resolve().parent.parent


def make_lease(lease_id: str, *devices: str) -> Lease:
    """A lease with every stored field set to something other than its default."""
    return Lease(
        id=lease_id,
        holder=Holder(1000, 1000, 4242, 777, "ada", "python train.py"),
        devices=devices,
        backend="cuda",
        granted_at=1_700_000_000.5,
        expires_at=1_700_086_400.0,
        terms=LeaseTerms(allocator_config="expandable_segments:True", memory_cap_mib=2048,
                         accelerator_config_yaml="precision: bf16\n"),
        warnings=(CheckLine("WARN", "driver", "old driver", devices[0], "upgrade it"),),
        simulated=True,
        members={(4243, 778), (4244, 779)},
        requested_at=1_699_999_990.25,
        reservation=True,
        notice="revoked by root: maintenance",
        time_limit_s=7200.0,
        ending_state="revoked",
        container=ContainerHold("docker", "c" * 64, "zhang-pytorch", "pytorch-cuda:v2.7", ProcessId(4250, 790),
                                held=True, warn_signal=10),
    )


def ended(lease: Lease, reason: str = "done") -> Lease:
    # Recent: the store drops ended leases older than its history window when it opens.
    return dataclasses.replace(lease, state=RELEASED, end_reason=reason, ended_at=time.time())


def reopen(state_dir: Path) -> tuple[list[Lease], list[Lease], dict[str, str]]:
    store = LeaseStore(state_dir)
    try:
        return store.open()
    finally:
        store.close()


def raw(state_dir: Path, sql: str, *params: object) -> list[tuple]:
    """Read or change the file behind the store's back, as an operator or a bug would."""
    conn = sqlite3.connect(state_dir / DB_NAME)
    try:
        rows = conn.execute(sql, params).fetchall()
        conn.commit()
        return rows
    finally:
        conn.close()


def saved_store(state_dir: Path, *leases: Lease) -> None:
    """A state dir holding `leases`, written by the store itself and closed cleanly."""
    async def write() -> None:
        store = LeaseStore(state_dir)
        store.open()
        try:
            for lease in leases:
                await store.save_grant(lease)
        finally:
            store.close()

    asyncio.run(write())


# -- durability ------------------------------------------------------------------------


def test_a_grant_is_on_disk_before_its_future_resolves(tmp_path: Path):
    lease = make_lease("l-1", "GPU-0", "GPU-1")

    async def scenario() -> list[Lease]:
        store = LeaseStore(tmp_path)
        store.open()
        gate = WriterGate(store)
        gate.hold()
        try:
            saved = store.save_grant(lease)
            await gate.wait_held()
            assert not saved.done(), "the grant was acknowledged before its transaction began"
            assert raw(tmp_path, "SELECT id FROM leases") == []
        finally:
            gate.release()
        await saved
        # Read back by a second store while the first is still open and never closed:
        # nothing a clean shutdown would flush has happened.
        active, _, _ = reopen(tmp_path)
        store.close()
        return active

    assert asyncio.run(scenario()) == [lease]


KILLED_RIGHT_AFTER_SAVING = """
import asyncio, dataclasses, os, signal, sys
from brokerd.state.store import LeaseStore
from tests.test_store import ended, make_lease

def lease(lease_id, device):  # argv[2]: "reservation" (fsync'd, the writer thread) or "process" (the loop)
    return dataclasses.replace(make_lease(lease_id, device), reservation=sys.argv[2] == "reservation")

async def main():
    store = LeaseStore(sys.argv[1])
    store.open()
    await store.save_grant(lease("l-kept", "GPU-0"))
    gone = lease("l-gone", "GPU-1")
    await store.save_grant(gone)
    await store.save_end(ended(gone, "released by its holder"))
    print("saved", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


@pytest.mark.parametrize("kind", ["reservation", "process"])
def test_grants_and_releases_survive_kill9_right_after_their_futures_resolve(tmp_path: Path, kind: str):
    """Both places a commit runs (store_writer): a reservation's on the writer thread, a
    process's lease's on the event loop."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_RIGHT_AFTER_SAVING), str(tmp_path), kind],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL and r.stdout == "saved\n", r.stderr
    active, gone, _ = reopen(tmp_path)
    assert active == [dataclasses.replace(make_lease("l-kept", "GPU-0"), reservation=kind == "reservation")]
    assert [(lease.id, lease.state, lease.end_reason) for lease in gone] == [
        ("l-gone", RELEASED, "released by its holder")]
    assert raw(tmp_path, "SELECT device_uuid, lease_id FROM holdings") == [("GPU-0", "l-kept")]


class SyncLevels(WriterGate):
    """Records the connection's synchronous level at each COMMIT (1 NORMAL, 2 FULL)."""

    def __init__(self, store: LeaseStore) -> None:
        super().__init__(store)
        self.levels: list[int] = []

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql == "COMMIT":
            self.levels.append(self._conn.execute("PRAGMA synchronous").fetchone()[0])
        return super().execute(sql, *args)


def _commit_levels(tmp_path: Path, durability: str) -> tuple[str, list[int]]:
    held_by_process = dataclasses.replace(make_lease("l-proc", "GPU-0"), reservation=False)
    reservation = make_lease("l-res", "GPU-1")  # held by its user: outlives every process

    async def scenario() -> tuple[str, list[int]]:
        store = LeaseStore(tmp_path, durability)
        store.open()
        try:
            gate = SyncLevels(store)
            mode = gate.execute("PRAGMA journal_mode").fetchone()[0]
            for save in (lambda: store.save_grant(held_by_process), lambda: store.save_grant(reservation),
                         lambda: store.save_end(ended(held_by_process)), lambda: store.save_drain("GPU-2", "x", False),
                         lambda: store.save_end(ended(reservation))):
                await save()  # one at a time: each its own transaction
            return mode, gate.levels
        finally:
            store.close()

    return asyncio.run(scenario())


def test_by_default_commits_reach_the_wal_and_only_what_outlives_processes_is_fsynced(tmp_path: Path):
    """durability = "crash": a lease held by a process is written (kill -9 safe, proven by
    the torture test) but not fsync'd; a reservation's grant and end and a drain are."""
    mode, levels = _commit_levels(tmp_path, "crash")
    assert mode == "wal"
    assert levels == [1, 2, 1, 2, 2]  # proc grant, reservation grant, proc end, drain, reservation end


def test_durability_power_fsyncs_every_commit(tmp_path: Path):
    mode, levels = _commit_levels(tmp_path, "power")
    assert mode == "wal"
    assert levels == [2, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="durability"):
        LeaseStore(tmp_path, "sometimes")
    assert raw(tmp_path, "SELECT value FROM meta WHERE key='schema_version'") == [(str(SCHEMA_VERSION),)]


def test_a_closed_store_refuses_saves_rather_than_never_answering(tmp_path: Path):
    async def scenario() -> BaseException | None:
        store = LeaseStore(tmp_path)
        store.open()
        store.close()
        return await asyncio.gather(store.save_grant(make_lease("l-1", "GPU-0")), return_exceptions=True)

    (outcome,) = asyncio.run(scenario())
    assert isinstance(outcome, StateError) and "closed" in str(outcome)
    assert reopen(tmp_path)[0] == []


# -- group commit and the batch-failure fallback ----------------------------------------


def test_saves_queued_together_commit_in_one_transaction_in_order(tmp_path: Path):
    async def scenario() -> tuple[WriterGate, LeaseStore, list[int]]:
        store = LeaseStore(tmp_path)
        store.open()
        gate = WriterGate(store)
        gate.hold()
        try:
            head = store.save_grant(make_lease("l-0", "GPU-9"))
            await gate.wait_held()
            # While the writer is held, a burst queues behind it: one device handed from
            # lease to lease. Each grant is only valid after the end before it, so the
            # burst commits as one transaction only if it is applied in order.
            burst = []
            for i in range(1, 6):
                lease = make_lease(f"l-{i}", "GPU-0")
                burst.append(store.save_grant(lease))
                if i < 5:
                    burst.append(store.save_end(ended(lease)))
            resolved: list[int] = []
            for n, future in enumerate(burst):
                future.add_done_callback(lambda _, n=n: resolved.append(n))
        finally:
            gate.release()
        await head
        assert await asyncio.gather(*burst) == [None] * len(burst)
        store.close()
        return gate, store, resolved

    gate, store, resolved = asyncio.run(scenario())
    assert len(resolved) == 9
    assert gate.transactions == 2, "the held save's transaction, then one for the whole burst"
    assert store.commits == gate.transactions
    assert resolved == sorted(resolved), "futures resolve in the order the saves were made"
    assert [r[0] for r in raw(tmp_path, "SELECT id FROM leases ORDER BY rowid")] == [f"l-{i}" for i in range(6)]
    active, gone, _ = reopen(tmp_path)
    assert sorted(lease.id for lease in active) == ["l-0", "l-5"]
    assert [lease.id for lease in gone] == ["l-1", "l-2", "l-3", "l-4"]


def test_one_bad_save_in_a_batch_fails_alone_and_the_rest_commit(tmp_path: Path):
    a, b, c = make_lease("l-a", "GPU-0"), make_lease("l-b", "GPU-1", "GPU-0"), make_lease("l-c", "GPU-2")

    async def scenario() -> tuple[list[object], WriterGate, LeaseStore]:
        store = LeaseStore(tmp_path)
        store.open()
        gate = WriterGate(store)
        gate.hold()
        try:
            head = store.save_grant(make_lease("l-head", "GPU-9"))
            await gate.wait_held()
            # One batch; b also claims GPU-0, which a holds: the holdings key refuses it.
            batch = [store.save_grant(a), store.save_grant(b), store.save_grant(c)]
        finally:
            gate.release()
        await head
        outcomes = await asyncio.gather(*batch, return_exceptions=True)
        # The writer goes on after the failure.
        await store.save_end(ended(c))
        store.close()
        return outcomes, gate, store

    outcomes, gate, store = asyncio.run(scenario())
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], sqlite3.IntegrityError), outcomes[1]
    # head; the batch, rolled back; a and c alone (b rolled back); c's end.
    assert gate.transactions == 4 and store.commits == 4
    active, gone, _ = reopen(tmp_path)
    assert sorted(lease.id for lease in active) == ["l-a", "l-head"]
    assert [lease.id for lease in gone] == ["l-c"]
    # Nothing of b is left, not even its claim on GPU-1 made before it failed.
    assert sorted(raw(tmp_path, "SELECT device_uuid, lease_id FROM holdings")) == [
        ("GPU-0", "l-a"), ("GPU-9", "l-head")]
    assert raw(tmp_path, "SELECT id FROM leases WHERE id='l-b'") == []


# -- state the store cannot trust -------------------------------------------------------


def refusal(state_dir: Path) -> str:
    with pytest.raises(StateError) as refused:
        LeaseStore(state_dir).open()
    message = str(refused.value)
    assert message.startswith("refusing to start") and str(state_dir / DB_NAME) in message
    return message


def test_an_unknown_schema_version_is_refused_and_the_file_left_as_it_was(tmp_path: Path):
    saved_store(tmp_path, make_lease("l-1", "GPU-0"))
    newer = str(SCHEMA_VERSION + 1)
    raw(tmp_path, "UPDATE meta SET value=? WHERE key='schema_version'", newer)
    message = refusal(tmp_path)
    assert f"schema version {newer}, this daemon knows {SCHEMA_VERSION}" in message
    assert raw(tmp_path, "SELECT value FROM meta WHERE key='schema_version'") == [(newer,)]
    assert raw(tmp_path, "SELECT id, state FROM leases") == [("l-1", "active")]


def test_a_refused_newer_file_gets_no_tables_and_no_journal_change(tmp_path: Path):
    raw(tmp_path, "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    raw(tmp_path, "INSERT INTO meta VALUES ('schema_version', ?)", str(SCHEMA_VERSION + 1))
    assert "was it written by a newer vaccel?" in refusal(tmp_path)
    assert raw(tmp_path, "SELECT name FROM sqlite_master WHERE type='table'") == [("meta",)]
    assert raw(tmp_path, "PRAGMA journal_mode") == [("delete",)]


def test_a_database_with_leases_but_no_schema_version_is_refused(tmp_path: Path):
    saved_store(tmp_path, make_lease("l-1", "GPU-0"))
    raw(tmp_path, "DELETE FROM meta")
    assert "schema version" in refusal(tmp_path)
    assert raw(tmp_path, "SELECT * FROM meta") == []


def test_a_file_that_is_not_sqlite_is_refused_untouched(tmp_path: Path):
    db = tmp_path / DB_NAME
    junk = b"this is not sqlite" * 100
    db.write_bytes(junk)
    assert "it is not a usable SQLite database" in refusal(tmp_path)
    assert db.read_bytes() == junk


def test_a_damaged_database_is_refused(tmp_path: Path):
    saved_store(tmp_path, *(make_lease(f"l-{i}", f"GPU-{i}") for i in range(200)))
    db = tmp_path / DB_NAME
    assert not Path(f"{db}-wal").exists() or Path(f"{db}-wal").stat().st_size == 0
    data = bytearray(db.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page:3 * page] = b"\xa5" * page  # a page of the leases table, overwritten
    db.write_bytes(bytes(data))
    assert "cannot be trusted" in refusal(tmp_path)


def test_a_malformed_lease_record_is_refused(tmp_path: Path):
    saved_store(tmp_path, make_lease("l-1", "GPU-0"))
    raw(tmp_path, "UPDATE leases SET terms='{\"unknown_term\": 1}'")
    assert "a lease record is malformed" in refusal(tmp_path)


def test_holdings_out_of_step_with_the_leases_are_refused(tmp_path: Path):
    saved_store(tmp_path, make_lease("l-1", "GPU-0", "GPU-1"))
    raw(tmp_path, "DELETE FROM holdings WHERE device_uuid='GPU-1'")
    assert "do not match its active leases" in refusal(tmp_path)
    assert raw(tmp_path, "SELECT device_uuid FROM holdings") == [("GPU-0",)]


_V1_LEASES = """CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE leases (id TEXT PRIMARY KEY, state TEXT NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    pid INTEGER NOT NULL, start_time INTEGER NOT NULL, user TEXT NOT NULL, command TEXT NOT NULL,
    devices TEXT NOT NULL, backend TEXT NOT NULL, granted_at REAL NOT NULL, expires_at REAL NOT NULL,
    ended_at REAL NOT NULL DEFAULT 0, end_reason TEXT NOT NULL DEFAULT '', terms TEXT NOT NULL,
    warnings TEXT NOT NULL, simulated INTEGER NOT NULL, members TEXT NOT NULL DEFAULT '[]');
CREATE TABLE holdings (device_uuid TEXT PRIMARY KEY, lease_id TEXT NOT NULL REFERENCES leases(id));
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO leases VALUES ('l-old', 'active', 1000, 1000, 4242, 777, 'ada', 'python train.py', '["GPU-0"]',
    'cuda', 1700000000.5, 0, 0, '', '{}', '[]', 0, '[]');
INSERT INTO holdings VALUES ('GPU-0', 'l-old');
"""


def test_a_version_1_database_is_migrated_in_place_and_keeps_its_leases(tmp_path: Path):
    # A daemon upgraded from the first round finds its old file: the lease held then is
    # still held, with the new fields at their neutral values.
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.executescript(_V1_LEASES)
    conn.close()
    active, _, _ = reopen(tmp_path)
    assert [(lease.id, lease.devices, lease.reservation, lease.time_limit_s) for lease in active] == [
        ("l-old", ("GPU-0",), False, 0.0)]
    assert raw(tmp_path, "SELECT value FROM meta WHERE key='schema_version'") == [(str(SCHEMA_VERSION),)]
    active, _, _ = reopen(tmp_path)  # and it opens again as the current version
    assert [lease.id for lease in active] == ["l-old"]


def test_a_version_3_database_opens_with_no_container_and_keeps_one_applied_later(tmp_path: Path):
    # The file of the round before containers: its leases open as applied to none; a lease
    # applied to a container afterwards (its init now its holder) keeps it across a restart.
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.executescript(_V1_LEASES)
    conn.close()
    reopen(tmp_path)  # the file of today's daemon, as a version 1 file migrated
    for column in ("borrowed", "share_of_mib", "share_mib", "container"):  # what versions 4, 5 and 6 added
        raw(tmp_path, f"ALTER TABLE leases DROP COLUMN {column}")
    raw(tmp_path, "UPDATE meta SET value='3' WHERE key='schema_version'")
    active, _, _ = reopen(tmp_path)
    assert [(lease.id, lease.container) for lease in active] == [("l-old", None)]
    assert raw(tmp_path, "SELECT value FROM meta WHERE key='schema_version'") == [(str(SCHEMA_VERSION),)]
    hold = ContainerHold("podman-rootless", "", "notebook", "pytorch", ProcessId(5151, 999), held=True)

    async def apply() -> None:
        store = LeaseStore(tmp_path)
        lease = store.open()[0][0]
        lease.container = hold
        lease.holder = dataclasses.replace(lease.holder, pid=5151, start_time=999)
        try:
            await store.save_holder(lease)
        finally:
            store.close()

    asyncio.run(apply())
    active, _, _ = reopen(tmp_path)
    assert [(lease.holder.process, lease.container) for lease in active] == [(ProcessId(5151, 999), hold)]


def test_held_saves_wait_for_release_then_commit_as_one_transaction(tmp_path: Path):
    """LeaseStore.hold: what the service uses to put an end and the grants it frees into
    one commit. Nothing held is committed early, and a close still commits it."""
    first, second, third = (make_lease(f"l-{i}", f"GPU-{i}") for i in range(3))

    async def scenario() -> tuple[int, list[str]]:
        store = LeaseStore(tmp_path)
        store.open()
        gate = WriterGate(store)
        store.hold()
        saved = [store.save_grant(first), store.save_grant(second)]
        await asyncio.sleep(0.05)  # the writer thread is free to run meanwhile
        assert not any(f.done() for f in saved) and raw(tmp_path, "SELECT id FROM leases") == []
        store.release_held()
        await asyncio.gather(*saved)
        transactions = gate.transactions
        store.hold()
        store.save_grant(third)  # held, and never released: close() commits it
        store.close()
        return transactions, sorted(lease.id for lease in reopen(tmp_path)[0])

    assert asyncio.run(scenario()) == (1, ["l-0", "l-1", "l-2"])


def test_opening_a_file_that_is_committed_to_meanwhile_reads_one_moment_of_it(tmp_path: Path, monkeypatch):
    """A flaky CI failure: a test read a live daemon's file (active_on_disk) while the
    writer committed a hand-back. open() read the leases, the commit went in, then it read
    the holdings, and it refused the file as untrustworthy. One read transaction: the
    leases and holdings of one moment."""
    lease = dataclasses.replace(make_lease("l-1", "GPU-0"), reservation=False)

    async def grant() -> None:
        store = LeaseStore(tmp_path)
        store.open()
        try:
            await store.save_grant(lease)
        finally:
            store.close()

    asyncio.run(grant())
    real_connect = sqlite3.connect

    class CommitBeforeHoldingsAreRead:
        """The connection open() makes, with another connection's commit (the lease's end)
        slipped in right before open() reads the holdings."""

        def __init__(self, conn: sqlite3.Connection) -> None:
            object.__setattr__(self, "_conn", conn)

        def __getattr__(self, name: str):
            return getattr(self._conn, name)

        def __setattr__(self, name: str, value: object) -> None:
            setattr(self._conn, name, value)

        def execute(self, sql: str, *args: object):
            if sql.startswith("SELECT device_uuid, lease_id FROM holdings"):
                other = real_connect(tmp_path / DB_NAME, isolation_level=None)
                other.execute("PRAGMA busy_timeout=5000")
                other.executescript("BEGIN IMMEDIATE; DELETE FROM holdings; "
                                    "UPDATE leases SET state='released'; COMMIT;")
                other.close()
            return self._conn.execute(sql, *args)

    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: CommitBeforeHoldingsAreRead(real_connect(*a, **k)))
    store = LeaseStore(tmp_path)
    active, _, _ = store.open()  # the moment before the end: l-1 holds GPU-0
    store.close()
    monkeypatch.undo()
    assert [x.id for x in active] == ["l-1"]
    assert reopen(tmp_path)[0] == []  # and the end is on disk


def test_no_write_on_the_grant_or_release_path_reads_a_whole_table(tmp_path: Path):
    # A lease's end deleted its queue row by lease_id, which no index covered: a pass over
    # every waiting request's row (~75 us at 500, in the transaction the next waiter's
    # grant shares). SQLite's own plan for each statement says whether it searches by a key.
    from brokerd.state.queue_record import WaitRecord

    store = LeaseStore(tmp_path)
    store.open()
    statements: list[str] = []
    plans: list[tuple[str, str]] = []

    async def scenario() -> None:
        lease = dataclasses.replace(make_lease("l-1", "GPU-a"), reservation=False)
        holder = lease.holder
        await store.save_queued(WaitRecord("r-1", "k1", holder, 1.0, 0.0, b""))
        store._conn.set_trace_callback(statements.append)
        await store.save_grant(lease, "r-1")
        await store.save_members(lease)
        await store.save_ending(lease)
        await store.save_end(ended(lease))
        await store.save_dequeued("r-1")
        store._conn.set_trace_callback(None)

    try:
        asyncio.run(scenario())
        for sql in statements:
            if sql.split()[0].upper() in ("UPDATE", "DELETE"):
                plan = " / ".join(row[-1] for row in store._conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
                plans.append((sql, plan))
    finally:
        store.close()
    assert len(plans) >= 6, plans
    scans = [(sql, plan) for sql, plan in plans if not plan.startswith("SEARCH")]
    assert not scans, f"statements that read a whole table: {scans}"

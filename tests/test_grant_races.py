"""The two commit races of the grant path, each pinned by holding the store's writer
(tests/store_gate.py) exactly where the race needs it, never by sleeping.

A. Two waiters granted in one pump; the second one's holder exits while the first grant is
   being committed. Its grant must not leave a holdings row for an ended lease (the next
   grant on that device would fail on the key, and a restart would refuse the file).
B. A waiter that gives up at its deadline while its grant is being committed: the grant
   must be handed back at once, not left active until the TTL runs out.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
from pathlib import Path

from brokerd.base.process import Identity
from brokerd.base.procinfo import start_time
from brokerd.config.loader import Config
from brokerd.contract import Requirement
from brokerd.core.service import BrokerService
from brokerd.core.waiting import QueuedUpdate
from brokerd.devices.model import Device, Snapshot
from brokerd.leasing.errors import DeadlineExceeded
from brokerd.leasing.model import RELEASED, Lease
from brokerd.state.store import DB_NAME, LeaseStore
from tests.store_gate import WriterGate
from tests.test_service import active_on_disk, eventually, me, one_gpu


def two_gpus() -> Snapshot:
    return Snapshot(tuple(Device(i, f"GPU-{i}", "nvidia", "card", 1024, "cuda", "sm_80", simulated=True)
                          for i in range(2)), simulated=True)


def identity_of(proc: subprocess.Popen[bytes]) -> Identity:
    return Identity(os.getuid(), os.getgid(), proc.pid, start_time(proc.pid) or 0)


def rows(state_dir: Path, sql: str, *args: object) -> list[tuple]:
    conn = sqlite3.connect(state_dir / DB_NAME)
    try:
        return list(conn.execute(sql, args))
    finally:
        conn.close()


def test_a_waiter_that_exits_while_an_earlier_grant_of_its_pump_commits_leaves_no_holdings(tmp_path: Path):
    async def scenario() -> tuple[str, str]:
        store = LeaseStore(tmp_path)
        store.open()
        gate = WriterGate(store)
        service = BrokerService(Config(state_dir=tmp_path), store, two_gpus())
        service.restore([], [])
        sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
        holders, waiters = [identity_of(p) for p in sleepers[:2]], [identity_of(p) for p in sleepers[2:]]
        streams = []
        try:
            held = []
            for who in holders:
                stream = service.acquire(who, Requirement(1), wait=False, max_wait_s=None)
                lease = await anext(stream)
                assert isinstance(lease, Lease)
                held.append(lease)
                streams.append(stream)
            queued = [service.acquire(who, Requirement(1), wait=True, max_wait_s=None) for who in waiters]
            streams += queued
            for stream in queued:
                assert isinstance(await anext(stream), QueuedUpdate)
            gate.hold()
            try:
                releases = [asyncio.create_task(service.release(who, lease.id))
                            for who, lease in zip(holders, held, strict=True)]
                await gate.wait_held()
                # Both devices freed before any pump ran: one pump grants both waiters.
                await eventually(lambda: {lease.holder.pid for lease in service.manager.leases.values()}
                                 == {w.pid for w in waiters}, "one pump granted both waiters")
                second = next(lease for lease in service.manager.leases.values() if lease.holder.pid == waiters[1].pid)
                first = next(lease for lease in service.manager.leases.values() if lease.holder.pid == waiters[0].pid)
                sleepers[3].kill()  # the second waiter dies while the first grant is being committed
                await eventually(lambda: not second.active, "the broker saw the second waiter exit")
            finally:
                gate.release()
            for task in releases:
                await task
            await eventually(lambda: rows(tmp_path, "SELECT state FROM leases WHERE id=?", second.id)
                             and rows(tmp_path, "SELECT state FROM leases WHERE id=?", first.id),
                             "both grants reached the disk")
            await eventually(lambda: rows(tmp_path, "SELECT state FROM leases WHERE id=?", second.id)
                             != [("active",)], "the second lease's end reached the disk")
            # A restart trusts the file and finds exactly the live lease.
            assert active_on_disk(tmp_path) == {first.id}
            return first.id, second.id
        finally:
            for stream in streams:
                await stream.aclose()
            for p in sleepers:
                p.kill()
                p.wait()
            await service.close()
            store.close()

    first, second = asyncio.run(scenario())
    assert rows(tmp_path, "SELECT lease_id FROM holdings WHERE lease_id=?", second) == [], \
        "holdings written for a lease that had already ended"
    assert rows(tmp_path, "SELECT lease_id FROM holdings") == [], "the first grant was handed back at the end"
    assert first != second


def test_a_waiter_whose_deadline_passes_while_its_grant_commits_gets_it_handed_back(tmp_path: Path):
    async def scenario() -> Lease:
        store = LeaseStore(tmp_path)
        store.open()
        gate = WriterGate(store)
        service = BrokerService(Config(state_dir=tmp_path), store, one_gpu())
        service.restore([], [])
        first = service.acquire(me(), Requirement(1), wait=True, max_wait_s=None)
        holding = await anext(first)
        assert isinstance(holding, Lease)
        # A few seconds: long enough to set the race up on a loaded machine, and the
        # test waits for it to pass rather than asserting anything about time.
        second = service.acquire(me(), Requirement(1), wait=True, max_wait_s=3.0)
        assert isinstance(await anext(second), QueuedUpdate)
        gate.hold()
        try:
            releasing = asyncio.create_task(service.release(me(), holding.id))
            await gate.wait_held()
            await eventually(lambda: service.manager.leases and holding.id not in service.manager.leases,
                             "the pump granted the waiter")
            (granted,) = service.manager.leases.values()
            try:
                update = await anext(second)
            except DeadlineExceeded:
                pass  # the waiter gave up with its grant still uncommitted
            else:
                raise AssertionError(f"the waiter heard {update!r} before its grant was durable")
        finally:
            gate.release()
        await releasing
        try:
            await eventually(lambda: not granted.active, "the grant was handed back")
            await eventually(lambda: not active_on_disk(tmp_path), "the hand-back reached the disk")
        finally:
            await first.aclose()
            await second.aclose()
            await service.close()
            store.close()
        return granted

    granted = asyncio.run(scenario())
    assert granted.state == RELEASED and "left before the grant" in granted.end_reason


def test_the_store_never_writes_holdings_for_a_lease_that_has_already_ended(tmp_path: Path):
    """The store's own guard, whatever order a caller saves in."""
    async def scenario() -> None:
        store = LeaseStore(tmp_path)
        store.open()
        try:
            service = BrokerService(Config(state_dir=tmp_path), store, one_gpu())
            service.restore([], [])
            lease = service.manager.submit(service.users.holder(me(), ""), Requirement(1), wait=False)
            assert isinstance(lease, Lease)
            service.manager.end(lease.id, RELEASED, "ended before its grant was saved")
            await store.save_grant(lease)
            await service.close()
        finally:
            store.close()

    asyncio.run(scenario())
    assert rows(tmp_path, "SELECT state FROM leases") == [(RELEASED,)]
    assert rows(tmp_path, "SELECT * FROM holdings") == []
    assert active_on_disk(tmp_path) == set()

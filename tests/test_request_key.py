"""A request asked again under its key is the same request, across a restart too.

A client that loses the reply to a TryAcquire (the daemon died after the grant's commit
and before its answer, or the connection dropped) asks again under the same request key
(client/vaccel/session/acquisition.py). The lease it was granted is on disk and held by that very
process: the ask must get that lease back, not a second one that would sit on another
device until the process exits. Another process's ask under the same key is a new request
(the key is matched together with the kernel's word on who asks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

from brokerd.base.process import Identity
from brokerd.base.procinfo import start_time
from brokerd.config.loader import Config
from brokerd.contract import Requirement
from brokerd.core.service import BrokerService
from brokerd.leasing.model import Lease
from brokerd.state.store import LeaseStore
from tests.test_service import gpus, me, open_service


@contextlib.asynccontextmanager
async def serving(state_dir: Path, count: int, *, restarted: bool = False) -> AsyncIterator[BrokerService]:
    """A service on `count` devices, fresh or as a restarted daemon makes it from what is
    on disk; closed (the daemon gone) on leaving."""
    if restarted:
        store = LeaseStore(state_dir)
        active, ended, drained = store.open()
        service = BrokerService(Config(state_dir=state_dir), store, gpus(count))
        service.restore(active, ended, drained)
    else:
        store, service = open_service(state_dir, gpus(count))
    try:
        yield service
    finally:
        await service.close()
        store.close()


def test_a_lost_reply_asked_again_after_a_restart_gets_the_same_lease(tmp_path: Path):
    async def scenario() -> None:
        async with serving(tmp_path, 2) as service:
            first = await service.acquire_now(me(), Requirement(1), key="k-lost-reply")
        # The daemon died there: the grant is on disk, its reply never left.
        async with serving(tmp_path, 2, restarted=True) as service:
            again = await service.acquire_now(me(), Requirement(1), key="k-lost-reply")
            assert again.id == first.id
            assert [lease.id for lease in service.manager.leases.values() if lease.active] == [first.id]

    asyncio.run(scenario())


def test_a_grant_on_the_stream_whose_reply_was_lost_is_the_same_lease_after_a_restart(tmp_path: Path):
    """Acquire (the stream) grants at once when a device is free: no queue record keeps
    that request, so the lease's own key must find it."""
    async def scenario() -> None:
        async with serving(tmp_path, 2) as service:
            stream = service.acquire(me(), Requirement(1), wait=True, max_wait_s=None, key="k-stream")
            first = await anext(stream)
            assert isinstance(first, Lease)
        async with serving(tmp_path, 2, restarted=True) as service:
            stream = service.acquire(me(), Requirement(1), wait=True, max_wait_s=None, key="k-stream")
            again = await anext(stream)
            assert isinstance(again, Lease) and again.id == first.id
            assert [lease.id for lease in service.manager.leases.values()] == [first.id]

    asyncio.run(scenario())


def test_the_same_key_from_the_same_process_without_a_restart_is_the_same_lease(tmp_path: Path):
    async def scenario() -> None:
        async with serving(tmp_path, 2) as service:
            first = await service.acquire_now(me(), Requirement(1), key="k-1")
            again = await service.acquire_now(me(), Requirement(1), key="k-1")
            other_key = await service.acquire_now(me(), Requirement(1), key="k-2")
            assert again.id == first.id and other_key.id != first.id

    asyncio.run(scenario())


def test_another_processs_ask_under_the_same_key_is_a_new_request(tmp_path: Path):
    other = subprocess.Popen(["sleep", "60"])
    try:
        stranger = Identity(os.getuid(), os.getgid(), other.pid, start_time(other.pid) or 0)

        async def scenario() -> None:
            async with serving(tmp_path, 2) as service:
                mine = await service.acquire_now(me(), Requirement(1), key="k-shared")
                theirs = await service.acquire_now(stranger, Requirement(1), key="k-shared")
                assert theirs.id != mine.id and theirs.holder.pid == other.pid

        asyncio.run(scenario())
    finally:
        other.kill()
        other.wait()


def test_the_same_process_asking_as_another_user_is_a_new_request(tmp_path: Path):
    """A process that changed its uid (a root launcher dropping to a student) is not the
    holder of what it was granted before: as for a queue record, the user must match too."""
    async def scenario() -> None:
        async with serving(tmp_path, 2) as service:
            mine = await service.acquire_now(me(), Requirement(1), key="k-setuid")
            dropped = Identity(me().uid + 4242, me().gid, me().pid, me().start_time)
            theirs = await service.acquire_now(dropped, Requirement(1), key="k-setuid")
            assert theirs.id != mine.id and theirs.holder.uid == dropped.uid

    asyncio.run(scenario())


def test_a_released_lease_is_not_handed_back_under_its_key(tmp_path: Path):
    """The key finds only a lease that is still active: asking again after a release is a new ask."""
    async def scenario() -> None:
        async with serving(tmp_path, 1) as service:
            first = await service.acquire_now(me(), Requirement(1), key="k-done")
            await service.release(me(), first.id, "done", 0)
            again = await service.acquire_now(me(), Requirement(1), key="k-done")
            assert again.id != first.id and again.active

    asyncio.run(scenario())


def test_an_end_drops_only_the_grant_kept_for_its_own_lease_and_reads_no_other_record(monkeypatch):
    # The records of the waiting requests, and of grants kept for a waiter who was away.
    # A lease's end dropped its kept grant by reading every record (~0.25 ms of the daemon
    # per end at 500 waiting, on the way from a release to the next grant); it now looks
    # up the one record that holds that lease, if any.
    from brokerd.base.process import Holder
    from brokerd.state.queue_record import WaitRecord, WaitRecords

    records = WaitRecords()
    holder = Holder(1001, 1001, 500, 11, "alice")
    for n in range(50):
        records.add(WaitRecord(f"r-{n}", f"k{n}", holder, 1000.0 + n, 0.0, b""))
    records.granted("r-7", "l-kept")
    read: list[str] = []
    plain = WaitRecord.__getattribute__

    def counted(self, name):
        if name == "lease_id":
            read.append(self.request_id)
        return plain(self, name)

    monkeypatch.setattr(WaitRecord, "__getattribute__", counted)
    records.drop_lease("l-other")  # a lease with no kept grant: nothing to drop
    assert read == []
    records.drop_lease("l-kept")
    monkeypatch.undo()
    assert records.get("r-7") is None and records.find("k7", holder) is None
    assert records.get("r-8") is not None and records.find("k8", holder) is not None
    records.granted("r-8", "l-second")
    records.drop("r-8")  # the waiter took it up: its lease is no longer a kept grant
    records.drop_lease("l-second")
    assert all(records.get(f"r-{n}") is not None for n in range(50) if n not in (7, 8))

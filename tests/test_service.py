"""The async core without gRPC: a real store in a temp dir, the real event loop."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from brokerd.config import Config
from brokerd.contract import Requirement
from brokerd.devices import Device, Snapshot
from brokerd.identity import Identity
from brokerd.leases import RELEASED, Lease
from brokerd.procinfo import start_time
from brokerd.service import BrokerService, QueuedUpdate
from brokerd.store import LeaseStore


def me() -> Identity:
    return Identity(os.getuid(), os.getgid(), os.getpid(), start_time(os.getpid()) or 0)


def one_gpu() -> Snapshot:
    return Snapshot((Device(0, "GPU-0", "nvidia", "card", 1024, "cuda", "sm_80", simulated=True),), simulated=True)


def test_a_grant_left_in_the_mailbox_of_a_leaving_waiter_is_handed_back(tmp_path: Path):
    async def scenario() -> Lease:
        store = LeaseStore(tmp_path)
        store.open()
        service = BrokerService(Config(state_dir=tmp_path), store, one_gpu())
        service.restore([], [])
        first = service.acquire(me(), Requirement(1), wait=True, max_wait_s=None)
        holding = await anext(first)
        assert isinstance(holding, Lease)
        second = service.acquire(me(), Requirement(1), wait=True, max_wait_s=None)
        assert isinstance(await anext(second), QueuedUpdate)
        await service.release(me(), holding.id)
        await asyncio.sleep(0.1)  # the pump grants the waiter: the lease sits in its mailbox
        granted = next(iter(service.manager.leases.values()))
        await second.aclose()  # ...but the client has gone before reading it
        await asyncio.sleep(0.1)
        await first.aclose()
        await service.close()
        store.close()
        return granted

    granted = asyncio.run(scenario())
    assert granted.state == RELEASED and "left before the grant" in granted.end_reason


def test_a_waiter_gets_a_device_freed_by_expiry_of_several_leases_at_once(tmp_path: Path):
    """Leases ending together (expiry) with a waiter queued: the waiter's grant must be
    committed after the ends that freed its device, never fail on the holdings key and
    leave the waiter forgotten."""
    import subprocess

    async def scenario() -> tuple[object, dict]:
        store = LeaseStore(tmp_path)
        store.open()
        devices = (Device(0, "GPU-0", "nvidia", "A100", 81920, "cuda", simulated=True),
                   Device(1, "GPU-1", "nvidia", "A100", 40960, "cuda", simulated=True))
        service = BrokerService(Config(state_dir=tmp_path, heartbeat_ttl_s=1.0), store,
                                Snapshot(devices, simulated=True))
        service.restore([], [])
        sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
        idents = [Identity(0, 0, p.pid, start_time(p.pid) or 0) for p in sleepers]
        try:
            for who, memory in ((idents[0], 60000), (idents[1], 0)):
                holding = service.acquire(who, Requirement(1, min_memory_mib=memory), wait=False, max_wait_s=None)
                assert isinstance(await anext(holding), Lease)
                assert [x async for x in holding] == [], "the stream ends right after the grant"
            service.start_timers()  # neither holder heartbeats: both expire in the same turn
            waiting = service.acquire(idents[2], Requirement(1), wait=True, max_wait_s=None)
            assert isinstance(await anext(waiting), QueuedUpdate)
            granted = await asyncio.wait_for(anext(waiting), 10)
            assert [x async for x in waiting] == []
            assert isinstance(granted, Lease) and granted.active
            return granted, dict(service.manager.owner)
        finally:
            for p in sleepers:
                p.kill()
                p.wait()
            await service.close()
            store.close()

    granted, owner = asyncio.run(scenario())
    assert owner == {granted.devices[0]: granted.id}

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

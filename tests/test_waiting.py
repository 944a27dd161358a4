"""The waiting room: how often the waiters in a queue hear their place (brokerd/core/waiting.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from brokerd.core.waiting import ANNOUNCE_EVERY_S, LINE_SPACING_S, QueuedUpdate, WaitingRoom
from brokerd.leasing.model import Lease


class FakeManager:
    """What the waiting room reads of the lease manager: the queue, and nothing held (no
    device leased whole, no memory share)."""

    def __init__(self, waiters: int) -> None:
        self.queue = [SimpleNamespace(id=f"r-{i}", requirement=SimpleNamespace(gpus=1),
                                      ask=SimpleNamespace(memory_mib=0), reason="") for i in range(waiters)]
        self.devices: dict[str, Any] = {}
        self.owner: dict[str, str] = {}
        self.holdings = SimpleNamespace(shares={})

    def holders_summary(self) -> str:
        return "every device leased"

    def grant_head(self) -> Any:
        return self.queue.pop(0)


def _room(manager: FakeManager) -> tuple[WaitingRoom, dict[str, Any]]:
    """The room, its waiters' mailboxes, and a loop clock that stands still: the delays are
    read off the timers exactly, however loaded the machine (no timer is ever waited for)."""
    asyncio.get_running_loop().time = lambda: 1000.0  # type: ignore[method-assign]
    room = WaitingRoom()
    boxes = {request.id: room.open(request.id) for request in manager.queue}
    return room, boxes


def _delay(room: WaitingRoom) -> float:
    assert room._scheduled is not None, "no pass scheduled"
    return room._scheduled.when() - asyncio.get_running_loop().time()


def _drain(box: Any) -> list[Any]:
    items = []
    while not box.items.empty():
        items.append(box.items.get_nowait())
    return items


def test_a_short_queue_hears_its_new_places_within_a_tenth_of_a_second() -> None:
    asyncio.run(_a_short_queue_hears_its_new_places_within_a_tenth_of_a_second())


async def _a_short_queue_hears_its_new_places_within_a_tenth_of_a_second() -> None:
    manager = FakeManager(10)
    room, boxes = _room(manager)
    room.announce(manager)
    assert _delay(room) == pytest.approx(ANNOUNCE_EVERY_S)
    room._scheduled.cancel()
    room._announce_now(manager)  # the pass: everyone hears their place
    assert all(isinstance(_drain(box)[0], QueuedUpdate) for box in boxes.values())
    manager.grant_head()  # the head is granted: everyone moves up one
    room.announce(manager)
    assert _delay(room) == pytest.approx(ANNOUNCE_EVERY_S)  # 10 lines: the usual tenth of a second
    room._scheduled.cancel()


def test_a_long_queue_is_told_less_often_so_its_lines_never_take_the_loop() -> None:
    asyncio.run(_a_long_queue_is_told_less_often_so_its_lines_never_take_the_loop())


async def _a_long_queue_is_told_less_often_so_its_lines_never_take_the_loop() -> None:
    # 500 waiters told ten times a second took most of the loop while grants came and went
    # (bench.scale, 64 devices x 500 waiters), and each grant waited behind those passes.
    manager = FakeManager(500)
    room, boxes = _room(manager)
    room._announce_now(manager)
    assert sum(len(_drain(box)) for box in boxes.values()) == 500
    manager.grant_head()
    room.announce(manager)
    assert _delay(room) == pytest.approx(500 * LINE_SPACING_S)  # 1 s, not 0.1 s
    room._scheduled.cancel()


def test_the_spacing_counts_only_the_waiters_told() -> None:
    asyncio.run(_the_spacing_counts_only_the_waiters_told())


async def _the_spacing_counts_only_the_waiters_told() -> None:
    manager = FakeManager(500)
    room, _ = _room(manager)
    room._announce_now(manager)
    room._announce_now(manager)  # nothing changed: nobody told, so no wait is owed
    room.announce(manager)
    assert _delay(room) == pytest.approx(ANNOUNCE_EVERY_S)
    room._scheduled.cancel()


def test_a_grant_and_a_newcomers_place_are_never_paced() -> None:
    asyncio.run(_a_grant_and_a_newcomers_place_are_never_paced())


async def _a_grant_and_a_newcomers_place_are_never_paced() -> None:
    manager = FakeManager(500)
    room, boxes = _room(manager)
    room._announce_now(manager)
    for box in boxes.values():
        _drain(box)
    head = manager.grant_head()
    lease = Lease.__new__(Lease)  # any Lease object: the room only passes it on
    assert room.post(head.id, lease)
    assert boxes[head.id].items.get_nowait() is lease
    newcomer = SimpleNamespace(id="r-new", requirement=SimpleNamespace(gpus=2), ask=SimpleNamespace(memory_mib=0),
                               reason="")
    manager.queue.append(newcomer)
    box = room.open(newcomer.id)
    room.tell(manager, newcomer.id)
    line = box.items.get_nowait()
    assert isinstance(line, QueuedUpdate) and (line.position, line.total) == (500, 500)
    assert "waiting for 2 GPUs: position 500 of 500" in line.message

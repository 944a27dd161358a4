"""What a waiting request keeps in the daemon while it waits, whatever the host's size.

Each waiter's stream keeps its last queue line until the next one (gRPC holds the last
message sent; the generators that made it hold theirs). A newcomer's first line names the
held devices: on a 64-device host that was 64 device views of its own and a ~40 KB message
per waiter, kept for as long as it waited (bench.scale: 86 KB per waiter at 64 devices, 42
at 4). Now newcomers share one tuple of views while nothing held changes, and the stream
keeps the line as its bytes (6 KB).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc

from brokerd.contract import Requirement
from brokerd.core.waiting import QueuedUpdate, WaitingRoom
from brokerd.edge.rpc_limits import guarded_handlers
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Lease
from tests.test_leases import ALICE, BOB, gpu
from vaccel_common.v1 import broker_pb2 as pb


def _full_host(n: int) -> tuple[LeaseManager, list[Lease]]:
    counter = itertools.count()
    manager = LeaseManager([gpu(i) for i in range(n)], clock=lambda: 1000.0, new_id=lambda p: f"{p}{next(counter)}")
    leases = [manager.submit(ALICE, Requirement(1), wait=False) for _ in range(n)]
    assert all(isinstance(lease, Lease) for lease in leases)
    return manager, leases  # type: ignore[return-value]


def _first_line(room: WaitingRoom, manager: LeaseManager) -> QueuedUpdate:
    request = manager.submit(BOB, Requirement(1), wait=True)
    box = room.open(request.id)
    room.tell(manager, request.id)
    line = box.items.get_nowait()
    assert isinstance(line, QueuedUpdate) and line.request_id == request.id
    return line


def test_newcomers_share_the_held_devices_views_while_nothing_held_changes() -> None:
    manager, leases = _full_host(64)
    room = WaitingRoom()
    first, second = _first_line(room, manager), _first_line(room, manager)
    assert len(first.held) == 64 and first.position == 1 and second.position == 2
    assert second.held is first.held
    # A change of what is held is told as it is: the next newcomer gets new views.
    manager.release(leases[0].id, ALICE.uid)
    third = _first_line(room, manager)
    assert third.held is not first.held and len(third.held) == 63


class _Lines:
    """A streaming method as the servicer's are: an async generator of messages."""

    def __init__(self) -> None:
        self.sent = [pb.AcquireUpdate(queued=pb.Queued(position=i, total=3, message=f"position {i} of 3"))
                     for i in (1, 2, 3)]

    async def Acquire(self, request: pb.AcquireRequest, context: object) -> AsyncIterator[pb.AcquireUpdate]:
        for line in self.sent:
            yield line


def test_a_streams_lines_leave_the_guard_as_bytes_so_grpc_keeps_no_message() -> None:
    lines = _Lines()

    def add(servicer: _Lines, server: object) -> None:
        handler = grpc.unary_stream_rpc_method_handler(
            servicer.Acquire, request_deserializer=pb.AcquireRequest.FromString,
            response_serializer=pb.AcquireUpdate.SerializeToString)
        server.add_registered_method_handlers("vaccel.v1.Broker", {"Acquire": handler})  # type: ignore[attr-defined]

    guarded = guarded_handlers(lines, add)["Acquire"]
    assert guarded.response_serializer is None  # what the method yields goes out as it is

    async def read() -> list[object]:
        stream = guarded.unary_stream(pb.AcquireRequest(gpus=1).SerializeToString(), None)
        return [item async for item in stream]

    assert asyncio.run(read()) == [line.SerializeToString() for line in lines.sent]

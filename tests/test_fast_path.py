"""The unary fast path (TryAcquire): granted at once when devices are free, "would wait"
without queueing anything when they are not, the same refusals as the stream; the client
library takes it first and waits on the stream only when it must."""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import Broker
from tests.test_broker_integration import status


@pytest.fixture
def connection(broker: Broker):
    from vaccel.session.connection import BrokerConnection

    conn = BrokerConnection(broker.socket)
    yield conn
    conn.close()


def _try(conn, **fields):
    from vaccel_common.v1 import broker_pb2 as pb

    return conn.call("TryAcquire", pb.AcquireRequest(**fields), timeout=10)


def _release(conn, lease_id: str) -> None:
    from vaccel_common.v1 import broker_pb2 as pb

    conn.call("Release", pb.ReleaseRequest(lease_id=lease_id), timeout=10)


def test_a_free_host_grants_in_one_unary_call_and_a_full_one_queues_nothing(broker: Broker, connection):
    first = _try(connection, gpus=4, wait_forever=True, command="hold all")
    assert first.HasField("granted") and len(first.granted.devices) == 4
    assert sorted(d["uuid"] for d in status(broker)["devices"] if d["state"] == "leased") == sorted(
        d.uuid for d in first.granted.devices)

    would_wait = _try(connection, gpus=1, wait_forever=True, command="later")
    assert not would_wait.HasField("granted")
    assert would_wait.queued.position == 0 and "no free device" in would_wait.queued.message
    assert status(broker)["queue"] == []  # told, not queued: the client waits on the stream
    assert " refuse " not in broker.log.read_text()  # a client that will wait was refused nothing

    with pytest.raises(grpc.RpcError) as refused:  # may not wait: refused as the stream would
        _try(connection, gpus=1, command="now or never")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert " refuse " in broker.log.read_text()  # this one was: it may not wait
    with pytest.raises(grpc.RpcError) as never:
        _try(connection, gpus=5, wait_forever=True)
    assert never.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as bad:
        _try(connection, gpus=0)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    _release(connection, first.granted.id)
    again = _try(connection, gpus=1, wait_forever=True)
    assert again.HasField("granted")
    _release(connection, again.granted.id)


def test_the_client_waits_on_the_stream_only_when_it_must(broker: Broker, connection):
    import threading

    from vaccel.session.acquisition import Acquisition

    from vaccel_common.v1 import broker_pb2 as pb

    held = _try(connection, gpus=4, wait_forever=True).granted
    lines: list[str] = []
    got: list[pb.Lease] = []
    waiter = Acquisition(connection, pb.AcquireRequest(gpus=1, wait_forever=True, command="waiter"),
                         lines.append, lambda _line: None)
    thread = threading.Thread(target=lambda: got.append(waiter.run()))
    thread.start()
    try:
        from tests.test_broker_integration import wait_for

        wait_for(lambda: status(broker)["queue"], timeout=60)  # on the stream, in the queue
        _release(connection, held.id)
        thread.join(30)
        assert got and len(got[0].devices) == 1
        assert lines and "position 1 of 1" in lines[0]  # the stream's queue line, not the fast path's
    finally:
        waiter.cancel()
        thread.join(30)
    _release(connection, got[0].id)


def test_an_equal_request_against_the_same_devices_reuses_the_requirement_made_for_it():
    import asyncio

    from brokerd.devices.model import Device
    from brokerd.edge.work_guard import WorkGuard
    from vaccel_common.v1 import broker_pb2 as pb

    devices = tuple(Device(i, f"GPU-{i}", "nvidia", "card", 1024, "cuda", "sm_80", simulated=True) for i in range(4))
    spec = "required_features:\n  - min_memory: 512MiB\n"

    async def scenario() -> None:
        guard = WorkGuard()
        try:
            ask = pb.AcquireRequest(gpus=1, runtime_spec_yaml=spec)
            first = await guard.requirement(1000, ask, devices)
            same, more = (pb.AcquireRequest(gpus=n, runtime_spec_yaml=spec) for n in (1, 2))
            assert await guard.requirement(1001, same, devices) is first  # another user, the same ask
            assert await guard.requirement(1000, more, devices) is not first
            assert await guard.requirement(1000, ask, tuple(devices)[:3]) is not first  # the inventory changed
            large = pb.AcquireRequest(gpus=1, runtime_spec_yaml=spec + "#" * (128 * 1024) + "\n")
            assert await guard.requirement(1000, large, devices) is not await guard.requirement(1000, large, devices)
        finally:
            guard.close()

    asyncio.run(scenario())


def test_a_broker_that_said_wait_then_restarts_is_waited_for_as_a_restart(monkeypatch):
    """The fast path answered "wait" and the broker restarted before the stream's first
    place: the client waits for it as for a restart (RECONNECT_S), not as for a broker it
    never reached (START_RETRY_S). The broker's side of this window cannot be timed from a
    test, so the transport here is a stand-in that answers as the real one does."""
    import time

    from vaccel.session import acquisition

    from vaccel_common.v1 import broker_pb2 as pb

    monkeypatch.setattr(acquisition, "START_RETRY_S", 0.2)
    monkeypatch.setattr(acquisition, "RECONNECT_S", 30.0)

    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "failed to connect to all addresses"

    class Restarting:
        """Says "wait" once, then is away for 1 s, then grants on the stream."""

        tokens_taken = 0  # no identity socket here: only the "wait" tells it met the broker

        def __init__(self) -> None:
            self.back_at = 0.0

        def call(self, method, request, **_):
            assert method == "TryAcquire"
            self.back_at = time.monotonic() + 1.0
            return pb.AcquireUpdate(queued=pb.Queued(message="no free device satisfies the request now"))

        def stream(self, method, request, **_):
            assert method == "Acquire"
            away = time.monotonic() < self.back_at

            def updates():  # a real call fails when it is read, as this does
                if away:
                    raise Unavailable()
                yield pb.AcquireUpdate(granted=pb.Lease(id="l-back"))

            return updates()

        def wait_ready(self, timeout):
            time.sleep(min(timeout, 0.05))
            return False

        def forget_token(self):
            pass

    said: list[str] = []
    lease = acquisition.Acquisition(Restarting(), pb.AcquireRequest(gpus=1, wait_forever=True), None,  # type: ignore[arg-type]
                                    said.append).run()
    assert lease.id == "l-back"


def test_a_waiters_first_line_says_who_holds_what_and_no_more(broker: Broker, connection):
    from vaccel_common.v1 import broker_pb2 as pb

    held = _try(connection, gpus=4, wait_forever=True, command="hold all").granted
    stream = connection.stream("Acquire", pb.AcquireRequest(gpus=1, wait_forever=True, command="waiter"), timeout=30)
    try:
        first = next(stream)
        assert first.HasField("queued") and first.queued.position == 1
        assert sorted(d.uuid for d in first.queued.held) == sorted(d.uuid for d in held.devices)
        for device in first.queued.held:
            assert device.state == "leased" and device.lease_id == held.id and device.name
            assert device.holder.pid == held.holder.pid and device.since == held.granted_at
            # Who holds what, not the whole device (Status has that): gRPC keeps a stream's
            # last line until its next, so every waiter of a long queue held full devices.
            assert not (device.pci_bus_id or device.driver_version or device.device_nodes or device.backend)
        _release(connection, held.id)
        granted = next(stream)
        assert granted.HasField("granted") and len(granted.granted.devices) == 1
        assert granted.granted.devices[0].backend  # the grant's own devices stay whole
    finally:
        stream.cancel()
    _release(connection, granted.granted.id)


def test_newcomers_share_one_build_of_the_held_devices_while_they_stay_the_same(monkeypatch):
    """Each newcomer's first line carries the held devices; on a 64-device host building
    them for every newcomer cost its join ~0.7 ms of the loop. Equal views share one build,
    for at most HELD_MAX_AGE_S (the time left in it must stay right)."""
    import dataclasses
    import time

    from brokerd.core.views import DeviceView
    from brokerd.devices.model import Device
    from brokerd.edge import servicer as servicer_module
    from brokerd.edge.servicer import HELD_MAX_AGE_S, BrokerServicer
    from tests.test_store import make_lease

    clock = {"now": 1000.0}
    monkeypatch.setattr(servicer_module, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock["now"]),
                                                                    "time": staticmethod(time.time)}))
    servicer = BrokerServicer.__new__(BrokerServicer)
    servicer._held_cache = ((), 0.0, [])
    devices = [Device(i, f"GPU-{i}", "nvidia", "card", 1024, "cuda", "sm_80", simulated=True) for i in range(3)]
    lease = make_lease("l-1", "GPU-0", "GPU-1", "GPU-2")

    def views(holder=lease):
        return tuple(DeviceView(d, "leased", holder) for d in devices)  # a new tuple each time, as _send makes

    first = servicer._held_pb(views())
    assert [m.uuid for m in first] == ["GPU-0", "GPU-1", "GPU-2"] and first[0].lease_id == "l-1"
    assert servicer._held_pb(views()) is first  # the next newcomer: the same build
    other = dataclasses.replace(lease, id="l-2")
    changed = servicer._held_pb(views(other))
    assert changed is not first and changed[0].lease_id == "l-2"  # another holder: built anew
    clock["now"] += HELD_MAX_AGE_S
    assert servicer._held_pb(views(other)) is not changed  # a second on: its time left is rebuilt

"""The queue survives a restart of the daemon, and the clients ride through it.

Service level: the recorded queue comes back in order, minus requests whose process died
meanwhile; a waiter takes up its own place again under its key, with its first deadline,
and only the process that made the request can (another's key makes a fresh request).
Daemon level: `vaccel run` waiters keep their places and order across a kill -9 and say
so in one line; a holder rides through; a client that finds no broker retries, then gives
up with exit 69.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from brokerd.base.process import Holder
from brokerd.config.loader import Config
from brokerd.contract import Requirement
from brokerd.core.queueing import Rebuilt
from brokerd.core.service import BrokerService
from brokerd.core.waiting import QueuedUpdate
from brokerd.leasing.model import Lease
from brokerd.state.queue_record import WaitRecord
from brokerd.state.store import LeaseStore
from tests.conftest import Broker
from tests.test_grant_races import identity_of
from tests.test_service import one_gpu


def rebuild(spec: bytes) -> Rebuilt:
    return Rebuilt(Requirement(int(spec.decode())), "")


def open_service(state_dir: Path) -> tuple[LeaseStore, BrokerService]:
    store = LeaseStore(state_dir)
    active, ended, drained = store.open()
    queued = store.queued()
    service = BrokerService(Config(state_dir=state_dir), store, one_gpu())
    service.restore(active, ended, drained)
    service.restore_queue(queued, rebuild)
    return store, service


async def crash(store: LeaseStore, service: BrokerService, streams: list) -> None:
    """What a restart leaves: the streams are cut, nothing is cleaned up on disk."""
    service.shutting_down()
    for stream in streams:
        await stream.aclose()
    await service.close()
    store.close()


def test_the_queue_comes_back_in_order_and_only_its_own_process_takes_up_a_place(tmp_path: Path):
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    holder, *waiters = [identity_of(p) for p in sleepers]

    async def before() -> tuple[list[str], dict[str, float]]:
        store, service = open_service(tmp_path)
        held = service.acquire(holder, Requirement(1), wait=False, max_wait_s=None, spec=b"1")
        assert isinstance(await anext(held), Lease)
        streams, ids = [held], []
        for n, who in enumerate(waiters):
            stream = service.acquire(who, Requirement(1), wait=True, max_wait_s=1000.0 + n,
                                     key=f"key-{n}", spec=b"1")
            update = await anext(stream)
            assert isinstance(update, QueuedUpdate) and update.position == n + 1
            streams.append(stream)
            ids.append(update.request_id)
        deadlines = {i: service.records.get(i).deadline for i in ids}
        await crash(store, service, streams)
        return ids, deadlines

    async def after(ids: list[str], deadlines: dict[str, float]) -> None:
        store, service = open_service(tmp_path)
        streams = []
        try:
            assert [r.id for r in service.manager.queue] == [ids[0], ids[2]], \
                "the queue is back in order, without the request whose process died"
            assert len(service.manager.leases) == 1, "the holder's lease is back too"
            # The third waiter comes back under its key: its own place, its first deadline.
            back = service.acquire(waiters[2], Requirement(1), wait=True, max_wait_s=5.0, key="key-2", spec=b"1")
            streams.append(back)
            update = await anext(back)
            assert isinstance(update, QueuedUpdate)
            assert (update.request_id, update.position, update.total) == (ids[2], 2, 2)
            assert service.records.get(ids[2]).deadline == deadlines[ids[2]]
            # Another process presenting that key gets a request of its own at the end.
            other = service.acquire(waiters[0], Requirement(1), wait=True, max_wait_s=5.0, key="key-2", spec=b"1")
            streams.append(other)
            update = await anext(other)
            assert isinstance(update, QueuedUpdate)
            assert update.request_id not in ids and (update.position, update.total) == (3, 3)
            assert [r.id for r in service.manager.queue][:2] == [ids[0], ids[2]]
        finally:
            await crash(store, service, streams)

    try:
        ids, deadlines = asyncio.run(before())
        sleepers[2].kill()  # the second waiter dies while the broker is down
        sleepers[2].wait()
        asyncio.run(after(ids, deadlines))
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_a_grant_made_while_its_waiter_is_away_is_kept_for_it(tmp_path: Path):
    """After a restart the pump may grant a restored request before its client is back:
    the grant waits for it (and its TTL, not a hand-back, reclaims it if nobody comes)."""
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    holder, waiter = [identity_of(p) for p in sleepers]

    async def before() -> str:
        store, service = open_service(tmp_path)
        held = service.acquire(holder, Requirement(1), wait=False, max_wait_s=None, spec=b"1")
        assert isinstance(await anext(held), Lease)
        stream = service.acquire(waiter, Requirement(1), wait=True, max_wait_s=None, key="k", spec=b"1")
        update = await anext(stream)
        assert isinstance(update, QueuedUpdate)
        await crash(store, service, [held, stream])
        return update.request_id

    async def after() -> None:
        store, service = open_service(tmp_path)  # the holder is gone: the pump grants the waiter
        streams = []
        try:
            for _ in range(1000):
                if service.manager.leases and service.records.get(request_id).lease_id:
                    break
                await asyncio.sleep(0.01)
            (lease,) = service.manager.leases.values()
            assert lease.holder.pid == waiter.pid
            back = service.acquire(waiter, Requirement(1), wait=True, max_wait_s=None, key="k", spec=b"1")
            streams.append(back)
            assert await anext(back) is lease
            assert [x async for x in back] == []
            assert service.records.get(request_id) is None
        finally:
            await crash(store, service, streams)

    try:
        request_id = asyncio.run(before())
        sleepers[0].kill()
        sleepers[0].wait()
        asyncio.run(after())
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_a_request_its_client_asked_for_again_comes_back_once(tmp_path: Path):
    """A waiter whose grant could not be recorded (a full disk) asks again under its key, and
    the old request's record may stay on disk beside the new one (its removal met the same
    disk). After a restart only the newer waits: the older, granted to nobody, would expire
    unheard and get its live client reaped (issue 46's faulted day)."""
    sleeper = subprocess.Popen(["sleep", "60"])
    waiter = Holder.of(identity_of(sleeper), "ann", "sleep 60")

    async def recorded() -> None:
        store = LeaseStore(tmp_path)
        store.open()
        for n, request_id in enumerate(("r-refused", "r-asked-again")):
            await store.save_queued(WaitRecord(request_id, "k", waiter, time.time() + n, 0.0, b"1"))
        store.close()

    async def after() -> None:
        store, service = open_service(tmp_path)
        try:
            assert [r.id for r in service.manager.queue] == ["r-asked-again"]
            assert service.records.get("r-refused") is None
            back = service.acquire(waiter, Requirement(1), wait=True, max_wait_s=None, key="k", spec=b"1")
            update = await anext(back)  # the client takes up its own newer place
            assert isinstance(update, QueuedUpdate) and update.request_id == "r-asked-again"
            await crash(store, service, [back])
        finally:
            store.close()

    try:
        asyncio.run(recorded())
        asyncio.run(after())
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_request_its_client_holds_a_lease_for_does_not_come_back(tmp_path: Path):
    """The same, when the client's new request was granted from the queue: the lease it
    holds carries the request's key, so the old record left on disk is its client's past."""
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    holder = identity_of(sleepers[0])
    waiter = Holder.of(identity_of(sleepers[1]), "ann", "sleep 60")

    async def before() -> str:
        store, service = open_service(tmp_path)
        held = service.acquire(holder, Requirement(1), wait=False, max_wait_s=None, spec=b"1")
        first = await anext(held)
        await store.save_queued(WaitRecord("r-refused", "k", waiter, time.time(), 0.0, b"1"))
        stream = service.acquire(waiter, Requirement(1), wait=True, max_wait_s=None, key="k", spec=b"1")
        assert isinstance(await anext(stream), QueuedUpdate)
        await service.release(holder, first.id)
        granted = [x async for x in stream if isinstance(x, Lease)]
        await crash(store, service, [held, stream])
        return granted[0].id

    async def after(lease_id: str) -> None:
        store, service = open_service(tmp_path)
        try:
            assert list(service.manager.leases) == [lease_id]
            assert service.manager.queue == [] and service.records.get("r-refused") is None
        finally:
            await crash(store, service, [])

    try:
        asyncio.run(after(asyncio.run(before())))
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


# -- the real daemon -------------------------------------------------------------------

ONE_GPU = """devices:
  - vendor: nvidia
    name: NVIDIA A100-SXM4-80GB
    uuid: GPU-6f1a0c2e-0000-0000-0000-00000000a001
    pci_bus_id: "0000:07:00.0"
    memory_mib: 81920
    compute_capability: "8.0"
"""


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll `condition`; the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def queue_pids(broker: Broker) -> list[int]:
    out = broker.vaccel("status", "--json")
    if out.returncode != 0:
        return []
    return [entry["requester"]["pid"] for entry in json.loads(out.stdout)["queue"]]


def run_job(broker: Broker, tmp: Path, name: str, *script: str) -> subprocess.Popen[str]:
    """`vaccel run --wait 300 -- python -c ...` in the background; stderr goes to a file."""
    err = (tmp / f"{name}.err").open("w")
    code = "\n".join(("import pathlib, time", *script))
    return subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--gpus", "1", "--wait", "300", "--",
                             sys.executable, "-c", code], env=broker.env, stderr=err, text=True)


def test_vaccel_run_waiters_keep_their_places_across_a_kill9_and_the_holder_rides_through(start_broker, tmp_path):
    inventory = tmp_path / "one.yaml"
    inventory.write_text(ONE_GPU)
    broker = start_broker(inventory=inventory)
    order, go = tmp_path / "order", tmp_path / "go"
    holder = run_job(broker, tmp_path, "holder",
                     f"p = pathlib.Path({str(go)!r})", "while not p.exists():", "    time.sleep(0.05)",
                     f"open({str(order)!r}, 'a').write('holder\\n')")
    wait_until(lambda: (tmp_path / "holder.err").read_text().count("lease l-"), "the holder has the GPU")
    waiters = []
    for name in ("first", "second"):
        waiters.append(run_job(broker, tmp_path, name, f"open({str(order)!r}, 'a').write({name + chr(10)!r})"))
        expected = [w.pid for w in waiters]
        wait_until(lambda e=expected: queue_pids(broker) == e, f"{name} is queued")
    before = queue_pids(broker)
    assert before == [w.pid for w in waiters]

    broker.kill9()
    broker.start()
    wait_until(lambda: queue_pids(broker) == before, "the queue is back in the same order")
    for name, position in (("first", 1), ("second", 2)):
        wait_until(lambda n=name, p=position: f"broker restarted; still waiting, position {p} of 2"
                   in (tmp_path / f"{n}.err").read_text(), f"{name} says it is still waiting")
    go.touch()
    assert holder.wait(timeout=120) == 0, (tmp_path / "holder.err").read_text()
    for waiter, name in zip(waiters, ("first", "second"), strict=True):
        assert waiter.wait(timeout=120) == 0, (tmp_path / f"{name}.err").read_text()
        assert "lost the broker" not in (tmp_path / f"{name}.err").read_text()
    assert order.read_text().split() == ["holder", "first", "second"]


def test_a_client_that_finds_no_broker_retries_then_gives_up_with_69(start_broker, tmp_path):
    inventory = tmp_path / "one.yaml"
    inventory.write_text(ONE_GPU)
    broker = start_broker(inventory=inventory)
    broker.stop()  # started once: the files it needs are warm in the page cache
    err = tmp_path / "late.err"
    with err.open("w") as stream:
        late = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--gpus", "1", "--wait", "300", "--",
                                 "true"], env=broker.env, stderr=stream, text=True)
    wait_until(lambda: "retrying" in err.read_text(), "the client says it is retrying")
    broker.start()
    assert late.wait(timeout=120) == 0, err.read_text()
    broker.stop()
    gone = broker.vaccel("run", "--gpus", "1", "--wait", "300", "--", "true")
    assert gone.returncode == 69, gone.stderr
    assert "retrying for up to 5s" in gone.stderr and "cannot reach the vaccel broker" in gone.stderr


def test_a_client_that_finds_a_crashed_brokers_socket_waits_for_its_restart(start_broker, tmp_path):
    """A broker that crashed (or was killed) leaves its sockets behind, and the shipped unit
    restarts it after RestartSec=2s plus its start-up: on a loaded machine, more than the
    few seconds a client gives a broker it never reached. A socket nobody listens on says a
    broker was there and did not stop cleanly (a clean stop removes it), so a client that
    finds one waits for the restart as a waiting client does, within its --wait."""
    from vaccel.session import acquisition

    inventory = tmp_path / "one.yaml"
    inventory.write_text(ONE_GPU)
    broker = start_broker(inventory=inventory)
    broker.kill9()  # its socket files stay behind: nobody listens there
    err = tmp_path / "after-crash.err"
    with err.open("w") as stream:
        late = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--gpus", "1", "--wait", "300", "--",
                                 "true"], env=broker.env, stderr=stream, text=True)
    wait_until(lambda: "retrying" in err.read_text(), "the client says it is retrying")
    assert f"retrying for up to {acquisition.RECONNECT_S:.0f}s" in err.read_text(), err.read_text()
    # Longer than a broker never reached is given: the client must still be waiting.
    time.sleep(acquisition.START_RETRY_S + 1.0)
    broker.start()
    assert late.wait(timeout=120) == 0, err.read_text()


def test_no_wait_never_retries_past_its_wait(tmp_path):
    broker = Broker(tmp_path, None, "")  # never started
    gone = broker.vaccel("run", "--gpus", "1", "--no-wait", "--", "true")
    assert gone.returncode == 69 and "retrying" not in gone.stderr, gone.stderr


def test_a_call_that_may_wait_for_a_restart_waits_for_the_brokers_identity_socket_too(start_broker):
    """A heartbeat mints its token anew after a restart (the broker has a new key). When the
    broker is still down at that moment (killed again, or not yet listening), the call waits
    for it as it waits on UNAVAILABLE, within its retry_unavailable_s, instead of failing at
    once and losing a whole heartbeat interval (issue 46: a faulted lab day lost a lease)."""
    import threading

    from vaccel.session.connection import BrokerConnection

    from vaccel_common.v1 import broker_pb2 as pb

    broker = start_broker()
    broker.kill9()  # its socket files stay behind: nobody listens there
    conn = BrokerConnection(broker.socket, side_calls=False)  # no token yet: the first call mints one
    back = threading.Timer(1.0, broker.start)
    back.start()
    try:
        assert conn.call("Status", pb.StatusRequest(), retry_unavailable_s=120).devices
    finally:
        back.join()
        conn.close()

"""The client's one lease session (vaccel.session.lease_session): request building, the wait mapping,
the Acquire stream, heartbeat and loss, release. Unit tests with fake calls first, then
the session against the real daemon on the simulated 4-GPU lab."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from vaccel.contract import facts
from vaccel.session.acquisition import read_acquire
from vaccel.session.connection import BrokerUnavailable
from vaccel.session.lease import Lease, LeaseError
from vaccel.session.lease_session import LeaseRequest, LeaseSession, wait_fields

from tests.conftest import Broker
from vaccel_common.v1 import broker_pb2 as pb


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeCall:
    """An Acquire stream: yields `updates`, then raises `error` if given."""

    def __init__(self, updates: list[pb.AcquireUpdate], error: BaseException | None = None) -> None:
        self.updates, self.error, self.cancelled = updates, error, False

    def __iter__(self):
        yield from self.updates
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True


class FakeConnection:
    """Answers unary calls from a script: each entry is a reply or an exception to raise."""

    def __init__(self, script: dict[str, list[object]]) -> None:
        self.script, self.calls = script, []

    def call(self, method: str, request: object, **_: object) -> object:
        self.calls.append(method)
        answers = self.script.get(method, [pb.HeartbeatReply()])
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        pass


def granted(lease_id: str = "l-1", gpus: int = 1, interval: float = 5.0) -> pb.Lease:
    devices = [pb.Device(index=i, uuid=f"GPU-{i}", name="A100") for i in range(gpus)]
    return pb.Lease(id=lease_id, backend="cuda", devices=devices, heartbeat_interval_s=interval)


def offline_session(script: dict[str, list[object]], **kwargs) -> tuple[LeaseSession, FakeConnection]:
    session = LeaseSession("/nonexistent/brokerd.sock", **kwargs)
    fake = FakeConnection(script)
    session.connection = fake  # type: ignore[assignment]
    return session, fake


# -- request building ------------------------------------------------------------------


@pytest.mark.parametrize(("wait", "fields"), [
    (True, (True, 0.0)), (False, (False, 0.0)), (None, (False, 0.0)),
    (30, (False, 30.0)), (1.5, (False, 1.5)), ("2h", (False, 7200.0)),
])
def test_wait_mapping(wait, fields) -> None:
    assert wait_fields(wait) == fields


@pytest.mark.parametrize("bad", [{"gpus": 0}, {"gpus": True}, {"gpus": "2"}, {"wait": "soon"}])
def test_a_bad_request_fails_when_made(bad) -> None:
    with pytest.raises(ValueError):
        LeaseRequest(**bad)


@pytest.fixture
def fake_facts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Replaces gather_facts (which imports torch) and records each call's package names."""
    asked: list[tuple[str, ...]] = []

    def gather(packages=(), *, inspect_torch=True):
        asked.append(tuple(packages) if inspect_torch else ("(no torch)", *packages))
        return pb.ClientFacts(python_version="3.11.0")

    monkeypatch.setattr(facts, "gather_facts", gather)
    return asked


def test_build_carries_the_request(tmp_path: Path, fake_facts) -> None:
    request = LeaseRequest(gpus=3, min_memory_mib=1024, wait="90s", command="x" * 500)
    wire, files = request.build(tmp_path)
    assert (wire.gpus, wire.min_memory_mib, wire.wait_forever, wire.max_wait_seconds) == (3, 1024, False, 90.0)
    assert wire.command == "x" * 200
    assert files.empty and not wire.runtime_spec_yaml


def test_facts_go_with_a_contract_or_from_the_job_itself(tmp_path: Path, fake_facts) -> None:
    # A command started later (`vaccel run`) without a contract: no facts, no torch import.
    wire, _ = LeaseRequest().build(tmp_path)
    assert not wire.HasField("client") and fake_facts == []
    # The job is this interpreter (lease()): facts even without a contract.
    wire, _ = LeaseRequest(in_process=True).build(tmp_path)
    assert wire.client.python_version == "3.11.0" and fake_facts == [()]
    # A contract: facts for either, with the packages the contract names.
    spec = tmp_path / "runtime-spec.yaml"
    spec.write_text("dependencies:\n  - name: numpy\n    version: '>=1'\n")
    wire, files = LeaseRequest(contract=spec).build(tmp_path)
    assert wire.client.python_version == "3.11.0" and wire.runtime_spec_yaml == spec.read_text()
    assert fake_facts[-1] == ("numpy",) and files.packages == ("numpy",)


def test_a_notebook_kernels_facts_leave_torch_alone_unless_a_contract_needs_them(
        tmp_path: Path, fake_facts, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a kernel that has not imported it
    wire, _ = LeaseRequest(in_process=True, import_torch=False).build(tmp_path)
    assert wire.client.python_version == "3.11.0" and fake_facts == [("(no torch)",)]
    spec = tmp_path / "runtime-spec.yaml"
    spec.write_text("required_features: []\n")
    LeaseRequest(in_process=True, import_torch=False, contract=spec).build(tmp_path)
    assert fake_facts[-1] == ()  # a contract is checked against torch's build: inspected


# -- the Acquire stream ----------------------------------------------------------------


def queued(message: str) -> pb.AcquireUpdate:
    return pb.AcquireUpdate(queued=pb.Queued(position=1, total=1, message=message))


def test_read_acquire_reports_the_queue_and_returns_the_grant() -> None:
    seen: list[str] = []
    call = FakeCall([queued("waiting: position 1 of 1"), queued(""), pb.AcquireUpdate(granted=granted("l-7"))])
    assert read_acquire(call, seen.append).id == "l-7"
    assert seen == ["waiting: position 1 of 1"]


@pytest.mark.parametrize(("error", "code"), [
    (None, "internal"),
    (FakeRpcError(grpc.StatusCode.UNAVAILABLE, "gone"), "unavailable"),
    (FakeRpcError(grpc.StatusCode.CANCELLED), "cancelled"),
    (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free device"), "resource_exhausted"),
    (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "gave up"), "deadline_exceeded"),
])
def test_read_acquire_maps_refusals(error, code) -> None:
    with pytest.raises(LeaseError) as info:
        read_acquire(FakeCall([queued("waiting")], error), None)
    assert info.value.code == code


def test_an_interrupt_while_queued_leaves_the_queue() -> None:
    call = FakeCall([queued("waiting")], KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        read_acquire(call, None)
    assert call.cancelled


def test_an_unreachable_broker_is_a_lease_error(tmp_path: Path) -> None:
    with LeaseSession(tmp_path / "nothing.sock") as session, pytest.raises(LeaseError) as info:
        session.acquire(LeaseRequest())
    assert info.value.code == "unavailable" and "cannot reach the vaccel broker" in str(info.value)


# -- heartbeat and release, offline ----------------------------------------------------


def test_heartbeat_retries_then_reports_the_loss_once() -> None:
    lost: list[tuple[str, str]] = []
    told = threading.Event()

    def on_lost(held: Lease, reason: str) -> None:
        lost.append((held.id, reason))
        told.set()

    session, fake = offline_session({"Heartbeat": [
        BrokerUnavailable("restarting"), FakeRpcError(grpc.StatusCode.UNAVAILABLE), pb.HeartbeatReply(),
        FakeRpcError(grpc.StatusCode.NOT_FOUND, "lease l-1 was revoked by an admin")]}, on_lost=on_lost)
    held = session.adopt(granted(interval=0.01), joined=False)
    session.start_heartbeat()
    assert told.wait(60)  # a hang guard
    assert lost == [("l-1", "lease l-1 was revoked by an admin")]
    assert held.lost_reason == "lease l-1 was revoked by an admin" and held.ended
    assert fake.calls.count("Heartbeat") == 4, "a restarting broker is retried, not taken for a loss"
    assert session.release() is False and "Release" not in fake.calls, "a lost lease is not given back"


def test_release_gives_back_once_and_never_a_joined_lease() -> None:
    session, fake = offline_session({"Release": [pb.Lease()]})
    held = session.adopt(granted(), joined=False)
    assert session.release() is True and held.end_reason == "released"
    assert session.release() is False and fake.calls == ["Release"]
    session, fake = offline_session({"Release": [pb.Lease()]})
    session.adopt(granted(), joined=True)
    assert session.release() is False and fake.calls == []


@pytest.mark.parametrize(("error", "said"), [
    (FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "already ended"), False),
    (FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "not yours"), True),
    (BrokerUnavailable("cannot reach the vaccel broker"), True),
])
def test_a_failed_release_is_reported_unless_the_lease_had_ended(error, said) -> None:
    messages: list[str] = []
    session, _ = offline_session({"Release": [error]}, say=messages.append)
    held = session.adopt(granted(), joined=False)
    assert session.release() is False
    assert bool(messages) == said
    assert not messages or "could not release lease l-1" in messages[0]
    assert held.end_reason == "released", "this process is done with it either way"


# -- against the real daemon -----------------------------------------------------------


def status(broker: Broker) -> dict:
    result = broker.vaccel("status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def leased_pids(broker: Broker) -> list[int]:
    return [d["holder"]["pid"] for d in status(broker)["devices"] if d["state"] == "leased"]


@pytest.fixture
def no_facts(fake_facts) -> None:
    """Sessions in the test process send stub facts instead of importing torch."""


def test_session_acquires_holds_and_releases(broker: Broker, no_facts) -> None:
    with LeaseSession(broker.socket) as session:
        held = session.acquire(LeaseRequest(gpus=2, command="test session"))
        assert len(held.devices) == 2 and held.backend == "cuda" and not held.joined
        assert held.env["VACCEL_LEASE_ID"] == held.id
        session.start_heartbeat()
        assert leased_pids(broker) == [os.getpid(), os.getpid()]
        assert session.release() is True
        assert leased_pids(broker) == []
    ended = json.loads(broker.vaccel("leases", "--ended", "--json").stdout)["leases"]
    assert [lease["state"] for lease in ended if lease["id"] == held.id] == ["released"]


def test_a_background_wait_is_told_of_the_grant_and_can_be_cancelled(broker: Broker, no_facts) -> None:
    holder = LeaseSession(broker.socket)
    holder.acquire(LeaseRequest(gpus=4))
    queue: list[str] = []
    woken = threading.Event()
    waiter = LeaseSession(broker.socket, on_queue=queue.append)
    quitter = LeaseSession(broker.socket)
    try:
        pending = waiter.acquire_in_background(LeaseRequest(gpus=1), on_done=woken.set)
        # The waiter queues first: only then does the quitter join, behind it.
        deadline = time.monotonic() + 120  # only turns a hang into a failure
        while not queue:
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.01)
        leaving = quitter.acquire_in_background(LeaseRequest(gpus=1))
        assert not pending.wait(1.0), "granted while every device was held"
        assert any("position 1" in m for m in queue), queue
        while len(status(broker)["queue"]) != 2:  # the quitter queued behind it (when is the scheduler's)
            assert time.monotonic() < deadline, status(broker)["queue"]
            time.sleep(0.05)
        leaving.cancel()
        with pytest.raises(LeaseError) as info:
            leaving.result()
        assert info.value.code == "cancelled"
        assert len(status(broker)["queue"]) == 1, "a cancelled wait leaves the queue"
        holder.release()
        assert woken.wait(10), "on_done runs when the grant arrives"
        got = pending.result()
        assert len(got.devices) == 1 and waiter.lease is got
        assert waiter.release() is True
    finally:
        for session in (holder, waiter, quitter):
            session.close()


def test_a_revoked_lease_is_noticed_and_not_released_again(broker: Broker, no_facts) -> None:
    told = threading.Event()
    reasons: list[str] = []
    messages: list[str] = []

    def on_lost(held: Lease, reason: str) -> None:
        reasons.append(reason)
        told.set()

    with LeaseSession(broker.socket, on_lost=on_lost, say=messages.append) as session:
        held = session.acquire(LeaseRequest())
        session.start_heartbeat()
        r = broker.vaccel("release", held.id, "--reason", "maintenance")
        assert r.returncode == 0, r.stderr
        assert told.wait(15), "the heartbeat did not notice the revoke"
        assert "maintenance" in reasons[0] and held.lost_reason == reasons[0]
        assert session.release() is False and messages == []


def test_join_shares_a_lease_without_releasing_it(broker: Broker, no_facts) -> None:
    with LeaseSession(broker.socket) as owner, LeaseSession(broker.socket) as member:
        held = owner.acquire(LeaseRequest(gpus=2))
        with pytest.raises(LeaseError) as info:
            member.join(held.id, gpus=3)
        assert "asks for 3" in str(info.value)
        joined = member.join(held.id, gpus=2)
        assert joined.joined and joined.id == held.id
        assert [d.uuid for d in joined.devices] == [d.uuid for d in held.devices]
        assert member.release() is False
        assert len(leased_pids(broker)) == 2, "a member leaving does not end the lease"
        assert owner.release() is True
        with pytest.raises(LeaseError):
            member.join("l-doesnotexist")


def test_a_broker_that_hangs_up_before_the_token_is_unavailable(tmp_path: Path) -> None:
    """A broker dying mid-handshake (accepts the identity connection, then closes it) is a
    broker that cannot be reached right now, never a crash of the client."""
    import socket as sockets

    from vaccel.session.connection import BrokerConnection

    grpc_socket = tmp_path / "brokerd.sock"
    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    listener.bind(str(tmp_path / "brokerd.sock.id"))
    listener.listen(1)

    def hang_up() -> None:
        conn, _ = listener.accept()
        conn.close()

    server = threading.Thread(target=hang_up, daemon=True)
    server.start()
    try:
        with pytest.raises(BrokerUnavailable, match="closed the connection before answering"):
            BrokerConnection(grpc_socket)._mint_token()
    finally:
        server.join(5)
        listener.close()

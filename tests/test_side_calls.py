"""Unary calls over the identity socket (vaccel_common/side_call.py, brokerd/edge/side_calls.py):
what a short-lived client gets there is what gRPC would give it, identity comes from the
kernel alone, and whatever the side path cannot answer goes to gRPC unchanged."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from vaccel.connection import BrokerConnection

from tests.conftest import Broker
from tests.hostile_client import side_exchange
from vaccel_common.side_call import MAX_REQUEST_BYTES, METHODS, VIEWS, parse_reply_header, request_header
from vaccel_common.v1 import broker_pb2 as pb


def id_path(broker: Broker) -> str:
    return str(broker.socket) + ".id"


def raw_call(path: str, payload: bytes) -> tuple[bytes, bytes]:
    return side_exchange(path, payload, timeout=15)


def reply_of(rest: bytes) -> tuple[int, bytes]:
    header, _, body = rest.partition(b"\n")
    parsed = parse_reply_header(header)
    assert parsed is not None, rest[:200]
    code, length = parsed
    assert len(body) == length
    return code, body


def test_a_grant_and_its_release_over_the_side_path_are_the_callers_own(broker: Broker):
    conn = BrokerConnection(broker.socket, side_calls=True)
    update = conn.call("TryAcquire", pb.AcquireRequest(gpus=1, command="side"))
    assert update.HasField("granted")
    lease = update.granted
    assert lease.holder.pid == os.getpid() and lease.holder.uid == os.getuid()
    assert conn._channel is None  # no gRPC channel was needed
    status = conn.call("Status", pb.StatusRequest())
    assert [d.lease_id for d in status.devices if d.lease_id] == [lease.id]
    released = conn.call("Release", pb.ReleaseRequest(lease_id=lease.id))
    assert released.state == "released"
    assert conn._channel is None


def test_the_side_path_serves_only_its_methods_and_bounds_what_it_reads(broker: Broker):
    path = id_path(broker)
    # Not one of METHODS: told UNIMPLEMENTED, so the client uses gRPC.
    line, rest = raw_call(path, request_header("Drain", 2) + b"xx")
    assert line.startswith(b'{"token"')
    assert reply_of(rest)[0] == 12
    # Garbage, an oversized length, a header without its body: the token line and nothing more.
    for payload in (b"\xff" * 5000 + b"\n", b"CALL Status %d\n" % (MAX_REQUEST_BYTES + 1), b"GET / HTTP/1.1\r\n\r\n"):
        line, rest = raw_call(path, payload)
        assert rest == b"", (payload[:40], rest[:100])
    # An undecodable request: INVALID_ARGUMENT, as on gRPC (brokerd/edge/rpc_limits.py).
    _, rest = raw_call(path, request_header("TryAcquire", 5) + b"\xff\xff\xff\xff\x0f")
    code, details = reply_of(rest)
    assert code == 3 and b"cannot be decoded" in details
    # A client that sends half its request and then nothing is cut off after READ_TIMEOUT_S.
    started = time.monotonic()
    line, rest = raw_call(path, b"CALL Status 10\nabc")
    assert rest == b"" and time.monotonic() - started < 15
    assert "Traceback" not in broker.log.read_text()
    assert BrokerConnection(broker.socket, side_calls=True).call("Status", pb.StatusRequest()).devices


def test_a_refusal_is_told_once_in_grpcs_words(broker: Broker):
    """The side path's refusal is the servicer's own, raised as gRPC's; it is not asked
    again over gRPC (asking twice can act twice: in Slurm delegate mode, two jobs)."""
    too_many = pb.AcquireRequest(gpus=9)
    _, rest = raw_call(id_path(broker), request_header("TryAcquire", too_many.ByteSize())
                       + too_many.SerializeToString())
    side_code, side_details = reply_of(rest)
    assert side_code == 9  # FAILED_PRECONDITION, as over gRPC
    done = subprocess.run([sys.executable, "-m", "vaccel.cli", "run", "--gpus", "9", "--", "true"],
                          env=broker.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"vaccel: {side_details.decode()}" in done.stderr
    refusals = [ln for ln in broker.log.read_text().splitlines() if " refuse " in ln and "9 device(s)" in ln]
    assert len(refusals) == 2, refusals  # the raw call's and the CLI's, once each


def test_a_request_too_large_for_the_side_path_goes_over_grpc(broker: Broker, tmp_path: Path):
    big = "# " + "x" * MAX_REQUEST_BYTES + "\n"
    conn = BrokerConnection(broker.socket, side_calls=True)
    update = conn.call("TryAcquire", pb.AcquireRequest(gpus=1, runtime_spec_yaml=big))
    assert update.HasField("granted") and conn._channel is not None
    conn.call("Release", pb.ReleaseRequest(lease_id=update.granted.id))


def test_a_user_holding_many_side_connections_open_only_loses_the_side_path(broker: Broker):
    from brokerd.edge.side_calls import PER_USER

    path = id_path(broker)
    idle = []
    for _ in range(PER_USER):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.recv(4096)  # the token line; then it sends nothing and keeps the connection
        idle.append(sock)
    try:
        # Past the share, a request is not read: the client hears the token line only...
        _, rest = raw_call(path, request_header("Status", 0))
        assert rest == b""
        # ...and takes the gRPC path, which answers.
        conn = BrokerConnection(broker.socket, side_calls=True)
        assert conn.call("Status", pb.StatusRequest()).devices and conn._channel is not None
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    _, rest = raw_call(path, request_header("Status", 0))
    assert reply_of(rest)[0] == 0


def test_a_broker_that_predates_side_calls_is_asked_over_grpc(broker: Broker, tmp_path: Path):
    """An older daemon writes the token line and closes. Stand-in: a proxy identity socket in
    this very process (so the real broker's token is for this pid) that does just that."""
    old = tmp_path / "old.sock"
    old.symlink_to(broker.socket)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(old) + ".id")
    listener.listen()

    def serve() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
                upstream.connect(id_path(broker))
                client.sendall(upstream.makefile("rb").readline())

    threading.Thread(target=serve, daemon=True).start()
    try:
        conn = BrokerConnection(old, side_calls=True)
        assert conn.side_call("Status", pb.StatusRequest(), 10) is None
        assert conn.call("Status", pb.StatusRequest()).devices
        assert conn._channel is not None
    finally:
        listener.close()


def test_the_side_methods_are_unary_methods_the_client_knows_the_replies_of():
    from vaccel import connection

    from brokerd.edge.views import RENDERERS

    # A view answers with text (vaccel/entry.py reads it): the client library never asks for one.
    assert set(connection._SIDE_REPLIES) == METHODS - set(VIEWS)
    assert set(RENDERERS) == set(VIEWS)
    service = pb.DESCRIPTOR.services_by_name["Broker"]
    for name in METHODS:
        method = service.methods_by_name[VIEWS.get(name, name)]
        assert not method.server_streaming and not method.client_streaming
        if name not in VIEWS:
            assert method.output_type.full_name == connection._SIDE_REPLIES[name].DESCRIPTOR.full_name


def test_a_process_that_has_imported_grpc_makes_its_unary_calls_on_the_side_until_it_has_a_channel(broker: Broker):
    # Issue 45: grpc imported (tensorboard, ray, wandb do) made every `with lease()` set up a
    # channel and a token, twice the cycle of the two side calls.
    assert "grpc" in sys.modules  # pytest's process: the fixtures and other tests import it
    conn = BrokerConnection(broker.socket)
    assert conn.call("Status", pb.StatusRequest()).devices
    assert conn._channel is None
    # A connection that has a channel (a stream, a heartbeat) keeps to it.
    conn._ensure()
    assert conn.side_call("Status", pb.StatusRequest(), 5) is None
    assert conn.call("Status", pb.StatusRequest()).devices

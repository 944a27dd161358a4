"""The broker for clients that are not vaccel's (docs/api.md), against a real daemon: the
standard gRPC health service, server reflection driving a call without generated code, the
identity token minted by hand, the Node example client, and broker.proto in the wheel."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.conftest import Broker
from tests.test_multiuser import status

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent
NODE_EXAMPLE = ROOT / "examples" / "node"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def identity_token(broker: Broker) -> str:
    """What docs/api.md tells another language to do: one line from `<socket>.id`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as side:
        side.connect(f"{broker.socket}.id")
        line = side.makefile("rb").readline()
    return json.loads(line)["token"]


def test_health_answers_serving_without_a_token_and_not_serving_when_stopping(broker: Broker):
    with grpc.insecure_channel(f"unix:{broker.socket}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "vaccel.v1.Broker"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # An undecodable request is the client's mistake: one line, as for the Broker's methods.
        raw = channel.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.RpcError) as garbage:
            raw(b"\xff\xff\xff", timeout=10)
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        watch = health.Watch(health_pb2.HealthCheckRequest(service="vaccel.v1.Broker"), timeout=30)
        assert next(watch).status == SERVING
        broker.proc.terminate()  # a watcher hears the daemon stop before its stream ends
        assert next(watch).status == NOT_SERVING
    assert broker.proc.wait(timeout=20) == 0
    assert "Traceback" not in broker.log.read_text()


def test_reflection_finds_the_api_and_drives_a_call_without_generated_code(broker: Broker):
    with grpc.insecure_channel(f"unix:{broker.socket}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {"vaccel.v1.Broker", "grpc.health.v1.Health"} <= set(database.get_services())
        pool = DescriptorPool(database)  # filled from the daemon's broker.proto, not from vaccel_common
        method = pool.FindServiceByName("vaccel.v1.Broker").methods_by_name["Status"]
        request_type = message_factory.GetMessageClass(method.input_type)
        reply_type = message_factory.GetMessageClass(method.output_type)
        assert request_type.__module__ != "vaccel_common.v1.broker_pb2"
        call = channel.unary_unary(f"/{method.containing_service.full_name}/{method.name}",
                                   request_serializer=request_type.SerializeToString,
                                   response_deserializer=reply_type.FromString)
        with pytest.raises(grpc.RpcError) as anonymous:
            call(request_type(), timeout=10)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED  # reads of the broker need a token
        reply = call(request_type(), metadata=[("vaccel-token", identity_token(broker))], timeout=10)
    assert [d.uuid for d in reply.devices] == [d["uuid"] for d in status(broker)["devices"]]


def test_the_node_example_gets_a_token_reads_status_and_takes_and_releases_a_lease(broker: Broker):
    node = shutil.which("node")
    assert node and (NODE_EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir(), \
        "node and the example's packages are missing: run scripts/setup.sh"
    r = subprocess.run([node, str(NODE_EXAMPLE / "client.js")], env=broker.env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["devices"] == 4 and result["released"] == "released"
    assert result["held_by"] == result["pid"]  # the lease was the Node process's own, by the kernel's word
    assert result["lease"].startswith("l-") and len(result["leased"]) == 1
    assert not any(d["lease_id"] for d in status(broker)["devices"])


def test_the_wheel_ships_broker_proto_in_the_share_folder(tmp_path: Path):
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".venv", ".cache",
        "node_modules"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "--wheel-dir", str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("vaccel-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".data/data/share/vaccel/proto/vaccel/v1/broker.proto")]
        shipped = archive.read(name)
    assert shipped == (ROOT / "proto" / "vaccel" / "v1" / "broker.proto").read_bytes()

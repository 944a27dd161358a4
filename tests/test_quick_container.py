"""vaccel/run/quick_container.py without an engine: the grant's bytes read without protobuf as
protobuf reads them, the AttachContainer request written as protobuf writes it, and which
container runs take the quick path (the rest go to the full CLI). The path itself, against a
real dockerd and broker: tests/test_containers_overhead.py and tests/test_containers_run.py."""

from __future__ import annotations

import os

import pytest
from vaccel.containers.argv import ContainerLease, user_name
from vaccel.run import quick_container
from vaccel.session.lease import Lease

from vaccel_common.v1 import broker_pb2 as pb

SOCKET = "/run/vaccel/brokerd.sock"


def grant(**lease: object) -> pb.AcquireUpdate:
    update = pb.AcquireUpdate()
    update.granted.CopyFrom(pb.Lease(**lease))  # type: ignore[arg-type]
    return update


@pytest.mark.parametrize("update", [
    grant(id="l-1", backend="cuda", simulated=True, expires_at=12.5, heartbeat_interval_s=5.0,
          devices=[pb.Device(index=3, uuid="GPU-d", visible_id="GPU-d", device_nodes=["/dev/nvidia3"], name="T4",
                             memory_mib=16000, healthy=True),
                   pb.Device(index=1, uuid="GPU-b", device_nodes=["/dev/nvidia1", "/dev/nvidia-caps/x"])]),
    grant(id="l-2", backend="rocm", devices=[pb.Device(index=0, uuid="U0", visible_id="0", arch="gfx90a",
                                                      memory_bandwidth_gbps=1.5, numa_node=-1)]),
    grant(id="l-3", backend="cuda", devices=[pb.Device(index=-1, uuid="odd", label="gpu0.1", utilization=-1.0)]),
], ids=["nodes-and-doubles", "visible-ordinal", "negative-int32"])
def test_the_grant_is_read_as_protobuf_reads_it(update: pb.AcquireUpdate):
    env = {"VACCEL_LEASE_ID": update.granted.id, "CUDA_VISIBLE_DEVICES": "x"}
    read = quick_container.container_lease(update.SerializeToString(), env, SOCKET)
    assert read == ContainerLease.of(Lease(update.granted, joined=False), SOCKET, user_name())._replace(env=env)


@pytest.mark.parametrize("raw", [b"", b"\x08\x01", grant(id="l-1").SerializeToString(),  # queued; no devices
                                 grant(id="l-1", devices=[pb.Device(index=1)]).SerializeToString()[:-1],
                                 b"\x12\x05\x0a\x03ab", b"\x12\x02\x0f\x00"])
def test_what_is_not_a_grant_it_can_read_is_refused(raw: bytes):
    with pytest.raises(ValueError):
        quick_container.container_lease(raw, {}, SOCKET)


def test_the_attach_request_is_protobufs():
    wire = quick_container.attach_request("l-9", "c" * 64, "nb", "img:1")
    assert pb.AttachContainerRequest.FromString(wire) == pb.AttachContainerRequest(
        lease_id="l-9", container_id="c" * 64, warn_signal=10, name="nb", image="img:1")


@pytest.mark.parametrize("words, quick", [
    (["run", "--rm", "img", "true"], True),
    (["run", "--rm", "--name", "x", "-e", "A=1", "img", "sh", "-c", "exit 3"], True),
    (["run", "-d", "img", "sleep", "9"], False),  # -d: the container holds the lease (hold.py)
    (["run", "-it", "img", "sh"], False),  # can be detached from
    (["run", "-a", "STDIN", "-a", "stdout", "img", "cat"], False),
    (["run", "--device", "/dev/nvidia0", "img", "true"], False),  # refused: the full CLI says why
    (["start", "-a", "nb"], False),  # docker start: the full CLI inspects it
    (["ps"], False),
])
def test_only_foreground_runs_that_cannot_be_detached_from_are_quick(words: list[str], quick: bool):
    run = quick_container.readable(["docker", *words])
    assert (run is not None) == quick
    if os.geteuid() == 0:
        assert (quick_container.readable(["podman", *words]) is not None) == quick

"""The start guard's rule (brokerd/addons/containers/verdict.py), on real nodes and paths: which
container that starts may run on. The engines' side (events, stops) is in
tests/test_containers_restart.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from brokerd.addons.containers.info import ContainerInfo
from brokerd.addons.containers.verdict import held_devices, own_lease_label, why_stop
from brokerd.base.process import Holder
from brokerd.devices.model import Device
from brokerd.leasing.model import TIME_LIMIT, Lease

# Real character devices every host has, standing in for two GPUs' nodes.
GPU0, GPU1 = (Device(index=i, uuid=f"GPU-{i}", vendor="nvidia", name="Sim", memory_mib=1024, backend="cuda",
                     simulated=True, device_nodes=(node,)) for i, node in enumerate(("/dev/null", "/dev/zero")))
DEVICES = (GPU0, GPU1)


def lease(lease_id: str, *devices: Device, state: str = "active", user: str = "alice") -> Lease:
    return Lease(lease_id, Holder(1000, 1000, 1, 1, user, "cmd"), tuple(d.uuid for d in devices), "cuda", 0.0,
                 state=state, end_reason="time limit 4h reached" if state != "active" else "")


def container(labels: dict[str, str] | None = None, paths: tuple[str, ...] = (), ids: tuple[str, ...] = ()
              ) -> ContainerInfo:
    return ContainerInfo("docker", "c" * 64, "nb", "img", 42, True, labels or {}, "running", "sha256:x", paths, ids)


def verdict(info: ContainerInfo, active: list[Lease], ended: list[Lease] = (), image: dict | None = None,
            let_start: dict | None = None) -> str:
    return why_stop(info, image or {}, {x.id: x for x in active}, {x.id: x for x in ended}, DEVICES, let_start or {})


def test_an_ended_leases_label_is_stopped_and_says_how_it_ended():
    old = lease("l-old", GPU0, state=TIME_LIMIT)
    reason = verdict(container({"org.vaccel.lease": "l-old"}), [], [old])
    assert reason.startswith("it carries the label of lease l-old, which has ended (") and "time limit" in reason
    assert "which has ended" in verdict(container({"org.vaccel.lease": "l-never"}), [])


def test_a_live_leases_own_container_runs_and_a_plain_one_without_devices_too():
    live = lease("l-1", GPU0)
    assert verdict(container({"org.vaccel.lease": "l-1"}, ("/dev/null",)), [live]) == ""
    assert verdict(container(), [live]) == ""


def test_a_leased_devices_node_without_its_own_lease_is_stopped_by_any_name(tmp_path: Path):
    theirs = lease("l-bob", GPU1, user="bob")
    (tmp_path / "other-name").symlink_to("/dev/zero")
    for paths, ids in [(("/dev/zero",), ()), ((str(tmp_path / "other-name"),), ()), (("/dev",), ()),
                       ((), ("GPU-1",)), ((), ("1",)), ((), ("*",))]:
        reason = verdict(container({}, paths, ids), [theirs])
        assert "holds gpu1 (GPU-1), leased to bob (lease l-bob)" in reason, (paths, ids)
    # A node of a free device, a bind of / or of another folder: nothing leased is held.
    assert verdict(container({}, ("/dev/null", "/", str(tmp_path))), [theirs]) == ""
    mine = lease("l-mine", GPU0)
    assert "leased to bob" in verdict(container({"org.vaccel.lease": "l-mine"}, ("/dev/zero",)), [mine, theirs])


def test_a_label_its_image_gave_it_is_not_its_own():
    labels = {"org.vaccel.lease": "l-old", "org.vaccel.user": "alice"}
    assert own_lease_label(labels, labels) == "" and own_lease_label(labels, {}) == "l-old"
    assert verdict(container(labels), [], image=labels) == ""


def test_a_container_let_start_under_a_live_lease_runs_whatever_its_label():
    new = lease("l-new", GPU0)
    info = container({"org.vaccel.lease": "l-old"}, ("/dev/null",))
    assert verdict(info, [new], let_start={info.id: "l-new"}) == ""
    assert "which has ended" in verdict(info, [], let_start={info.id: "l-new"})  # that lease is over too


def test_held_devices_reads_nodes_by_their_device_number(tmp_path: Path):
    if os.geteuid() == 0:  # a node of its own, another name for /dev/zero's device number
        os.mknod(tmp_path / "zero-again", 0o600 | stat.S_IFCHR, os.stat("/dev/zero").st_rdev)
        assert [d.label for d in held_devices(container({}, (str(tmp_path / "zero-again"),)), DEVICES)] == ["gpu1"]
    assert [d.label for d in held_devices(container({}, ("/dev/zero", "/nonexistent")), DEVICES)] == ["gpu1"]

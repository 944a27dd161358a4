"""NvmlProbe on a GPU in MIG mode, against the fake `pynvml` of tests/test_probes_nvidia.py
with NVML's MIG device handles added (issue 35): the instances are the leasable devices,
with the GPU's facts and their own memory, profile, processes and enforcement nodes; an
instance that vanishes is a vanished device; a contract is checked against an instance.

The instance memory sizes are plausible H100 80GB figures (1g.10gb ~ 9.8 GiB, 3g.40gb
~ 39 GiB), not copied from a machine: no GPU was at hand when this was written."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from brokerd.contract import Requirement, evaluate
from brokerd.contract.spec import parse_runtime_spec
from brokerd.devices.probes import run_probes
from brokerd.devices.probes.nvidia import NvmlProbe
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import LOST, Ask
from tests.test_leases import ALICE, BOB
from tests.test_probes_nvidia import MIB, FakeNvml, load_fixture, real

GPU1 = "GPU-0f6a2a4c-3f8e-2c55-1b0e-9d7c1e4b2a11"
# GPU 1's instances by MIG slot: two of profile 1g.10gb, one of 3g.40gb, with their GPU
# and compute instance ids as `nvidia-smi mig -lgi` / `-lci` would list them.
INSTANCES = {
    0: {"uuid": "MIG-1b2c3d4e-0000-5000-8000-000000000001", "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        "total_mib": 40192, "used_mib": 13, "gi": 2, "ci": 0, "processes": [{"pid": 4242, "used_mib": 2048}]},
    2: {"uuid": "MIG-1b2c3d4e-0000-5000-8000-000000000002", "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        "total_mib": 9856, "used_mib": 13, "gi": 9, "ci": 0, "processes": []},
    3: {"uuid": "MIG-1b2c3d4e-0000-5000-8000-000000000003", "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        "total_mib": 9856, "used_mib": 13, "gi": 10, "ci": 0, "processes": []},
}
# /proc/driver/nvidia-caps/mig-minors of a driver that gates MIG access with device nodes
# (its format: one "gpu<minor>/gi<id>[/ci<id>]/access <cap minor>" per line).
MIG_MINORS = """config 1
monitor 2
gpu1/gi2/access 30
gpu1/gi2/ci0/access 31
gpu1/gi9/access 93
gpu1/gi9/ci0/access 94
gpu1/gi10/access 102
gpu1/gi10/ci0/access 103
"""


class MigNvml(FakeNvml):
    """FakeNvml with GPU 1 in MIG mode: MIG handles are (gpu, slot) tuples."""

    def __init__(self) -> None:
        data = load_fixture()
        data["devices"][1]["mig_mode"] = [1, 1]
        super().__init__(data)
        self.instances: dict[int, dict[str, Any]] = {k: dict(v) for k, v in INSTANCES.items()}

    def module(self) -> Any:
        mod = super().module()

        def instance(handle: tuple[int, int]) -> dict[str, Any]:
            found = self.instances.get(handle[1])
            if found is None:
                raise self.error(real.NVML_ERROR_NOT_FOUND)
            return found

        def either(name: str, on_instance: Any) -> None:
            on_gpu = getattr(mod, name, None)

            def call(handle: Any, *args: Any) -> Any:
                if isinstance(handle, tuple):
                    return on_instance(instance(handle), *args)
                if on_gpu is None:
                    raise self.error(real.NVML_ERROR_INVALID_ARGUMENT)
                return on_gpu(handle, *args)

            setattr(mod, name, call)

        either("nvmlDeviceGetUUID", lambda i: i["uuid"])
        either("nvmlDeviceGetName", lambda i: i["name"])
        either("nvmlDeviceGetMemoryInfo", lambda i, version=None: SimpleNamespace(
            total=i["total_mib"] * MIB, used=i["used_mib"] * MIB, free=(i["total_mib"] - i["used_mib"]) * MIB))
        either("nvmlDeviceGetGpuInstanceId", lambda i: i["gi"])
        either("nvmlDeviceGetComputeInstanceId", lambda i: i["ci"])
        either("nvmlDeviceGetComputeRunningProcesses", lambda i: [
            SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used_mib"] * MIB) for p in i["processes"]])

        def max_count(handle: int) -> int:
            if self.data["devices"][handle]["mig_mode"][0] != 1:
                raise self.error(real.NVML_ERROR_NOT_SUPPORTED)
            return 7  # an H100 has at most seven instances

        mod.nvmlDeviceGetMaxMigDeviceCount = max_count
        mod.nvmlDeviceGetMigDeviceHandleByIndex = lambda handle, slot: (
            (handle, slot) if slot in self.instances else instance((handle, slot)))
        return mod


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> MigNvml:
    nvml = MigNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    return nvml


@pytest.fixture
def minors(tmp_path: Path) -> Path:
    path = tmp_path / "mig-minors"
    path.write_text(MIG_MINORS)
    return path


def probe(minors: Path) -> Any:
    return run_probes([NvmlProbe(mig_minors=minors)], cpu_fallback=False)


def test_a_gpu_in_mig_mode_offers_its_instances_of_two_profiles(fake: MigNvml, minors: Path) -> None:
    snapshot = probe(minors)
    whole, *instances = snapshot.devices
    assert (whole.label, whole.mig_index) == ("gpu0", -1)
    assert [d.label for d in instances] == ["gpu1.0", "gpu1.1", "gpu1.2"]
    assert GPU1 not in {d.uuid for d in snapshot.devices}, "the GPU itself is no device while in MIG mode"
    assert [(d.uuid, d.mig_profile, d.memory_mib) for d in instances] == [
        (INSTANCES[0]["uuid"], "3g.40gb", 40192), (INSTANCES[2]["uuid"], "1g.10gb", 9856),
        (INSTANCES[3]["uuid"], "1g.10gb", 9856)]
    for d in instances:
        assert d.parent_uuid == GPU1 and d.visible == d.uuid  # CUDA_VISIBLE_DEVICES takes the MIG uuid
        assert (d.arch, d.compute_capability, d.driver_version) == ("sm_90", "9.0", "535.129.03")
        assert d.healthy and d.extra["mig_mode"] == "enabled"
    assert [(p.pid, p.device_uuid, p.used_memory_mib) for p in snapshot.processes] == [
        (4242, INSTANCES[0]["uuid"], 2048)], "processes are the instances', none on the GPU itself"


def test_instance_nodes_are_the_gpu_node_and_its_own_cap_nodes(fake: MigNvml, minors: Path, tmp_path: Path) -> None:
    first = probe(minors).devices[1]
    assert first.device_nodes == ("/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31")
    # A driver that does not gate MIG access with nodes: the GPU's node only.
    plain = probe(tmp_path / "absent").devices[1]
    assert plain.device_nodes == ("/dev/nvidia1",)


def test_an_instance_that_vanishes_is_a_vanished_device_and_its_lease_ends_lost(
        fake: MigNvml, minors: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = LeaseManager(probe(minors).devices)
    small = INSTANCES[3]["uuid"]
    lease = manager.submit(ALICE, Requirement(1), wait=False, ask=_only(small))
    other = manager.submit(BOB, Requirement(1), wait=False, ask=_only(INSTANCES[0]["uuid"]))
    del fake.instances[3]  # the admin destroyed it: nvidia-smi mig -dci/-dgi
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    after = probe(minors)
    assert small not in {d.uuid for d in after.devices}
    (lost,) = manager.set_inventory(after.devices)
    assert (lost.id, lost.state) == (lease.id, LOST) and "disappeared" in lost.end_reason
    assert other.active
    manager.check_invariants()


def test_a_contract_is_checked_against_an_instance(fake: MigNvml, minors: Path) -> None:
    devices = probe(minors).devices
    spec = parse_runtime_spec("required_features:\n  - gpu_compute_capability: sm_90\n  - min_memory: 20GiB\n")
    evaluation = evaluate(Requirement(1, spec=spec), list(devices))
    by_label = {d.label: d.uuid for d in devices}
    assert by_label["gpu1.0"] in evaluation.eligible  # 3g.40gb: the GPU's sm_90, its own 39 GiB
    assert by_label["gpu1.1"] not in evaluation.eligible  # 1g.10gb: too little memory of its own
    lines = {ln.name: ln for ln in evaluation.per_device[by_label["gpu1.1"]]}
    assert any(ln.level == "ERROR" and "memory" in ln.name.lower() for ln in lines.values())
    assert all(ln.level != "ERROR" for ln in evaluation.per_device[by_label["gpu1.0"]])


def test_mig_mode_without_instances_offers_nothing_of_that_gpu_and_says_why(
        fake: MigNvml, minors: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.instances.clear()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    snapshot = probe(minors)
    assert [d.label for d in snapshot.devices] == ["gpu0"]
    assert "GPU 1 is in MIG mode with no instance: nothing to lease there" in snapshot.verdicts[0].reason


def test_an_unhealthy_gpu_makes_each_of_its_instances_unhealthy(
        fake: MigNvml, minors: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.data["devices"][1]["ecc_uncorrected_volatile"] = 3
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    instances = probe(minors).devices[1:]
    assert instances and all(not d.healthy and "3 uncorrectable ECC error(s)" in d.health_reason for d in instances)


def _only(uuid: str) -> Ask:
    return Ask(only=(uuid,))

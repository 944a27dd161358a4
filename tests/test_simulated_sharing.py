"""The simulated inventory's sharing keys (issue 35): `mig:` turns a GPU into its MIG
instances (gpu0.0, gpu0.1 ...), `usage_file:` stands in for the per-process memory a
real probe reads, read again at every probe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from brokerd.devices.probes import run_probes
from brokerd.devices.probes.simulated import InventoryError, SimulatedProbe

INVENTORY = """
devices:
  - vendor: nvidia
    name: NVIDIA A100-SXM4-80GB
    uuid: GPU-a
    memory_mib: 81920
    compute_capability: "8.0"
    device_nodes: [/dev/nvidia0]
    usage_file: {usage}
  - vendor: nvidia
    name: NVIDIA H100 80GB HBM3
    uuid: GPU-b
    memory_mib: 81559
    compute_capability: "9.0"
    device_nodes: [/dev/nvidia1]
    mig:
      - {{profile: 3g.40gb, uuid: MIG-b0, memory_mib: 40192, device_nodes: [/dev/nvidia-caps/nvidia-cap30]}}
      - {{profile: 1g.10gb, uuid: MIG-b1, memory_mib: 9856, usage_file: {usage_b1}}}
"""


def write(tmp_path: Path, **usage: dict[str, int]) -> Path:
    files = {}
    for name in ("usage", "usage_b1"):
        files[name] = tmp_path / f"{name}.json"
        if name in usage:
            files[name].write_text(json.dumps(usage[name]))
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY.format(**files))
    return path


def test_mig_instances_are_devices_under_their_gpu(tmp_path: Path) -> None:
    snapshot = run_probes([SimulatedProbe(write(tmp_path))], cpu_fallback=False)
    assert [(d.label, d.uuid, d.memory_mib, d.mig_profile, d.parent_uuid) for d in snapshot.devices] == [
        ("gpu0", "GPU-a", 81920, "", ""),
        ("gpu1.0", "MIG-b0", 40192, "3g.40gb", "GPU-b"),
        ("gpu1.1", "MIG-b1", 9856, "1g.10gb", "GPU-b")]
    first, second = snapshot.devices[1:]
    assert (first.name, first.arch) == ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "sm_90")
    assert first.device_nodes == ("/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap30")
    assert second.device_nodes == ("/dev/nvidia1",)  # the GPU's node serves each of its instances


def test_usage_files_give_per_process_memory_at_every_probe(tmp_path: Path) -> None:
    probe = SimulatedProbe(write(tmp_path))
    assert probe.probe().processes == ()  # no file yet: nothing in use
    (tmp_path / "usage.json").write_text(json.dumps({"4242": 2048, "4243": 512}))
    (tmp_path / "usage_b1.json").write_text(json.dumps({"77": 100}))
    result = probe.probe()
    assert sorted((p.pid, p.device_uuid, p.used_memory_mib) for p in result.processes) == [
        (77, "MIG-b1", 100), (4242, "GPU-a", 2048), (4243, "GPU-a", 512)]
    assert {d.uuid: d.memory_used_mib for d in result.devices}["GPU-a"] == 2560


@pytest.mark.parametrize(("change", "words"), [
    (lambda t: t.replace("memory_mib: 40192", "memory_mib: 99999"), "memory_mib must be positive and at most"),
    (lambda t: t.replace("profile: 3g.40gb, ", ""), "expected profile, uuid, memory_mib"),
    (lambda t: t.replace("uuid: MIG-b1", "uuid: MIG-b0"), "duplicate uuid(s) MIG-b0"),
    (lambda t: t.replace("uuid: MIG-b1", "uuid: GPU-b"), "duplicate uuid(s) GPU-b"),
])
def test_bad_mig_entries_are_refused_naming_the_entry(tmp_path: Path, change, words: str) -> None:
    path = write(tmp_path)
    path.write_text(change(path.read_text()))
    with pytest.raises(InventoryError, match=words.replace("(", r"\(").replace(")", r"\)")):
        SimulatedProbe(path).probe()


def test_a_malformed_usage_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path)
    (tmp_path / "usage.json").write_text("[1, 2")
    with pytest.raises(InventoryError, match=r"devices\[0\]: usage_file .*usage.json"):
        SimulatedProbe(path).probe()

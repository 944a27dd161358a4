"""IntelSysfsProbe against a sysfs tree written in a temp dir from
tests/fixtures/probes/intel_sysfs.yaml (an Arc A770 on i915, a Max 1550 on xe, and an
integrated UHD 770 that must not be offered)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from brokerd.devices.probes.intel import IntelSysfsProbe

FIXTURE = Path(__file__).parent / "fixtures" / "probes" / "intel_sysfs.yaml"


def write_tree(root: Path, cards: list[dict[str, Any]]) -> Path:
    for c in cards:
        device = root / "devices" / "pci0000:00" / c["pci"]
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x8086\n")
        (device / "device").write_text(c["device_id"] + "\n")
        (device / "numa_node").write_text(c.get("numa_node", "-1") + "\n")
        (device / "uevent").write_text(f"DRIVER={c['driver']}\nPCI_SLOT_NAME={c['pci']}\n")
        for rel, text in (c.get("device_files") or {}).items():
            (device / rel).parent.mkdir(parents=True, exist_ok=True)
            (device / rel).write_text(text + "\n")
        card = root / "class" / "drm" / c["card"]
        card.mkdir(parents=True)
        (card / "device").symlink_to(device)
        for rel, text in (c.get("card_files") or {}).items():
            (card / rel).write_text(text + "\n")
        (root / "class" / "drm" / f"{c['card']}-DP-1").mkdir()  # connectors are skipped
    return root


@pytest.fixture
def cards() -> list[dict[str, Any]]:
    return yaml.safe_load(FIXTURE.read_text())["cards"]


def test_discrete_gpus_found_integrated_skipped(tmp_path: Path, cards: list[dict]) -> None:
    root = write_tree(tmp_path, cards)
    result = IntelSysfsProbe(root, kernel_release="6.8.0-45-generic").probe()
    assert result.verdict.available
    assert "skipped 0000:00:02.0 (8086:a780)" in result.verdict.reason
    arc, pvc = result.devices
    assert (arc.name, arc.arch, arc.backend, arc.vendor) == (
        "Intel Arc A770", "Xe_HPG", "xpu", "intel")
    assert arc.memory_mib == 16384
    assert arc.uuid == "XPU-0000:03:00.0"
    assert arc.pci_bus_id == "0000:03:00.0"
    assert arc.driver_version == "6.8.0-45-generic"  # in-tree i915: the kernel's version
    assert arc.memory_bandwidth_gbps == 560.0
    assert arc.numa_node == 0
    assert arc.extra["driver"] == "i915"
    assert (pvc.name, pvc.arch) == ("Intel Data Center GPU Max 1550", "Xe_HPC")
    assert pvc.memory_mib == 131072  # two tiles of 64 GiB
    assert pvc.extra["tiles"] == 2
    assert pvc.extra["driver"] == "xe"
    # Level Zero ordinals count every Intel GPU on i915/xe, the iGPU included.
    assert (arc.visible_id, pvc.visible_id) == ("1", "2")
    assert arc.visible == "1"


def test_module_version_is_used_when_the_driver_has_one(
    tmp_path: Path, cards: list[dict]
) -> None:
    root = write_tree(tmp_path, cards)
    (root / "module" / "i915").mkdir(parents=True)
    (root / "module" / "i915" / "version").write_text("1.23.10.54.231129.55\n")
    arc = IntelSysfsProbe(root, kernel_release="x").probe().devices[0]
    assert arc.driver_version == "1.23.10.54.231129.55"


def test_unknown_discrete_gpu_with_local_memory_is_offered(tmp_path: Path) -> None:
    root = write_tree(tmp_path, [{"card": "card0", "pci": "0000:05:00.0",
                                  "device_id": "0xe2ff", "driver": "xe",
                                  "device_files": {"tile0/physical_vram_size_bytes":
                                                   "12884901888"}}])
    (device,) = IntelSysfsProbe(root, kernel_release="6.12").probe().devices
    assert device.name == "Intel GPU 8086:e2ff"
    assert device.arch == ""
    assert device.memory_mib == 12288


def test_known_gpu_without_memory_size_degrades_that_field(tmp_path: Path) -> None:
    root = write_tree(tmp_path, [{"card": "card0", "pci": "0000:03:00.0",
                                  "device_id": "0x56a0", "driver": "i915"}])
    (device,) = IntelSysfsProbe(root, kernel_release="6.8").probe().devices
    assert device.memory_mib == 0
    assert "publishes no local-memory size" in device.extra["unavailable"]["memory"]


def test_gpu_bound_to_another_driver_is_a_note(tmp_path: Path) -> None:
    root = write_tree(tmp_path, [{"card": "card0", "pci": "0000:03:00.0",
                                  "device_id": "0x56a0", "driver": "simpledrm"}])
    result = IntelSysfsProbe(root, kernel_release="6.8").probe()
    assert not result.verdict.available
    assert "bound to simpledrm, not i915/xe" in result.verdict.reason


def test_only_an_integrated_gpu(tmp_path: Path, cards: list[dict]) -> None:
    root = write_tree(tmp_path, cards[:1])
    result = IntelSysfsProbe(root, kernel_release="6.8").probe()
    assert not result.verdict.available
    assert "integrated GPU without local memory" in result.verdict.reason


def test_no_intel_gpu_or_no_sysfs(tmp_path: Path) -> None:
    result = IntelSysfsProbe(tmp_path / "nothing").probe()
    assert not result.verdict.available
    assert result.verdict.reason == "no Intel GPU in /sys/class/drm"
    nvidia = tmp_path / "sys"
    device = nvidia / "devices" / "0000:07:00.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x10de\n")
    (nvidia / "class" / "drm" / "card0").mkdir(parents=True)
    (nvidia / "class" / "drm" / "card0" / "device").symlink_to(device)
    assert not IntelSysfsProbe(nvidia).probe().verdict.available


def test_this_host_never_raises() -> None:
    result = IntelSysfsProbe().probe()
    assert result.verdict.vendor == "intel"
    assert isinstance(result.verdict.reason, str) and result.verdict.reason


def test_render_node_of_each_card(tmp_path: Path, cards: list[dict]) -> None:
    root = write_tree(tmp_path, cards)
    for pci, render in (("0000:03:00.0", "renderD129"), ("0000:3a:00.0", "renderD130")):
        drm = root / "devices" / "pci0000:00" / pci / "drm"
        (drm / render).mkdir(parents=True)
        (drm / f"card{render[-1]}").mkdir()  # the display node is not what compute opens
    arc, pvc = IntelSysfsProbe(root, kernel_release="6.8").probe().devices
    assert (arc.device_nodes, pvc.device_nodes) == (("/dev/dri/renderD129",), ("/dev/dri/renderD130",))

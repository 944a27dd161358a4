"""Intel GPUs from sysfs: no compute runtime, no Level Zero needed.

/sys/class/drm/cardN/device is the PCI device: its vendor (0x8086), device id, bound
driver (i915 or xe) and, where the driver publishes it, the size of local memory. The
architecture comes from a small PCI-id table. Integrated GPUs that are not in the table
are skipped: they share system memory and torch's xpu backend does not drive most of
them, so offering one would beat the CPU fallback with a device that cannot run a job.

ZE_AFFINITY_MASK takes Level Zero ordinals, not UUIDs, so `visible_id` is the ordinal
among the host's Intel GPUs bound to i915/xe in PCI bus order (Level Zero's order with
ZE_ENABLE_PCI_ID_DEVICE_ORDER=1, one device per card with ZE_FLAT_DEVICE_HIERARCHY=
COMPOSITE).
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from pathlib import Path

from brokerd.devices.model import Device, ProbeResult, ProbeVerdict
from brokerd.devices.probes.base import unavailable
from brokerd.devices.probes.drm import render_nodes

MIB = 1024 * 1024
INTEL_VENDOR = "0x8086"
_DRIVERS = ("i915", "xe")


@dataclass(frozen=True)
class IntelModel:
    name: str
    arch: str
    memory_bandwidth_gbps: float  # from Intel's product spec sheets; 0 = not known


# PCI device id -> model, names as in the pci.ids database, bandwidth from
# ark.intel.com / the Data Center GPU Max and Flex product briefs.
MODELS: dict[int, IntelModel] = {
    0x56A0: IntelModel("Intel Arc A770", "Xe_HPG", 560.0),
    0x56A1: IntelModel("Intel Arc A750", "Xe_HPG", 512.0),
    0x56A2: IntelModel("Intel Arc A580", "Xe_HPG", 512.0),
    0x56A5: IntelModel("Intel Arc A380", "Xe_HPG", 186.0),
    0x56A6: IntelModel("Intel Arc A310", "Xe_HPG", 124.0),
    0x5690: IntelModel("Intel Arc A770M", "Xe_HPG", 512.0),
    0x5691: IntelModel("Intel Arc A730M", "Xe_HPG", 336.0),
    0x5692: IntelModel("Intel Arc A550M", "Xe_HPG", 224.0),
    0x56C0: IntelModel("Intel Data Center GPU Flex 170", "Xe_HPG", 576.0),
    0x56C1: IntelModel("Intel Data Center GPU Flex 140", "Xe_HPG", 0.0),
    0x0BD5: IntelModel("Intel Data Center GPU Max 1550", "Xe_HPC", 3276.8),
    0x0BD6: IntelModel("Intel Data Center GPU Max 1550", "Xe_HPC", 3276.8),
    0x0BD7: IntelModel("Intel Data Center GPU Max 1350", "Xe_HPC", 2457.6),
    0x0BD8: IntelModel("Intel Data Center GPU Max 1350", "Xe_HPC", 2457.6),
    0x0BD9: IntelModel("Intel Data Center GPU Max 1100", "Xe_HPC", 1228.8),
    0x0BDA: IntelModel("Intel Data Center GPU Max 1100", "Xe_HPC", 1228.8),
    0x0BDB: IntelModel("Intel Data Center GPU Max 1100", "Xe_HPC", 1228.8),
    0xE20B: IntelModel("Intel Arc B580", "Xe2_HPG", 456.0),
    0xE20C: IntelModel("Intel Arc B570", "Xe2_HPG", 380.0),
}

_CARD = re.compile(r"card\d+")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _int(text: str, base: int = 10) -> int | None:
    try:
        return int(text, base)
    except ValueError:
        return None


def _uevent(device: Path) -> dict[str, str]:
    pairs = (line.partition("=") for line in _read(device / "uevent").splitlines())
    return {k: v for k, sep, v in pairs if sep}


def local_memory_bytes(card: Path, device: Path) -> int | None:
    """Device-local memory as the driver publishes it, or None for none.

    i915 (Intel's DKMS backport, some kernels): cardN/lmem_total_bytes, or
    prelim_lmem_total_bytes. xe: device/tileN/physical_vram_size_bytes, per tile (a Max
    1550 has two)."""
    for path in (card / "lmem_total_bytes", card / "prelim_lmem_total_bytes",
                 device / "lmem_total_bytes"):
        value = _int(_read(path))
        if value:
            return value
    tiles = [_int(_read(t / "physical_vram_size_bytes")) for t in sorted(device.glob("tile*"))]
    total = sum(t for t in tiles if t)
    return total or None


@dataclass(frozen=True)
class _Card:
    name: str  # card0
    card: Path
    device: Path
    pci_address: str
    device_id: int
    driver: str


class IntelSysfsProbe:
    """Finds Intel discrete and data-center GPUs through sysfs."""

    vendor = "intel"

    def __init__(self, sysfs_root: Path = Path("/sys"), kernel_release: str | None = None) -> None:
        self.sysfs_root = Path(sysfs_root)
        # An in-tree driver has no version of its own: it is the kernel's.
        self.kernel_release = kernel_release if kernel_release is not None else platform.release()

    def _cards(self) -> list[_Card]:
        drm = self.sysfs_root / "class" / "drm"
        try:
            entries = sorted(drm.iterdir())
        except OSError:
            return []
        cards: dict[str, _Card] = {}
        for entry in entries:
            if not _CARD.fullmatch(entry.name):
                continue
            device = entry / "device"
            if _read(device / "vendor").lower() != INTEL_VENDOR:
                continue
            uevent = _uevent(device)
            address = (uevent.get("PCI_SLOT_NAME") or device.resolve().name).lower()
            device_id = _int(_read(device / "device"), 16)
            if device_id is None or address in cards:
                continue
            driver = uevent.get("DRIVER") or (device / "driver").resolve().name
            cards[address] = _Card(entry.name, entry, device, address, device_id, driver)
        return sorted(cards.values(), key=lambda c: c.pci_address)

    def _driver_version(self, driver: str) -> str:
        return _read(self.sysfs_root / "module" / driver / "version") or self.kernel_release

    def probe(self) -> ProbeResult:
        cards = self._cards()
        if not cards:
            return unavailable(self.vendor, "no Intel GPU in /sys/class/drm")
        devices: list[Device] = []
        notes: list[str] = []
        ordinal = 0
        for card in cards:
            if card.driver not in _DRIVERS:
                notes.append(f"{card.pci_address} (8086:{card.device_id:04x}) is bound to "
                             f"{card.driver or 'no driver'}, not i915/xe")
                continue
            visible = str(ordinal)
            ordinal += 1
            device = self._device(card, visible)
            if device is None:
                notes.append(f"skipped {card.pci_address} (8086:{card.device_id:04x}): "
                             "an integrated GPU without local memory")
                continue
            devices.append(device)
        if not devices:
            return unavailable(self.vendor, "; ".join(notes) or "no usable Intel GPU")
        summary = f"{len(devices)} Intel GPU(s) from sysfs (no per-process usage without " \
                  "Level Zero)"
        return ProbeResult(ProbeVerdict(self.vendor, True, "; ".join([summary, *notes])),
                           tuple(devices))

    def _device(self, card: _Card, visible: str) -> Device | None:
        model = MODELS.get(card.device_id)
        memory = local_memory_bytes(card.card, card.device)
        if model is None and memory is None:
            return None
        extra: dict[str, object] = {"driver": card.driver, "drm_card": card.name,
                                    "pci_device_id": f"0x{card.device_id:04x}"}
        tiles = len(list(card.device.glob("tile*")))
        if tiles:
            extra["tiles"] = tiles
        if memory is None:
            extra["unavailable"] = {"memory": f"{card.driver} publishes no local-memory size "
                                              "in sysfs"}
        numa = _int(_read(card.device / "numa_node"))
        return Device(
            index=int(visible),
            uuid=f"XPU-{card.pci_address}",
            vendor="intel",
            name=model.name if model else f"Intel GPU 8086:{card.device_id:04x}",
            memory_mib=(memory or 0) // MIB,
            backend="xpu",
            arch=model.arch if model else "",
            compute_capability=model.arch if model else "",
            pci_bus_id=card.pci_address,
            driver_version=self._driver_version(card.driver),
            memory_bandwidth_gbps=model.memory_bandwidth_gbps if model else 0.0,
            numa_node=numa if numa is not None else -1,
            visible_id=visible,
            device_nodes=render_nodes(card.device),
            extra=extra,
        )

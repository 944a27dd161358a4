"""The daemon's vendor-neutral picture of the host: devices, GPU processes, probe verdicts.

Probes produce these; everything after the probes (contract, policy, leases, status)
reads only these types and never a vendor library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The Device.extra key under which the vendor probes that measure it put the percent busy.
UTILISATION_KEY = "utilization_gpu_pct"


@dataclass(frozen=True)
class Device:
    """One leasable device. `uuid` is its identity across probes and restarts."""

    index: int
    uuid: str
    vendor: str  # one of brokerd.devices.vendors.DEVICE_VENDORS
    name: str
    memory_mib: int
    backend: str  # the torch backend that drives it: set by the probe that found it
    arch: str = ""  # normalised architecture, as the vendor table spells it, or cpu
    compute_capability: str = ""  # the vendor's own spelling ("8.0" for a dotted numbering)
    pci_bus_id: str = ""
    driver_version: str = ""
    runtime_version: str = ""  # highest device runtime the driver supports, when known
    memory_bandwidth_gbps: float = 0.0
    memory_used_mib: int = 0
    numa_node: int = -1
    interconnect_group: str = ""
    healthy: bool = True
    health_reason: str = ""
    simulated: bool = False
    # The id the backend's visible-devices variable takes; "" means the uuid. Probes set
    # the per-vendor ordinal where the runtime accepts no UUID.
    visible_id: str = ""
    # The per-device nodes a process opens to use it (not the shared control nodes):
    # what `[enforce] mode = "acl"` opens for the lease holder only (brokerd/addons/enforce/).
    device_nodes: tuple[str, ...] = ()
    # A MIG instance (a slice of a GPU in MIG mode, leased like a device): its number under
    # its GPU (`index` is then the GPU's), the GPU's uuid, its profile ("1g.18gb"). -1/"": a whole GPU.
    mig_index: int = -1
    parent_uuid: str = ""
    mig_profile: str = ""
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    @property
    def visible(self) -> str:
        return self.visible_id or self.uuid

    @property
    def label(self) -> str:
        """How people name it: gpu0, or gpu0.1 for instance 1 of GPU 0."""
        return f"gpu{self.index}" if self.mig_index < 0 else f"gpu{self.index}.{self.mig_index}"


@dataclass(frozen=True)
class GpuProcess:
    """A process the management library sees using a device's memory or compute."""

    pid: int
    device_uuid: str
    used_memory_mib: int = 0
    uid: int = -1  # filled in from /proc by the inventory, -1 when unknown
    user: str = ""
    command: str = ""


@dataclass(frozen=True)
class ProbeVerdict:
    """Whether one vendor's probe found anything, and in plain words why not."""

    vendor: str
    available: bool
    reason: str


@dataclass(frozen=True)
class ProbeResult:
    verdict: ProbeVerdict
    devices: tuple[Device, ...] = ()
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """Everything one inventory refresh found."""

    devices: tuple[Device, ...]
    processes: tuple[GpuProcess, ...] = ()
    verdicts: tuple[ProbeVerdict, ...] = ()
    simulated: bool = False

    def by_uuid(self) -> dict[str, Device]:
        return {d.uuid: d for d in self.devices}

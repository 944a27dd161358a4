"""A GPU in MIG mode, through NVML's MIG device handles: its instances are what is leased.

With MIG on, a GPU is cut into instances (GPU instance + compute instance), each with its
own memory and compute slices and its own UUID (`MIG-...`), which CUDA_VISIBLE_DEVICES
takes; the GPU's own UUID then gives a process no usable device. So the broker offers the
instances, each as a device of its own (gpu0.0, gpu0.1, ...): the GPU's facts (compute
capability, driver, health: an ECC error on the GPU is every instance's), the instance's
memory, profile ("1g.18gb", from the name NVML gives the instance), and its processes.

The broker never changes MIG mode or the layout (`nvidia-smi mig` is the admin's): it
reads what is there at every probe, so an instance destroyed meanwhile is a device that
vanished (its lease ends as lost) and one created is a new device.

Enforcement nodes: a process needs the GPU's /dev/nvidia<minor> and, where the driver
exposes MIG access through device nodes (/proc/driver/nvidia-caps/mig-minors lists them),
/dev/nvidia-caps/nvidia-cap<N> for its GPU instance and its compute instance. Those two
are the instance's own: the gate opens them for its holder only, and the GPU's node for
the holders of every instance on it.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from brokerd.devices.model import Device, GpuProcess
from brokerd.devices.probes.base import FieldReader, Unavailable

MIB = 1024 * 1024
MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")
CAPS_DIR = "/dev/nvidia-caps"
_NOT_FOUND = 6  # NVML_ERROR_NOT_FOUND: no instance at that slot
_CAP_LINE = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access\s+(\d+)$")


def cap_minors(path: Path = MIG_MINORS) -> dict[tuple[int, int, int | None], int]:
    """(GPU minor, GPU instance, compute instance or None) -> the nvidia-cap node's minor;
    empty where the driver does not use cap nodes (or the file cannot be read)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    found: dict[tuple[int, int, int | None], int] = {}
    for line in text.splitlines():
        match = _CAP_LINE.match(line.strip())
        if match:
            gpu, gi, ci, minor = match.groups()
            found[(int(gpu), int(gi), int(ci) if ci is not None else None)] = int(minor)
    return found


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def instances(r: FieldReader, parent: Device, handle: Any, minor: int | None,
              caps: dict[tuple[int, int, int | None], int]) -> tuple[list[Device], list[GpuProcess], str]:
    """The instances of `parent` (a GPU in MIG mode, read through `r`) and their
    processes, with a note when there are none to lease."""
    count = r.call("nvmlDeviceGetMaxMigDeviceCount", handle)
    if isinstance(count, Unavailable):
        return [], [], f"GPU {parent.index} is in MIG mode but its instances cannot be read ({count.reason})"
    devices: list[Device] = []
    processes: list[GpuProcess] = []
    for slot in range(count):
        mig = r.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
        if isinstance(mig, Unavailable):
            continue  # no instance in this slot (NOT_FOUND), or one going away
        uuid = r.call("nvmlDeviceGetUUID", mig)
        memory = r.call("nvmlDeviceGetMemoryInfo", mig)
        if isinstance(uuid, Unavailable) or isinstance(memory, Unavailable):
            continue  # destroyed between two calls: gone at the next probe anyway
        name = r.call("nvmlDeviceGetName", mig)
        name = _text(name) if not isinstance(name, Unavailable) else f"{parent.name} MIG"
        profile = name.rsplit(" MIG ", 1)[1] if " MIG " in name else ""
        device = replace(
            parent, uuid=_text(uuid), name=name, memory_mib=memory.total // MIB, memory_used_mib=memory.used // MIB,
            mig_index=len(devices), parent_uuid=parent.uuid, mig_profile=profile,
            device_nodes=_nodes(r, mig, minor, caps), extra={**parent.extra, "mig_slot": slot},
        )
        devices.append(device)
        processes += _processes(r, mig, device.uuid)
    note = "" if devices else (f"GPU {parent.index} is in MIG mode with no instance: nothing to lease there "
                               "(create instances with `nvidia-smi mig -cgi ... -C`)")
    return devices, processes, note


def _nodes(r: FieldReader, mig: Any, minor: int | None, caps: dict[tuple[int, int, int | None], int]
           ) -> tuple[str, ...]:
    if minor is None:
        return ()  # the GPU's node is unknown: enforcement then holds the instance back
    gpu_node = f"/dev/nvidia{minor}"
    gi = r.call("nvmlDeviceGetGpuInstanceId", mig)
    ci = r.call("nvmlDeviceGetComputeInstanceId", mig)
    if isinstance(gi, Unavailable) or isinstance(ci, Unavailable):
        return (gpu_node,)
    own = [caps.get((minor, gi, None)), caps.get((minor, gi, ci))]
    return (gpu_node, *(f"{CAPS_DIR}/nvidia-cap{n}" for n in own if n is not None))


def _processes(r: FieldReader, mig: Any, uuid: str) -> list[GpuProcess]:
    procs = r.call("nvmlDeviceGetComputeRunningProcesses", mig)
    if isinstance(procs, Unavailable):
        return []
    found: dict[int, int] = {}
    for p in procs:
        found[p.pid] = found.get(p.pid, 0) + (p.usedGpuMemory or 0) // MIB
    return [GpuProcess(pid=pid, device_uuid=uuid, used_memory_mib=mib) for pid, mib in found.items()]

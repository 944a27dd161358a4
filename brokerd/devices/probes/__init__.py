"""Device probes: the only place in the daemon that knows vendor libraries.

`default_probes()` lists the real probes in the order they are tried; each answers
with devices or with a plain-words reason why it found none. Importing this package
loads no vendor library: each probe imports its library inside `probe()`.
"""

from __future__ import annotations

import os

from brokerd.devices.model import Device, ProbeResult, ProbeVerdict, Snapshot
from brokerd.devices.probes.base import Probe
from brokerd.devices.probes.cpu import CpuProbe

# Device nodes that mean "a GPU driver is loaded here" (NVIDIA control device, AMD KFD).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


CPU_NOT_OFFERED = ("no GPU found, and the CPU is not offered as a device ([probe] offer_cpu = true leases the "
                   "whole CPU to one job at a time: for a laptop or a CI runner, not a shared server)")


def default_probes() -> list[Probe]:
    """The real probes, GPUs first. The CPU pseudo-device is added by `run_probes` only
    when no GPU probe found a device and the configuration asks for it."""
    from brokerd.devices.probes.amd import AmdSmiProbe
    from brokerd.devices.probes.intel import IntelSysfsProbe
    from brokerd.devices.probes.nvidia import NvmlProbe

    return [NvmlProbe(), AmdSmiProbe(), IntelSysfsProbe()]


def run_probes(probes: list[Probe], *, cpu_fallback: bool = True) -> Snapshot:
    """Run each probe (blocking) and merge the results into one snapshot with
    host-wide device indexes."""
    devices: list[Device] = []
    processes = []
    verdicts: list[ProbeVerdict] = []
    for probe in probes:
        result: ProbeResult = probe.probe()
        verdicts.append(result.verdict)
        devices.extend(result.devices)
        processes.extend(result.processes)
    if not cpu_fallback and not devices:
        verdicts.append(ProbeVerdict("cpu", False, CPU_NOT_OFFERED))
    if cpu_fallback and not devices:
        nodes = [path for path in GPU_DEVICE_NODES if os.path.exists(path)]
        if nodes:
            # GPUs are plugged in but their probe failed (driver/library mismatch after an
            # upgrade, permissions): offering "the CPU" here would hand out leases while
            # every job could still see and grab the GPUs. Fail closed and say why.
            reason = f"not offering the CPU: {', '.join(nodes)} exist but no GPU probe succeeded"
            verdicts.append(ProbeVerdict("cpu", False, reason))
        else:
            cpu = CpuProbe().probe()
            verdicts.append(cpu.verdict)
            devices.extend(cpu.devices)
    renumbered = _renumbered(devices)
    simulated = any(d.simulated for d in renumbered)
    return Snapshot(renumbered, tuple(processes), tuple(verdicts), simulated)


def _renumbered(devices: list[Device]) -> tuple[Device, ...]:
    """Host-wide indexes, one per GPU: the MIG instances of one GPU share its index (they
    are gpu0.0, gpu0.1, ...; Device.label)."""
    out: list[Device] = []
    gpus: dict[str, int] = {}
    for device in devices:
        key = device.parent_uuid if device.mig_index >= 0 else device.uuid
        index = gpus.setdefault(key, len(gpus))
        out.append(_with_index(device, index))
    return tuple(out)


def _with_index(device: Device, index: int) -> Device:
    from dataclasses import replace

    return device if device.index == index else replace(device, index=index)

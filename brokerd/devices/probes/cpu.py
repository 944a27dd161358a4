"""The CPU pseudo-device, offered when no GPU probe found anything, so `vaccel run` works on a laptop."""

from __future__ import annotations

import os
import platform

from brokerd.devices.model import Device, ProbeResult, ProbeVerdict


def _memory_mib() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


class CpuProbe:
    vendor = "cpu"

    def probe(self) -> ProbeResult:
        name = platform.processor() or platform.machine() or "cpu"
        device = Device(
            index=0,
            uuid="CPU-0",
            vendor="cpu",
            name=f"CPU ({os.cpu_count()} cores, {name})",
            memory_mib=_memory_mib(),
            backend="cpu",
            arch="cpu",
        )
        verdict = ProbeVerdict("cpu", True, "no GPU found; offering the CPU as one device")
        return ProbeResult(verdict=verdict, devices=(device,))

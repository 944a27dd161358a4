"""Device memory under a lease: the per-process cap, out-of-memory errors that name it,
and a small snapshot of allocator statistics."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

log = logging.getLogger("vaccel.accelerator")

MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryCap:
    """The lease's cap for this process. `fraction` and `total_mib` are set once the cap
    is enforced on a real device; on the CPU the cap is recorded but not enforceable."""

    lease_id: str
    cap_mib: int
    fraction: float | None = None
    total_mib: int | None = None

    def describe(self) -> str:
        if self.fraction is None:
            return f"lease {self.lease_id} caps this process at {self.cap_mib} MiB of device memory"
        return (
            f"lease {self.lease_id} caps this process at {self.cap_mib} MiB of device memory "
            f"({self.fraction:.1%} of {self.total_mib} MiB)"
        )


@dataclass(frozen=True)
class MemoryStats:
    """Allocator statistics for the accelerator's device, in bytes. None where the device
    keeps no such statistic (the CPU keeps none)."""

    device: str
    allocated_bytes: int | None
    reserved_bytes: int | None
    max_allocated_bytes: int | None
    max_reserved_bytes: int | None
    total_bytes: int | None
    cap_mib: int | None


def apply_cap(cap: MemoryCap, device: torch.device) -> MemoryCap:
    """Limit this process's allocator on `device` to the cap; returns the cap as applied.

    Uses the device module's `set_per_process_memory_fraction` (torch has it for cuda,
    ROCm and xpu); a runtime without it gets a warning rather than a silent no-op."""
    index = device.index or 0
    _, total = torch.accelerator.get_memory_info(index)
    fraction = min(1.0, cap.cap_mib * MIB / total)
    module = torch.get_device_module(device.type)
    set_fraction = getattr(module, "set_per_process_memory_fraction", None)
    if set_fraction is None:
        log.warning(
            "vaccel: %s but torch cannot limit %s memory per process; the cap is not enforced",
            cap.describe(), device.type,
        )
        return cap
    set_fraction(fraction, index)
    applied = MemoryCap(cap.lease_id, cap.cap_mib, fraction, total // MIB)
    log.info("vaccel: %s; memory fraction set on %s", applied.describe(), device)
    return applied


@contextmanager
def naming_cap(cap: MemoryCap | None) -> Iterator[None]:
    """Re-raise torch's OutOfMemoryError with the lease's cap in the message."""
    if cap is None:
        yield
        return
    try:
        yield
    except torch.OutOfMemoryError as err:
        raise torch.OutOfMemoryError(
            f"{cap.describe()} and this allocation does not fit: {err}\n"
            "Lower the batch size, enable AMP (float16 or bfloat16), or request a lease "
            "with more memory (--min-memory)."
        ) from err


def stats(device: torch.device, cap: MemoryCap | None) -> MemoryStats:
    cap_mib = cap.cap_mib if cap else None
    if device.type == "cpu":
        return MemoryStats("cpu", None, None, None, None, None, cap_mib)
    index = device.index or 0
    raw = torch.accelerator.memory_stats(index)
    _, total = torch.accelerator.get_memory_info(index)
    return MemoryStats(
        device=str(device),
        allocated_bytes=int(raw.get("allocated_bytes.all.current", 0)),
        reserved_bytes=int(raw.get("reserved_bytes.all.current", 0)),
        max_allocated_bytes=int(raw.get("allocated_bytes.all.peak", 0)),
        max_reserved_bytes=int(raw.get("reserved_bytes.all.peak", 0)),
        total_bytes=int(total),
        cap_mib=cap_mib,
    )

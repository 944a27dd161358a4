"""Check lines for accelerator-config.yaml's settings that the lease applies rather than
filters on: the memory section (pool size, unified memory) and amp_config.

The memory section belongs to one backend (the backend table's `memory_section`): on its
devices `vaccel check` says what the lease will set, and refuses a pool larger than the
device; on any other device it says the section does not apply (INFO, never an error:
one config serves every host).
"""

from __future__ import annotations

from brokerd.contract.accel_config import AcceleratorConfig
from brokerd.contract.model import CheckLine
from brokerd.devices.model import Device
from brokerd.devices.vendors import MEMORY_POOL_SECTION, UNIFIED_MEMORY_ARCHS
from vaccel_common.backends import BACKENDS
from vaccel_common.units import format_mib

MEMORY_POOL = "Memory pool"
UNIFIED_MEMORY = "Unified memory"
AMP = "AMP"
CAP_VAR = "VACCEL_MEMORY_CAP_MIB"

# The backend the memory section's settings are for.
SECTION_BACKEND = next((b for b in BACKENDS.values() if b.memory_section == MEMORY_POOL_SECTION),
                       None)


def memory_section_lines(device: Device, name: str, config: AcceleratorConfig) -> list[CheckLine]:
    """What the memory section means for one device: what the lease sets, or not applicable."""
    pool, unified = config.memory_pool_size_mb, config.use_unified_memory
    if not pool and unified is None:
        return []
    given = [k for k, present in (("memory_pool_size_mb", bool(pool)),
                                  ("use_unified_memory", unified is not None)) if present]
    if SECTION_BACKEND is None or device.backend != SECTION_BACKEND.name:
        applies = SECTION_BACKEND.name if SECTION_BACKEND else "no"
        return [CheckLine("INFO", MEMORY_POOL_SECTION, f"not applicable to {device.backend} "
                          f"({name}): {' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to "
                          f"{applies} leases only",
                          device.uuid)]
    lines: list[CheckLine] = []
    if pool:
        if pool > device.memory_mib:
            lines.append(CheckLine(
                "ERROR", MEMORY_POOL, f"memory_pool_size_mb {pool} exceeds the "
                f"{format_mib(device.memory_mib)} of {name}", device.uuid,
                f"lower {MEMORY_POOL_SECTION}.memory_pool_size_mb to at most "
                f"{device.memory_mib}, or run on a device with more memory"))
        else:
            share = pool / device.memory_mib
            lines.append(CheckLine(
                "OK", MEMORY_POOL, f"{format_mib(pool)} of {format_mib(device.memory_mib)} "
                f"({name}): {CAP_VAR}={pool}, the caching allocator's limit "
                f"(per-process memory fraction {share:.1%}); {SECTION_BACKEND.allocator_var} "
                "stays the host's allocator setting", device.uuid))
    if unified:
        setting = " ".join(f"{k}={v}" for k, v in SECTION_BACKEND.unified_memory_env)
        if device.arch in UNIFIED_MEMORY_ARCHS:
            lines.append(CheckLine("OK", UNIFIED_MEMORY, f"{setting} ({name}, {device.arch}): "
                                   "managed and host memory page on demand", device.uuid))
        else:
            arch = device.arch or "unknown architecture"
            lines.append(CheckLine(
                "WARN", UNIFIED_MEMORY, f"{setting} is set, but {name} ({arch}) is not known "
                "to page on demand; allocations may fail or copy",
                device.uuid, f"set use_unified_memory: false in {config.name}"))
    elif unified is False:
        setting = ", ".join(k for k, _ in SECTION_BACKEND.unified_memory_env)
        lines.append(CheckLine("OK", UNIFIED_MEMORY, f"off ({setting} left as the host sets it; "
                               f"{name})", device.uuid))
    return lines


def amp_line(config: AcceleratorConfig) -> CheckLine:
    """What amp_config makes the accelerator do: torch.amp autocast and the GradScaler."""
    if config.amp_dtype == "none":
        return CheckLine("OK", AMP, f"off: full precision ({config.name})")
    scaler = config.amp_dtype == "float16" and config.grad_scaler is not False
    why = "" if scaler or config.amp_dtype != "float16" else " (grad_scaler: false)"
    return CheckLine("OK", AMP, f"native torch.amp autocast {config.amp_dtype}, GradScaler "
                     f"{'on' if scaler else 'off'}{why} ({config.name})")

"""Per-device checks of a requirement. (Minimal core version: count and memory.)"""

from __future__ import annotations

from collections.abc import Sequence

from brokerd.contract import CheckLine, Evaluation, Requirement
from brokerd.devices import Device
from vaccel.units import format_mib


def evaluate_devices(requirement: Requirement, devices: Sequence[Device]) -> Evaluation:
    per_device: dict[str, tuple[CheckLine, ...]] = {}
    eligible: list[str] = []
    for d in devices:
        if d.memory_mib >= requirement.min_memory_mib:
            line = CheckLine("OK", "memory", f"{format_mib(d.memory_mib)} ({d.name})", d.uuid)
            eligible.append(d.uuid)
        else:
            line = CheckLine(
                "ERROR", "memory",
                f"needs {format_mib(requirement.min_memory_mib)}, {d.name} has "
                f"{format_mib(d.memory_mib)}", d.uuid,
            )
        per_device[d.uuid] = (line,)
    satisfiable = len(eligible) >= requirement.gpus
    reason = ""
    if not satisfiable:
        reason = (
            f"asks for {requirement.gpus} device(s) with at least "
            f"{format_mib(requirement.min_memory_mib)}; this host has {len(eligible)} such "
            f"of {len(devices)}"
        )
    return Evaluation(tuple(eligible), per_device, satisfiable=satisfiable, reason=reason)

"""Device selection among free eligible devices. (Minimal core version: best fit, LRU.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from brokerd.contract import Requirement
from brokerd.devices import Device


def select_devices(
    requirement: Requirement, free: Sequence[Device], last_used: Mapping[str, float]
) -> list[Device] | None:
    if len(free) < requirement.gpus:
        return None
    ranked = sorted(free, key=lambda d: (d.memory_mib, last_used.get(d.uuid, 0.0), d.index))
    return ranked[: requirement.gpus]

"""The client's torch accelerator: train on whatever device a lease brings.

    from vaccel.accelerator import Accelerator
    acc = Accelerator()                       # reads the lease's environment
    model, opt, loader = acc.prepare(model, opt, loader)

Importing this package does not import torch (the lease asks `runtime_state` before
torch may even be installed); the names below load their modules on first use.

The lowest layer of the client: may import torch and vaccel_common, nothing else of vaccel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vaccel.accelerator.amp import AmpPolicy
    from vaccel.accelerator.core import Accelerator
    from vaccel.accelerator.memory import MemoryStats
    from vaccel.accelerator.notices import NoLeaseWarning, SimulatedDevicesWarning
    from vaccel.accelerator.runtime_state import initialised_runtime

__all__ = [
    "Accelerator",
    "AmpPolicy",
    "MemoryStats",
    "NoLeaseWarning",
    "SimulatedDevicesWarning",
    "initialised_runtime",
]

_HOMES = {
    "Accelerator": "core",
    "NoLeaseWarning": "notices",
    "SimulatedDevicesWarning": "notices",
    "AmpPolicy": "amp",
    "MemoryStats": "memory",
    "initialised_runtime": "runtime_state",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{home}"), name)

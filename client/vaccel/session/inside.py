"""A process that runs inside a lease asks that lease, not the broker's queue.

Inside a lease (VACCEL_LEASE_ID is set: `vaccel shell`, a reservation's exported variables,
a command of `vaccel run`), `lease()` joins it; so does a nested `vaccel run` that asks for
no more than the lease holds. Asking the broker again instead would take a second lease
beside the first (hiding the reserved device), or queue behind one's own limit until the
first lease ended. A request for more than the lease holds is refused at once, saying what
it asks for that the lease lacks and how to ask outside it.

What a nested `vaccel run` gets of the lease it joins:
- no --gpus and no --device: the whole lease, as every other process in it;
- --gpus N: the lease's N lowest-indexed devices (device 0 is the lowest, as in any lease);
- --device gpu1 ...: those devices, each of which must be in the lease;
- --min-memory: each device it gets must have that much;
- --time: the lease must last that long (its end is the command's end too).
A contract is not checked again: the lease's devices met the one it was granted with.
"""

from __future__ import annotations

import time

from vaccel.session.lease import LeaseError, ended_reason
from vaccel_common.units import format_duration, format_mib
from vaccel_common.v1 import broker_pb2 as pb

OUTSIDE_HINT = "or run it outside the lease: env -u VACCEL_LEASE_ID vaccel run ..."


def _label(d: pb.Device) -> str:
    return d.label or f"gpu{d.index}"


def _names(devices: list[pb.Device]) -> str:
    return ", ".join(_label(d) for d in devices) or "no device"


def _named(devices: list[pb.Device], name: str) -> pb.Device | None:
    wanted = name.strip().lower()
    for d in devices:
        label = _label(d).lower()
        if wanted in (d.uuid.lower(), label, label.removeprefix("gpu")):
            return d
    return None


def part_asked(held: pb.Lease, *, gpus: int, whole: bool, devices: tuple[str, ...] = (), min_memory_mib: int = 0,
               time_limit_s: float = 0.0, source: str = "VACCEL_LEASE_ID") -> pb.Lease:
    """`held` with only the devices the request asks for, by index; LeaseError when it asks
    for more than the lease holds. `whole`: no count was asked for (the whole lease)."""
    mine = sorted(held.devices, key=lambda d: d.index)

    def refuse(what: str) -> LeaseError:
        return LeaseError(f"this runs inside lease {held.id} ({source}), which holds {_names(mine)}: {what}; "
                          f"ask for no more, {OUTSIDE_HINT}", "failed_precondition")

    if devices:
        chosen = []
        for name in devices:
            device = _named(mine, name)
            if device is None:
                raise refuse(f"--device {name} is not in it")
            chosen.append(device)
        chosen.sort(key=lambda d: d.index)
    elif whole:
        chosen = mine
    elif gpus > len(mine):
        raise refuse(f"--gpus {gpus} asks for more")
    else:
        chosen = mine[:gpus]
    small = [d for d in chosen if min_memory_mib and d.memory_mib < min_memory_mib]
    if small:
        raise refuse(f"--min-memory {format_mib(min_memory_mib)} is more than {_label(small[0])} has "
                     f"({format_mib(small[0].memory_mib)})")
    left = held.expires_at - time.time() if held.expires_at else 0.0
    if time_limit_s and held.expires_at and time_limit_s > left:
        raise refuse(f"--time {format_duration(time_limit_s)} is longer than it lasts (it ends in "
                     f"{format_duration(max(0.0, left))})")
    part = pb.Lease()
    part.CopyFrom(held)
    del part.devices[:]
    part.devices.extend(chosen)
    return part


def join_refusal(lease_id: str, details: str, source: str) -> str:
    """The broker's refusal to join, said once (it names the lease itself) and, for a lease
    inherited through the environment, with where it came from and the way out."""
    ended = ended_reason(lease_id, details)
    if ended != details:
        said = f"lease {lease_id} has ended: {ended}"
    else:
        said = details if lease_id in details else f"lease {lease_id}: {details}"
    if source == "--lease":
        return said
    return f"{said}; this process runs inside it ({source}): leave that shell, {OUTSIDE_HINT}"

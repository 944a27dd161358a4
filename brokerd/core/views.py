"""Plain read-only pictures of the broker's state, and lookups in it, for whoever shows
them (the servicer turns them into messages). Built from the lease manager; nothing here
changes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from brokerd.base.process import Holder
from brokerd.contract import Evaluation
from brokerd.devices.model import Device, GpuProcess, ProbeVerdict
from brokerd.leasing.errors import NotFound, Unsatisfiable
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Lease, Request


@dataclass(frozen=True)
class DeviceView:
    """A device, its state, and the lease that holds it."""

    device: Device
    state: str  # free | leased | drained | busy | unhealthy | missing
    lease: Lease | None  # the active lease holding it
    drain_reason: str = ""


@dataclass(frozen=True)
class StatusView:
    """What `vaccel status` shows."""

    devices: tuple[DeviceView, ...]  # by index
    queue: tuple[Request, ...]  # first in line first
    unleased_processes: tuple[GpuProcess, ...]
    probes: tuple[ProbeVerdict, ...]
    simulated: bool
    usage: tuple[UsageView, ...] = ()  # each user with leases or requests, against their limits
    outside: OutsideStatus | None = None  # what an outside allocator holds and queues (brokerd/core/plugins.py)


@dataclass(frozen=True)
class UsageView:
    """One user's use against the limits that apply to them (`vaccel status`)."""

    user: str
    uid: int
    policy: str
    devices_held: int
    max_devices: int
    waiting: int
    max_waiting: int
    device_hours: float  # in the window
    max_device_hours: float
    window_s: float
    fair_usage: float  # decayed device-hours: the fair queue serves the least first


@dataclass(frozen=True)
class OutsideHold:
    """A device held outside vaccel's leases, by something the allocator knows (a batch job)."""

    device_uuid: str
    lease_id: str  # how people refer to it ("slurm-42")
    user: str
    uid: int
    label: str  # who holds it, in words ("slurm job 42 (alice)")
    since: float


@dataclass(frozen=True)
class OutsideWait:
    """A request waiting with the allocator: one of vaccel's (`requester` set) or another's."""

    request_id: str
    job_id: int
    gpus: int
    since: float
    reason: str
    user: str
    uid: int
    label: str  # who asks, in words, when it is not one of vaccel's requests
    requester: Holder | None = None
    time_limit_s: float = 0.0


@dataclass(frozen=True)
class OutsideStatus:
    """What the allocator adds to `vaccel status`."""

    mode: str
    holds: tuple[OutsideHold, ...] = ()
    waiting: tuple[OutsideWait, ...] = ()


@dataclass(frozen=True)
class CheckView:
    """What `vaccel check` shows: the verdict, device by device."""

    evaluation: Evaluation
    devices: tuple[DeviceView, ...]  # by index


def device_view(manager: LeaseManager, device: Device) -> DeviceView:
    """The device as it stands now."""
    lease_id = manager.owner.get(device.uuid)
    return DeviceView(device, manager.holdings.device_state(device.uuid),
                      manager.leases[lease_id] if lease_id else None, manager.drained.get(device.uuid, ""))


def device_views(manager: LeaseManager) -> tuple[DeviceView, ...]:
    """Every device as it stands now, by index."""
    return tuple(device_view(manager, d) for d in sorted(manager.devices.values(), key=lambda d: d.index))


def find_device(manager: LeaseManager, text: str) -> Device:
    """The device `text` names: its uuid, its index, or `gpu<index>` as `vaccel status` shows,
    in any case (GPU1, a uuid typed in lower case)."""
    wanted = text.strip().lower()
    for device in manager.devices.values():
        if wanted in (device.uuid.lower(), str(device.index), f"gpu{device.index}"):
            return device
    raise NotFound(f"no device {text!r} on this host: give its index (0, gpu0) or uuid (see `vaccel status`)")


def find_devices(manager: LeaseManager, names: tuple[str, ...]) -> tuple[str, ...]:
    """The uuids of the devices `names` name, each once: two names of one device (gpu1 and
    its uuid) are refused, or the request would ask for more devices than it names."""
    found: dict[str, str] = {}
    for name in names:
        uuid = find_device(manager, name).uuid
        if uuid in found:
            raise Unsatisfiable(f"{found[uuid]} and {name} name the same device: name each device once")
        found[uuid] = name
    return tuple(found)


def leases_of(manager: LeaseManager, uid: int | None, *, include_ended: bool) -> list[Lease]:
    """The leases of `uid` (None: everyone's), active and optionally recently ended, oldest
    grant first."""
    leases = list(manager.leases.values())
    if include_ended:
        leases += list(manager.ended.values())
    if uid is not None:
        leases = [lease for lease in leases if lease.holder.uid == uid]
    return sorted(leases, key=lambda lease: lease.granted_at)


def summary(manager: LeaseManager) -> str:
    """One line for `systemctl status`: "1/4 GPUs leased, 0 waiting, 0 unhealthy"."""
    devices = manager.devices
    unhealthy = sum(1 for d in devices.values() if not d.healthy)
    return (f"{len(manager.owner)}/{len(devices)} GPUs leased, {len(manager.queue)} waiting, "
            f"{unhealthy} unhealthy")

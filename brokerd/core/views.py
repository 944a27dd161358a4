"""Plain read-only pictures of the broker's state, and lookups in it, for whoever shows
them (the servicer turns them into messages). Built from the lease manager; nothing here
changes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from brokerd.base.process import Holder
from brokerd.contract import Evaluation
from brokerd.devices.model import Device, GpuProcess, ProbeVerdict
from brokerd.leasing.errors import NotFound, Unsatisfiable
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Lease, Request


@dataclass(frozen=True)
class ShareView:
    """A memory share on a shared device: whose, how much, and how much it uses now."""

    lease: Lease
    used_mib: int  # as the last probe read it


@dataclass(frozen=True)
class DeviceView:
    """A device, its state, and the lease that holds it (or the shares on it)."""

    device: Device
    state: str  # free | leased | shared | drained | busy | unhealthy | missing
    lease: Lease | None  # the active lease holding it whole
    drain_reason: str = ""
    sharing: str = "exclusive"  # exclusive | memory (leased by memory) | mig (a MIG instance, leased whole)
    shares: tuple[ShareView, ...] = ()


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


def device_view(manager: LeaseManager, device: Device, used: Mapping[str, int] | None = None) -> DeviceView:
    """The device as it stands now; `used`: MiB each lease uses (brokerd/core/budgets.py)."""
    holdings = manager.holdings
    lease_id = manager.owner.get(device.uuid)
    sharing = "memory" if device.uuid in holdings.shared else "mig" if device.mig_index >= 0 else "exclusive"
    shares = tuple(ShareView(manager.leases[i], (used or {}).get(i, 0)) for i in holdings.shares.get(device.uuid, ()))
    return DeviceView(device, holdings.device_state(device.uuid), manager.leases[lease_id] if lease_id else None,
                      manager.drained.get(device.uuid, ""), sharing, shares)


def device_views(manager: LeaseManager, used: Mapping[str, int] | None = None) -> tuple[DeviceView, ...]:
    """Every device as it stands now, by index (a GPU's MIG instances in order under it)."""
    ordered = sorted(manager.devices.values(), key=lambda d: (d.index, d.mig_index))
    return tuple(device_view(manager, d, used) for d in ordered)


def find_device(manager: LeaseManager, text: str) -> Device:
    """The device `text` names: its uuid, its index, or `gpu<index>` as `vaccel status` shows
    (gpu0.1, 0.1: instance 1 of GPU 0 in MIG mode), in any case (GPU1, a uuid typed in lower case)."""
    wanted = text.strip().lower()
    for device in manager.devices.values():
        label = device.label.lower()
        if wanted in (device.uuid.lower(), label, label.removeprefix("gpu")):
            return device
    raise NotFound(f"no device {text!r} on this host: give its index (0, gpu0, gpu0.1) or uuid (see `vaccel status`)")


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
    shared = len(manager.holdings.shares)
    return (f"{len(manager.owner)}/{len(devices)} GPUs leased{f', {shared} shared' if shared else ''}, "
            f"{len(manager.queue)} waiting, {unhealthy} unhealthy")

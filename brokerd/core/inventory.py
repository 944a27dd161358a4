"""The device picture the broker acts on: each fresh probe adopted (devices held back,
leases on lost devices ended, which devices are shared by memory, GPU processes matched
to leases, then what follows a probe: idle reclaim, share budgets), and the re-probing
timer. How a probe is believed is brokerd/devices/watch.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import NamedTuple

from brokerd.base.journal import log_event
from brokerd.base.process import ProcessId
from brokerd.base.procinfo import ancestors, process_info, start_time
from brokerd.config.loader import Config
from brokerd.core.changes import ChangeFeed
from brokerd.core.sharing import SharedDevices
from brokerd.core.tasks import Tasks
from brokerd.core.views import summary
from brokerd.devices.model import Device, Snapshot
from brokerd.devices.nodes import ungated as enforcement_holds_back
from brokerd.devices.occupancy import Occupancy, classify
from brokerd.devices.watch import UnleasedSignaller, probe_forever
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Lease


class Inventory:
    def __init__(self, manager: LeaseManager, snapshot: Snapshot, *, config: Callable[[], Config], tasks: Tasks,
                 changes: ChangeFeed, record_end: Callable[[Lease], asyncio.Future[None]],
                 pump_soon: Callable[[], None], after_probe: Callable[[], None],
                 refresh: Callable[[], Snapshot] | None = None) -> None:
        self.manager = manager
        self.snapshot = snapshot
        self.occupancy = Occupancy()
        self._config = config
        self.tasks = tasks
        self.changes = changes
        self._record_end = record_end
        self._pump_soon = pump_soon
        self._after_probe = after_probe
        self._refresh = refresh
        self._unleased = UnleasedSignaller()
        self._held: dict[str, dict[str, str]] = {}  # an add-on -> the devices it holds back, with why
        self._holders: dict[str, dict[str, BusyHolder]] = {}  # an add-on -> the processes that hold them
        self.sharing = SharedDevices()

    def of_lease(self, lease: Lease) -> list[ProcessId]:
        """The processes the last probe matched to `lease` on its devices (its holder's tree,
        and for a share whatever its user runs there), for the clean-up after its end."""
        found = []
        for pid, lease_id in self.occupancy.matched.items():
            started = start_time(pid) if lease_id == lease.id else None
            if started is not None:
                found.append(ProcessId(pid, started))
        return found

    def start(self) -> None:
        """Re-probe periodically, if the config asks for it and there is a probe to run."""
        if self._refresh is not None and self._config().probe_interval_s > 0:
            probing = probe_forever(self._refresh, self.apply, current=lambda: self.snapshot,
                                    interval_s=lambda: self._config().probe_interval_s)
            self.tasks.spawn(probing, name="probe")

    def apply(self, snapshot: Snapshot) -> None:
        """Adopt a fresh probe: grant what it freed, tell whoever follows the changes."""
        before = (self.manager.devices.keys(), dict(self.manager.unavailable))
        self.adopt(snapshot)
        if before != (self.manager.devices.keys(), self.manager.unavailable):
            log_event("inventory", f"devices now: {summary(self.manager)}")
            self._pump_soon()
            self.changes.changed()
        config = self._config()
        if config.unleased_processes == "signal":
            self._unleased.signal(self.occupancy, config.unleased_grace_s)
        self._after_probe()

    def adopt(self, snapshot: Snapshot) -> None:
        """Adopt a snapshot: hold back unhealthy devices and devices used without a lease
        (allocation fails closed), end leases on lost devices."""
        self.snapshot = snapshot
        self.occupancy, unavailable = occupancy_of(snapshot, self.manager.leases.values(),
                                                   self._config().enforce_mode)
        for held in self._held.values():
            unavailable = {**held, **unavailable}
        self.share_devices()
        for lost in self.manager.set_inventory(snapshot.devices, unavailable):
            self.tasks.keep(self._record_end(lost))

    def share_devices(self) -> None:
        """Tell the manager which devices `[sharing] devices` marks shared among those found."""
        self.manager.set_sharing(self.sharing.resolve(self._config().sharing_devices, self.snapshot.devices))

    def held_by(self, uuid: str) -> BusyHolder | None:
        """The process an add-on found holding `uuid` without a lease, if any."""
        return next((found[uuid] for found in self._holders.values() if uuid in found), None)

    def hold_back(self, by: str, devices: dict[str, str], holders: dict[str, BusyHolder]) -> None:
        """`by` (an add-on) says which devices must not be granted now (uuid -> why, as
        `vaccel status` shows it; and the process holding it, `busy_by`), in place of what
        it said before; what it lets go is granted at once."""
        self._holders[by] = dict(holders)
        if self._held.get(by, {}) == devices:
            return
        self._held[by] = dict(devices)
        before = dict(self.manager.unavailable)
        self.adopt(self.snapshot)
        if before != self.manager.unavailable:
            self._pump_soon()
            self.changes.changed()


class BusyHolder(NamedTuple):
    """A process that holds a device without a lease, as an add-on found it (`busy_by`)."""

    user: str
    pid: int
    command: str


def occupancy_of(
    snapshot: Snapshot, leases: Iterable[Lease], enforce: str = "off"
) -> tuple[Occupancy, dict[str, str]]:
    """Match the snapshot's GPU processes to leases. Returns the occupancy and the devices
    that must not be granted now, with why: used without a lease (allocation fails
    closed), unhealthy, or (with `enforce` = config.enforce_mode "acl") not gated: their
    device nodes cannot be found or are open to everyone (brokerd/devices/nodes.py)."""
    leases = list(leases)
    # What a user runs on a device their reservation or memory share holds is theirs, however
    # it was started: a share's double-forked, setsid'd child is no descendant of its holder,
    # and went uncounted (issue 43). A user's several shares of one device: the first has it.
    reserved: dict[str, dict[int, str]] = {}
    for lease in leases:
        if lease.reservation:
            for uuid in lease.devices:
                reserved.setdefault(uuid, {})[lease.holder.uid] = lease.id
        elif lease.share_mib:
            reserved.setdefault(lease.devices[0], {}).setdefault(lease.holder.uid, lease.id)
    occupancy = classify(
        snapshot.processes,
        {lease.id: {lease.holder.pid, *(member.pid for member in lease.members)} for lease in leases},
        {lease.id: set(lease.devices) for lease in leases},
        snapshot.devices,
        ancestry=ancestors,
        info=process_info,
        reserved=reserved,
    )
    ungated = enforcement_holds_back(snapshot.devices) if enforce == "acl" else {}
    return occupancy, {**ungated, **occupancy.busy, **_unhealthy(snapshot.devices)}


def _unhealthy(devices: tuple[Device, ...]) -> dict[str, str]:
    return {d.uuid: d.health_reason or "unhealthy" for d in devices if not d.healthy}

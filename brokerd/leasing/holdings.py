"""What the host's devices are doing now, for the lease manager: the devices, which active
lease owns each, which are drained by an admin or held back (busy without a lease, not
gated), and when each was last used. Plain data with the lookups every part of the lease
core shares; the rules that change it are the manager's (brokerd/leasing/manager.py)."""

from __future__ import annotations

from collections.abc import Sequence

from brokerd.devices.model import Device
from brokerd.leasing.errors import NotFound
from brokerd.leasing.model import Lease


class Holdings:
    def __init__(self, devices: Sequence[Device] = ()) -> None:
        self.devices: dict[str, Device] = {d.uuid: d for d in devices}
        self.unavailable: dict[str, str] = {}  # uuid -> why it must not be granted now
        self.drained: dict[str, str] = {}  # uuid -> why an admin took it out of the pool
        self.leases: dict[str, Lease] = {}  # active only
        self.owner: dict[str, str] = {}  # device uuid -> active lease id
        self.last_used: dict[str, float] = {}

    def device_state(self, uuid: str) -> str:
        device = self.devices.get(uuid)
        if device is None:
            return "missing"
        if uuid in self.owner:
            return "leased"
        if not device.healthy:
            return "unhealthy"
        if uuid in self.drained:
            return "drained"
        if uuid in self.unavailable:
            return "busy"
        return "free"

    def free(self) -> list[Device]:
        """The devices device_state calls free, in one pass without a call per device."""
        owner, drained, unavailable = self.owner, self.drained, self.unavailable
        return [d for d in self.devices.values()
                if d.healthy and d.uuid not in owner and d.uuid not in drained and d.uuid not in unavailable]

    def leases_by_user(self) -> dict[int, list[Lease]]:
        """The active leases, grouped by their holder's uid (in the order they were granted)."""
        by_user: dict[int, list[Lease]] = {}
        for lease in self.leases.values():
            by_user.setdefault(lease.holder.uid, []).append(lease)
        return by_user

    def drain(self, uuid: str, reason: str, *, undo: bool = False) -> None:
        """Take a device out of the pool (a lease it carries runs on), or put it back."""
        if uuid not in self.devices and not undo:
            raise NotFound(f"no device {uuid!r} on this host (see `vaccel status`)")
        if undo:
            self.drained.pop(uuid, None)
        else:
            self.drained[uuid] = reason or "drained by an admin"

    def take(self, lease: Lease) -> None:
        """`lease` holds its devices from now on."""
        self.leases[lease.id] = lease
        for uuid in lease.devices:
            self.owner[uuid] = lease.id

    def give_back(self, lease: Lease, *, used_at: float | None = None) -> None:
        """`lease` holds nothing any more (its devices were last used at `used_at`, if given)."""
        self.leases.pop(lease.id, None)
        for uuid in lease.devices:
            if self.owner.get(uuid) == lease.id:
                del self.owner[uuid]
            if used_at is not None:
                self.last_used[uuid] = used_at

    def on_lost_devices(self) -> list[tuple[Lease, str]]:
        """The active leases on a device that vanished or turned unhealthy, each with why
        (busy-but-healthy devices keep their lease)."""
        lost = []
        for lease in list(self.leases.values()):
            gone = [u for u in lease.devices if u not in self.devices]
            sick = [u for u in lease.devices if u in self.devices and not self.devices[u].healthy]
            if gone or sick:
                why = (f"device {gone[0]} disappeared" if gone
                       else f"device {sick[0]} is unhealthy: {self.devices[sick[0]].health_reason}")
                lost.append((lease, why))
        return lost

    def check_invariants(self) -> None:
        """Each device is held by at most one active lease, and the owner index says so."""
        owners: dict[str, str] = {}
        for lease in self.leases.values():
            assert lease.active, f"{lease.id} is in the active table but {lease.state}"
            for uuid in lease.devices:
                assert uuid not in owners, f"{uuid} held by {owners[uuid]} and {lease.id}"
                owners[uuid] = lease.id
        assert owners == self.owner, "owner index out of step with the leases"

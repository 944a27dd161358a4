"""What the host's devices are doing now, for the lease manager: the devices, which active
lease owns each, which are drained by an admin or held back (busy without a lease, not
gated), and when each was last used. Plain data with the lookups every part of the lease
core shares; the rules that change it are the manager's (brokerd/leasing/manager.py).

A lease holds its devices exclusively (`owner`) or holds a memory share of one shared
device (`shares`, brokerd/leasing/shares.py): a device has an owner or shares, never both,
and its shares never add up to more than its memory."""

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
        self.shared: frozenset[str] = frozenset()  # uuids leased by memory ([sharing] devices)
        self.shares: dict[str, dict[str, int]] = {}  # device uuid -> {share lease id: MiB}, none empty

    def device_state(self, uuid: str) -> str:
        device = self.devices.get(uuid)
        if device is None:
            return "missing"
        if uuid in self.owner:
            return "leased"
        if uuid in self.shares:
            return "shared"
        if not device.healthy:
            return "unhealthy"
        if uuid in self.drained:
            return "drained"
        if uuid in self.unavailable:
            return "busy"
        return "free"

    def free(self) -> list[Device]:
        """The devices device_state calls free, in one pass without a call per device: what a
        request for whole devices may have (a shared device only while it has no share)."""
        owner, drained, unavailable, shares = self.owner, self.drained, self.unavailable, self.shares
        return [d for d in self.devices.values()
                if d.healthy and d.uuid not in owner and d.uuid not in drained and d.uuid not in unavailable
                and d.uuid not in shares]

    def room(self, uuid: str) -> int:
        """MiB of a device's memory no share holds."""
        device = self.devices.get(uuid)
        return (device.memory_mib if device else 0) - sum(self.shares.get(uuid, {}).values())

    def shareable(self) -> list[Device]:
        """The shared devices a new share may go to now: healthy, not held whole, not drained
        or held back (whether one has room is `room`)."""
        return [d for u in self.shared if (d := self.devices.get(u)) is not None and d.healthy
                and u not in self.owner and u not in self.drained and u not in self.unavailable]

    def share_room_left(self) -> bool:
        """Whether some shareable device has memory no share holds."""
        return bool(self.shared) and any(self.room(d.uuid) > 0 for d in self.shareable())

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
            if lease.share_mib:
                self.shares.setdefault(uuid, {})[lease.id] = lease.share_mib
            else:
                self.owner[uuid] = lease.id

    def give_back(self, lease: Lease, *, used_at: float | None = None) -> None:
        """`lease` holds nothing any more (its devices were last used at `used_at`, if given)."""
        self.leases.pop(lease.id, None)
        for uuid in lease.devices:
            if self.owner.get(uuid) == lease.id:
                del self.owner[uuid]
            on_device = self.shares.get(uuid, {})
            if on_device.pop(lease.id, None) is not None and not on_device:
                del self.shares[uuid]
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
        lost_ids = {lease.id for lease, _ in lost}
        for uuid, on_device in self.shares.items():  # a device that came back smaller: the newest shares go
            device = self.devices.get(uuid)
            over = sum(on_device.values()) - (device.memory_mib if device else 0)
            for lease_id in reversed(list(on_device)):
                if over <= 0 or device is None:
                    break
                if lease_id not in lost_ids:
                    lost.append((self.leases[lease_id], f"device {uuid} now has {device.memory_mib} MiB, "
                                                        "less than its shares hold"))
                over -= on_device[lease_id]
        return lost

    def check_invariants(self) -> None:
        """Each device is held whole by at most one active lease or shared by share leases,
        never both; a share is of one shared device; shares never hold more than a present
        device's memory; and the owner and share indexes say so."""
        owners: dict[str, str] = {}
        shares: dict[str, dict[str, int]] = {}
        for lease in self.leases.values():
            assert lease.active, f"{lease.id} is in the active table but {lease.state}"
            if lease.share_mib:
                assert len(lease.devices) == 1 and lease.share_mib > 0, f"{lease.id} is a share of not one device"
                shares.setdefault(lease.devices[0], {})[lease.id] = lease.share_mib
                continue
            for uuid in lease.devices:
                assert uuid not in owners, f"{uuid} held by {owners[uuid]} and {lease.id}"
                owners[uuid] = lease.id
        assert owners == self.owner, "owner index out of step with the leases"
        assert shares == self.shares, "share index out of step with the leases"
        for uuid, on_device in shares.items():
            assert uuid not in owners, f"{uuid} is held whole by {owners.get(uuid)} and shared"
            device = self.devices.get(uuid)
            assert device is None or sum(on_device.values()) <= device.memory_mib, f"{uuid}'s shares overcommit it"

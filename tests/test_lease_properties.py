"""A stateful property test of the lease manager: any interleaving of requests, releases,
cancellations, heartbeats, expiries, holder deaths, inventory changes and restarts keeps
the invariants (never two live leases on one device, all-or-nothing grants, queued
requests hold nothing, a restart restores exactly the live leases)."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from brokerd.contract import Requirement
from brokerd.devices import Device
from brokerd.errors import Busy, LeaseError, Unsatisfiable
from brokerd.lease_model import Lease, Request
from brokerd.leases import LeaseManager
from brokerd.permissions import Action, Permissions
from brokerd.process import Holder

N_DEVICES = 4
HOLDERS = [Holder(1000 + i, 1000 + i, 100 + i, 7, f"user{i}") for i in range(4)]


def device(i: int, healthy: bool = True) -> Device:
    # Two sizes so memory requirements make some devices ineligible.
    return Device(index=i, uuid=f"GPU-{i}", vendor="nvidia", name=f"card{i}",
                  memory_mib=(80 if i < 2 else 24) * 1024, backend="cuda", arch="sm_80", healthy=healthy)


class LeaseMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.now = 0.0
        self.ids = itertools.count()
        self.present = set(range(N_DEVICES))
        self.sick: set[int] = set()
        self.manager = self._new_manager()
        self.granted: list[Lease] = []

    def _new_manager(self) -> LeaseManager:
        return LeaseManager(self._devices(), ttl_s=10, max_duration_s=100, clock=lambda: self.now,
                            new_id=lambda p: f"{p}{next(self.ids)}")

    def _devices(self) -> list[Device]:
        return [device(i, i not in self.sick) for i in sorted(self.present)]

    def _record(self, leases: list[Lease]) -> None:
        for lease in leases:
            assert len(lease.devices) == len(set(lease.devices))
            self.granted.append(lease)

    @rule(holder=st.sampled_from(HOLDERS), gpus=st.integers(1, 5), big=st.booleans(), wait=st.booleans())
    def submit(self, holder: Holder, gpus: int, big: bool, wait: bool) -> None:
        requirement = Requirement(gpus, min_memory_mib=40 * 1024 if big else 0)
        before = dict(self.manager.owner)
        try:
            outcome = self.manager.submit(holder, requirement, wait=wait)
        except (Busy, Unsatisfiable):
            assert self.manager.owner == before, "a refused request changed holdings"
            return
        if isinstance(outcome, Lease):
            assert len(outcome.devices) == gpus, "partial grant"
            if big:
                assert all(int(u.split("-")[1]) < 2 for u in outcome.devices)
            self._record([outcome])
        else:
            assert isinstance(outcome, Request) and wait
            assert self.manager.owner == before

    @rule(data=st.data(), admin=st.booleans())
    @precondition(lambda self: self.manager.leases)
    def release(self, data: st.DataObject, admin: bool) -> None:
        lease = data.draw(st.sampled_from(sorted(self.manager.leases.values(), key=lambda x: x.id)))
        who = data.draw(st.sampled_from(HOLDERS))
        permissions = Permissions(is_admin=lambda _: admin, admin_group=lambda: "vaccel-admin")
        try:
            # As the service does it: the permission first, then the manager.
            permissions.require(Action.RELEASE, who, self.manager.active(lease.id))
            self.manager.release(lease.id, who.uid)
        except LeaseError:
            assert who.uid != lease.holder.uid and not admin
            assert lease.active
            return
        assert not lease.active

    @rule(data=st.data())
    @precondition(lambda self: self.manager.queue)
    def cancel(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.manager.queue))
        assert self.manager.cancel(request.id)

    @rule()
    def pump(self) -> None:
        grants = self.manager.pump()
        self._record([g.lease for g in grants])

    @rule(seconds=st.floats(0, 30), beat=st.booleans())
    def time_passes(self, seconds: float, beat: bool) -> None:
        self.now += seconds
        if beat:
            for lease in list(self.manager.leases.values()):
                self.manager.heartbeat(lease.id)
        for lease in self.manager.expire():
            assert not lease.active

    @rule(holder=st.sampled_from(HOLDERS))
    def holder_dies(self, holder: Holder) -> None:
        ended, _ = self.manager.process_exited(holder.process)
        assert all(lease.holder == holder for lease in ended)
        assert not any(r.holder == holder for r in self.manager.queue)

    @rule(index=st.integers(0, N_DEVICES - 1), vanish=st.booleans())
    def device_changes(self, index: int, vanish: bool) -> None:
        if vanish:
            self.present ^= {index}
        else:
            self.sick ^= {index}
        self.manager.set_inventory(self._devices())
        for lease in self.manager.leases.values():
            for uuid in lease.devices:
                i = int(uuid.split("-")[1])
                assert i in self.present and i not in self.sick, "lease kept on a lost device"

    @rule()
    def restart(self) -> None:
        """The daemon restarts: a new manager gets exactly the live leases back."""
        live = list(self.manager.leases.values())
        fresh = self._new_manager()
        for lease in live:
            fresh.restore(lease)
        fresh.set_inventory(self._devices())
        assert set(fresh.leases) == {lease.id for lease in live}
        self.manager = fresh

    @invariant()
    def invariants_hold(self) -> None:
        self.manager.check_invariants()
        live_devices = [u for lease in self.manager.leases.values() for u in lease.devices]
        assert len(live_devices) == len(set(live_devices)), "two live leases on one device"
        for uuid in live_devices:
            assert self.manager.device_state(uuid) == "leased"


LeaseMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase

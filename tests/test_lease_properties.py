"""A stateful property test of the lease manager with the real store in the loop: any
interleaving of requests (whole devices or memory shares), releases, cancellations,
heartbeats, expiries, holder deaths, inventory changes (MIG instances vanishing among
them), changes of which devices are shared, and restarts keeps the invariants (never two
live leases on one device or MIG instance, shares never overcommit a device's memory and
never sit beside a whole lease, all-or-nothing grants, queued requests hold nothing),
every change is written through
the SQLite store as the service writes it, the store and the manager agree after every
step, and a restart reopens the file (not a copy in memory) to get exactly the live
leases and the queue, in order, back."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from brokerd.base.process import Holder
from brokerd.contract import Requirement, evaluate
from brokerd.core.permissions import Action, Permissions
from brokerd.devices.model import Device
from brokerd.leasing.errors import Busy, LeaseError, Unsatisfiable
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import RELEASED, Ask, Lease, LeaseTerms, Request, UserLimits
from brokerd.state.queue_record import WaitRecord
from brokerd.state.store import DB_NAME, LeaseStore

# Four whole GPUs, then GPU 4 in MIG mode: its two instances are devices of their own.
N_DEVICES = 6
HOLDERS = [Holder(1000 + i, 1000 + i, 100 + i, 7, f"user{i}") for i in range(4)]
SHARES_MIB = [4096, 10240, 20480, 30720, 49152]
LEND_NOTICE_S = 10.0  # [policy] lend_notice
# tmpfs where there is one: the commits are real, their fsyncs need not be slow.
SCRATCH = "/dev/shm" if Path("/dev/shm").is_dir() else None


def device(i: int, healthy: bool = True) -> Device:
    # Two sizes so memory requirements make some devices ineligible.
    if i >= 4:  # a MIG instance of GPU 4: index 4, its own uuid and memory
        return Device(index=4, uuid=f"MIG-{i}", vendor="nvidia", name="card4 MIG 1g.20gb", memory_mib=20 * 1024,
                      backend="cuda", arch="sm_80", healthy=healthy, mig_index=i - 4, parent_uuid="GPU-4",
                      mig_profile="1g.20gb")
    return Device(index=i, uuid=f"GPU-{i}", vendor="nvidia", name=f"card{i}",
                  memory_mib=(80 if i < 2 else 24) * 1024, backend="cuda", arch="sm_80", healthy=healthy)


def number(uuid: str) -> int:
    return int(uuid.split("-")[1])


def requirement_of(spec: bytes) -> tuple[Requirement, int]:
    gpus, memory, share = spec.decode().split(":")
    return Requirement(int(gpus), min_memory_mib=int(memory)), int(share)


class LeaseMachine(RuleBasedStateMachine):
    @initialize(lend_idle=st.booleans())
    def setup(self, lend_idle: bool) -> None:
        # The machine's clock starts at the real time: the store forgets leases that ended
        # over 30 days before the real clock's now when it opens, so a clock at 1970 made a
        # second restart lose the use the fair order rests on, while the daemon never does.
        self.now = float(int(time.time()))
        self.ids = itertools.count()
        self.present = set(range(N_DEVICES))
        self.sick: set[int] = set()
        self.granted: list[Lease] = []
        self.limits: dict[int, UserLimits] = {}
        self.shared = {1, 3, 5}  # an 80 GiB, a 24 GiB GPU and a MIG instance start shared
        self.lend_idle = lend_idle  # [policy] lend_idle, turned on and off by reloads (lending_changes)
        self.dir = Path(tempfile.mkdtemp(prefix="vaccel-props-", dir=SCRATCH))
        self.loop = asyncio.new_event_loop()
        self.store = LeaseStore(self.dir)
        self.store.open()
        self.manager = self._new_manager()

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _new_manager(self) -> LeaseManager:
        manager = LeaseManager(self._devices(), ttl_s=10, max_duration_s=100, clock=lambda: self.now,
                               new_id=lambda p: f"{p}{next(self.ids)}")
        manager.set_sharing(device(i).uuid for i in self.shared)  # as the daemon does from [sharing]
        manager.lending.enabled, manager.lending.notice_s = self.lend_idle, LEND_NOTICE_S  # and from [policy]
        return manager

    def _devices(self) -> list[Device]:
        return [device(i, i not in self.sick) for i in sorted(self.present)]

    # -- the store, written as the service writes it ----------------------------------

    def _write(self, *saves: Callable[[], asyncio.Future[None]]) -> None:
        """Queue the saves in this order (as the service does, at the moment each change
        happens in memory), then wait until the writer has committed them all."""
        async def commit() -> None:
            await asyncio.gather(*[save() for save in saves])

        self.loop.run_until_complete(commit())

    def _ended(self, leases: list[Lease]) -> None:
        self._write(*[lambda lease=lease: self.store.save_end(lease) for lease in leases])

    def _granted(self, grants: list[tuple[Lease, str]]) -> None:
        # A grant is written with its request's row, and the row goes once delivered.
        saves = []
        for lease, request_id in grants:
            saves.append(lambda lease=lease, r=request_id: self.store.save_grant(lease, r))
            if request_id:
                saves.append(lambda r=request_id: self.store.save_dequeued(r))
        self._write(*saves)

    def _record(self, leases: list[Lease]) -> None:
        for lease in leases:
            assert len(lease.devices) == len(set(lease.devices))
            if lease.share_mib:  # a share goes to a device shared now, whole ones never to one with shares
                assert len(lease.devices) == 1 and number(lease.devices[0]) in self.shared, "share off a shared device"
            else:
                assert not set(lease.devices) & set(self.manager.holdings.shares), "whole lease beside shares"
            self.granted.append(lease)

    # -- rules -------------------------------------------------------------------------

    @rule(holder=st.sampled_from(HOLDERS), gpus=st.integers(1, 5), big=st.booleans(), wait=st.booleans(),
          max_devices=st.integers(0, 3), time_limit=st.sampled_from([0.0, 5.0, 20.0, 60.0]))
    def submit(self, holder: Holder, gpus: int, big: bool, wait: bool, max_devices: int, time_limit: float) -> None:
        self._submit(holder, gpus, 40 * 1024 if big else 0, wait, max_devices, time_limit, 0)

    @rule(holder=st.sampled_from(HOLDERS), gpus=st.integers(1, 2), time_limit=st.sampled_from([0.0, 5.0, 60.0]))
    def submit_under_a_cap(self, holder: Holder, gpus: int, time_limit: float) -> None:
        """A request of a user capped at two devices, who likely holds some: what lending is for."""
        self._submit(holder, gpus, 0, True, 2, time_limit, 0)

    @rule(holder=st.sampled_from(HOLDERS), share=st.sampled_from(SHARES_MIB), wide=st.integers(0, 5),
          wait=st.booleans(), max_devices=st.integers(0, 3), time_limit=st.sampled_from([0.0, 5.0, 20.0, 60.0]))
    def submit_share(self, holder: Holder, share: int, wide: int, wait: bool, max_devices: int,
                     time_limit: float) -> None:
        """A memory share: of one device (now and then of two, which is refused)."""
        self._submit(holder, 2 if wide == 0 else 1, 0, wait, max_devices, time_limit, share)

    def _submit(self, holder: Holder, gpus: int, memory: int, wait: bool, max_devices: int, time_limit: float,
                share: int) -> None:
        big = memory > 0
        requirement = Requirement(gpus, min_memory_mib=memory)
        before = (dict(self.manager.owner), {u: dict(s) for u, s in self.manager.holdings.shares.items()})
        limits = UserLimits(max_devices=max_devices)
        self.limits[holder.uid] = limits
        try:
            outcome = self.manager.submit(holder, requirement, wait=wait,
                                          ask=Ask(time_limit_s=time_limit, memory_mib=share), limits=limits)
        except (Busy, Unsatisfiable):
            assert (self.manager.owner, self.manager.holdings.shares) == before, "a refused request changed holdings"
            return
        assert not (share and gpus > 1), "a share of several devices was taken"
        if isinstance(outcome, Request):
            # Queued: the manager put the queue in fair order as of now. (A grant leaves the
            # queue as the last sort did; ends and the passing of time change use, and the
            # daemon's pump after every end sorts it again, as the pump rule here does.)
            self._in_fair_order()
        if isinstance(outcome, Lease):
            self._within_limits(outcome, limits)
            assert len(outcome.devices) == gpus, "partial grant"
            assert outcome.share_mib == share
            if big:
                assert all(number(u) < 2 for u in outcome.devices)
            self._record([outcome])
            self._granted([(outcome, "")])
        else:
            assert isinstance(outcome, Request) and wait
            assert (self.manager.owner, self.manager.holdings.shares) == before
            spec = f"{gpus}:{memory}:{share}".encode()
            record = WaitRecord(outcome.id, f"k{outcome.id}", holder, outcome.since, 0.0, spec)
            self._write(lambda: self.store.save_queued(record))

    @rule(data=st.data(), admin=st.booleans())
    @precondition(lambda self: self.manager.leases)
    def release(self, data: st.DataObject, admin: bool) -> None:
        lease = data.draw(st.sampled_from(sorted(self.manager.leases.values(), key=lambda x: x.id)))
        who = data.draw(st.sampled_from(HOLDERS))
        permissions = Permissions(is_admin=lambda _: admin, admin_group=lambda: "vaccel-admin")
        try:
            # As the service does it: the permission first, then the manager.
            permissions.require(Action.RELEASE, who, self.manager.active(lease.id))
            ended = self.manager.release(lease.id, who.uid)
        except LeaseError:
            assert who.uid != lease.holder.uid and not admin
            assert lease.active
            return
        assert not lease.active
        self._ended([ended])

    @rule(data=st.data())
    @precondition(lambda self: self.manager.queue)
    def cancel(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.manager.queue))
        assert self.manager.cancel(request.id)
        self._write(lambda: self.store.save_dequeued(request.id))

    def _within_limits(self, lease: Lease, limits: UserLimits, granted_after: frozenset[str] = frozenset()) -> None:
        """Its user's leases fit the limit with it, as they were at its grant (the grants after
        it in the same pump aside: a user's requests may carry different limits)."""
        held = sum(x.weight for x in self.manager.leases.values()
                   if x.holder.uid == lease.holder.uid and x.id not in granted_after)
        assert not limits.max_devices or held <= limits.max_devices + 1e-9, "a grant went over max_devices"

    def _fits(self, lease: Lease, limits: UserLimits, granted_from: frozenset[str]) -> bool:
        """Whether `lease` fits its user's max_devices beside their leases before `granted_from`
        (its own grant and those after it in the same pump)."""
        held = sum(x.weight for x in self.manager.leases.values()
                   if x.holder.uid == lease.holder.uid and x.id not in granted_from)
        return not limits.max_devices or held + lease.weight <= limits.max_devices + 1e-9

    def _in_fair_order(self) -> None:
        # Sorted afresh: ordered() of the queue itself may trust the last sort's basis.
        assert [r.id for r in self.manager.ordered(list(self.manager.queue))] == [r.id for r in self.manager.queue], \
            "the queue is not in the fair order"

    @rule()
    def pump(self) -> None:
        within = self._requests_within_limits()
        grants = self.manager.pump()
        self._in_fair_order()
        for at, grant in enumerate(grants):
            if grant.lease.borrowed:  # lent while idle: only with lend_idle, only to a request a limit held back
                assert self.lend_idle, "a borrowed grant without lend_idle"
                # Held back before the pump, or by its user's grants earlier in this one.
                assert grant.request.id not in within or not self._fits(
                    grant.lease, grant.request.limits, frozenset(g.lease.id for g in grants[at:])), \
                    "a borrowed grant to a request within limits"
            else:
                self._within_limits(grant.lease, grant.request.limits, frozenset(g.lease.id for g in grants[at + 1:]))
        self._record([g.lease for g in grants])
        self._granted([(g.lease, g.request.id) for g in grants])
        # The borrowed leases told to end are recorded as the daemon records a notice.
        self._write(*[lambda lease=lease: self.store.save_ending(lease) for lease in self.manager.lending.recalled])
        self._borrowed_leases_keep_nothing_from_requests_within_limits()

    @rule()
    def lending_changes(self) -> None:
        """A reload turns [policy] lend_idle on or off: borrowed leases run on as they are."""
        self.lend_idle = not self.lend_idle
        self.manager.lending.enabled = self.lend_idle

    def _requests_within_limits(self) -> set[str]:
        reserved = self.manager.waiting.reservations()
        return {r.id for r in self.manager.queue if not self.manager.waiting.limit(r, reserved)}

    def _borrowed_leases_keep_nothing_from_requests_within_limits(self) -> None:
        """After a pump, the pump the daemon would run if every borrowed lease not yet told
        to end had ended grants nothing to a request within limits: a borrowed lease keeps
        no device from one beyond its notice (the bound itself: borrowed_notice_is_short)."""
        lent = [lease for lease in self.manager.leases.values() if lease.borrowed and not lease.notice]
        if not lent or not self.manager.queue:
            return
        within = self._requests_within_limits()
        without = copy.deepcopy(self.manager)
        for lease in lent:
            without.end(lease.id, RELEASED, "as if it had ended")
        started = [(g.request.id, g.request.requirement.gpus, g.request.ask, g.lease.devices, g.request.holder.uid)
                   for g in without.waiting.pump(without._try_grant) if g.request.id in within]
        lent_out = [(x.id, x.devices, x.holder.uid) for x in lent]
        assert not started, f"borrowed leases {lent_out} keep devices from {started} without notice"

    @rule(seconds=st.floats(0, 30), beat=st.booleans())
    def time_passes(self, seconds: float, beat: bool) -> None:
        self.now += seconds
        if beat:
            for lease in list(self.manager.leases.values()):
                self.manager.heartbeat(lease.id)
        expired = self.manager.expire()
        for lease in expired:
            assert not lease.active
        self._ended(expired)

    @rule(holder=st.sampled_from(HOLDERS))
    def holder_dies(self, holder: Holder) -> None:
        ended, dropped = self.manager.process_exited(holder.process)
        assert all(lease.holder == holder for lease in ended)
        assert not any(r.holder == holder for r in self.manager.queue)
        self._ended(ended)
        self._write(*[lambda r=r: self.store.save_dequeued(r.id) for r in dropped])

    @rule(index=st.integers(0, N_DEVICES - 1), vanish=st.booleans())
    def device_changes(self, index: int, vanish: bool) -> None:
        if vanish:
            self.present ^= {index}
        else:
            self.sick ^= {index}
        self._ended(self.manager.set_inventory(self._devices()))
        for lease in self.manager.leases.values():
            for uuid in lease.devices:
                i = number(uuid)
                assert i in self.present and i not in self.sick, "lease kept on a lost device or instance"

    @rule(index=st.integers(0, N_DEVICES - 1))
    def sharing_changes(self, index: int) -> None:
        """A reload shares a device, or stops sharing it: what runs there runs on."""
        self.shared ^= {index}
        self.manager.set_sharing(device(i).uuid for i in self.shared)

    @rule()
    def restart(self) -> None:
        """The daemon restarts: the store is closed, the file reopened, and a new manager
        gets back what the file holds: exactly the live leases and the queue in order."""
        live = {lease.id for lease in self.manager.leases.values()}
        # The order the queue would be served in now (use changed since its last sort when
        # leases ended or time passed without a pump in between).
        queue = [r.id for r in self.manager.ordered(list(self.manager.queue))]
        self.store.close()
        self.store = LeaseStore(self.dir)
        active, ended, _drained = self.store.open()
        records = self.store.queued()
        fresh = self._new_manager()
        for lease in ended:  # as the service restores them: the fair queue's memory of use
            fresh.ended[lease.id] = lease
            fresh.usage.add(lease)
        for lease in active:
            fresh.restore(lease)
        assert not any(r.lease_id for r in records), "a delivered grant left its request behind"
        for r in records:
            requirement, share = requirement_of(r.spec)
            evaluation = evaluate(requirement, list(fresh.devices.values()))
            fresh.queue.append(Request(r.request_id, r.holder, requirement, evaluation, LeaseTerms(), r.since,
                                       Ask(memory_mib=share), limits=self.limits.get(r.holder.uid, UserLimits())))
        assert set(fresh.leases) == live
        # The file keeps arrival order; the order served is the fair one, worked out again
        # from what the file holds (arrival times, past use).
        assert [r.id for r in fresh.ordered()] == queue
        self._ended(fresh.set_inventory(self._devices()))
        self.manager = fresh
        # As the daemon's restore does: a pump, which also puts the queue, restored in
        # arrival order, in fair order (without it, a second restart compared the fair
        # order with the arrival order).
        self.pump()

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        self.manager.check_invariants()
        leases = self.manager.leases.values()
        live_devices = [u for lease in leases if not lease.share_mib for u in lease.devices]
        assert len(live_devices) == len(set(live_devices)), "two live leases on one device"
        for uuid in live_devices:
            assert self.manager.holdings.device_state(uuid) == "leased"
        shared: dict[str, int] = {}
        for lease in leases:
            if lease.share_mib:
                assert lease.devices[0] not in live_devices, "a share beside a whole lease"
                shared[lease.devices[0]] = shared.get(lease.devices[0], 0) + lease.share_mib
        for uuid, mib in shared.items():
            assert mib <= device(number(uuid)).memory_mib, f"shares overcommit {uuid}"
            assert self.manager.holdings.device_state(uuid) == "shared"

    @invariant()
    def borrowed_notice_is_short(self) -> None:
        """A borrowed lease told to end does so within lend_notice."""
        for lease in self.manager.leases.values():
            if lease.borrowed and lease.notice:
                assert lease.expires_at <= self.now + LEND_NOTICE_S + 1e-6, "a borrowed lease's notice is too long"

    @invariant()
    def store_agrees_with_the_manager(self) -> None:
        conn = sqlite3.connect(self.dir / DB_NAME)
        try:
            active = {r[0] for r in conn.execute("SELECT id FROM leases WHERE state='active'")}
            holdings = dict(conn.execute("SELECT device_uuid, lease_id FROM holdings"))
            shares: dict[str, dict[str, int]] = {}
            for lease_id, devices, mib in conn.execute(
                    "SELECT id, devices, share_mib FROM leases WHERE state='active' AND share_mib > 0"):
                shares.setdefault(json.loads(devices)[0], {})[lease_id] = mib
            queue = [r[0] for r in conn.execute("SELECT id FROM queue WHERE lease_id='' ORDER BY rowid")]
            borrowed = {r[0]: (bool(r[1]), r[2]) for r in conn.execute(
                "SELECT id, borrowed, notice FROM leases WHERE state='active'")}
        finally:
            conn.close()
        assert active == set(self.manager.leases), "active leases on disk differ from the manager's"
        assert holdings == self.manager.owner, "device holdings on disk differ from the manager's"
        assert shares == self.manager.holdings.shares, "shares on disk differ from the manager's"
        assert borrowed == {x.id: (x.borrowed, x.notice) for x in self.manager.leases.values()}, \
            "borrowed leases and their notices on disk differ from the manager's"
        # The file keeps the requests in arrival order, the manager in the fair order it
        # serves them (worked out from arrival and past use; the restart rule checks that).
        assert sorted(queue) == sorted(r.id for r in self.manager.queue), "the queue on disk differs from the manager's"
        since = {r.id: r.since for r in self.manager.queue}
        assert [since[i] for i in queue] == sorted(since[i] for i in queue), "the file is not in arrival order"


LeaseMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase

"""The lease manager: who holds which device, who waits, and the rules between them.

Plain, synchronous Python with no gRPC, no I/O and an injectable clock, so that every
interleaving can be tested (tests/test_lease_properties.py drives it with a hypothesis
state machine). The async layer (brokerd/core/ledger.py) persists what this returns before
anyone hears of it. Who may ask for what is not decided here: the service checks that
first, in brokerd/core/permissions.py.

Invariants (checked by `check_invariants`):
- a device is owned by at most one active lease or shared by share leases whose shares
  fit its memory, never both, and every active lease holds its devices or its share;
- a multi-device lease got all its devices in one step (`_grant` takes the whole set);
- a queued request holds nothing;
- a queued request that its own user's leases block, or that a policy limit holds back,
  reserves nothing (no head-of-line hogging: see brokerd/leasing/reservations.py).

It is made of two parts it is given nothing else to share with: what the devices are
doing (Holdings, brokerd/leasing/holdings.py) and the waiting side (LeaseQueue: fair order,
what waiters keep, backfill, the pump; brokerd/leasing/queue.py). The manager holds the
rules between them: who gets what, and how a lease ends.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import replace

from brokerd.base.process import Holder, ProcessId
from brokerd.contract import Requirement, evaluate
from brokerd.devices.model import Device
from brokerd.leasing import endings
from brokerd.leasing.errors import Busy, Ended, LeaseError, NotFound, Unsatisfiable
from brokerd.leasing.evaluations import Evaluations
from brokerd.leasing.fairshare import UsageBook
from brokerd.leasing.grants import lease_for
from brokerd.leasing.holders_line import holders_line
from brokerd.leasing.holdings import Holdings
from brokerd.leasing.lending import Lending, whole_devices_for
from brokerd.leasing.model import (
    ENDED_STATES,
    LOST,
    RELEASED,
    REVOKED,
    Ask,
    ContainerHold,
    Grant,
    Lease,
    LeaseTerms,
    Request,
    UserLimits,
)
from brokerd.leasing.queue import LeaseQueue
from brokerd.leasing.queue_rules import BACKFILL
from brokerd.leasing.reservations import Reservations
from brokerd.leasing.shares import pick_share_device, share_problem
from brokerd.leasing.steps import shift, stepped

_HISTORY = 1000
_NO_TERMS = LeaseTerms()
_NO_ASK = Ask()
_NO_LIMITS = UserLimits()


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(6)}"


class LeaseManager:
    def __init__(
        self,
        devices: Sequence[Device] = (),
        *,
        ttl_s: float = 30.0,
        max_duration_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        steps: Callable[[], float] | None = None,  # the wall clock's jumps (brokerd/base/clock.py)
        new_id: Callable[[str], str] = _new_id,
    ) -> None:
        self.ttl_s, self.max_duration_s = ttl_s, max_duration_s
        self._clock = clock if steps is None else stepped(
            clock, steps, lambda by: shift(self.leases.values(), self.queue, by))
        self._new_id = new_id
        self.holdings = Holdings(devices)
        self.usage = UsageBook()  # recent use per user, for the fair queue and the limits
        # The queue reads the clock through the manager (so a test's clock is its too); it
        # also plans with each user's runtimes (brokerd/leasing/runtimes.py).
        self.waiting = LeaseQueue(self.holdings, self.usage, lambda: self._clock())
        self.lending = Lending(self.holdings, self.waiting, lambda: self._clock(), lambda: self.max_duration_s)
        self.ended: dict[str, Lease] = {}  # recent history, oldest first
        self._evaluations = Evaluations()

    # -- what the parts hold, by the names the rest of the daemon reads -----------------

    @property
    def devices(self) -> dict[str, Device]:
        return self.holdings.devices

    @property
    def leases(self) -> dict[str, Lease]:  # the active ones, by id
        return self.holdings.leases

    @property
    def owner(self) -> dict[str, str]:  # device uuid -> the active lease that holds it
        return self.holdings.owner

    @property
    def drained(self) -> dict[str, str]:
        return self.holdings.drained

    @property
    def unavailable(self) -> dict[str, str]:
        return self.holdings.unavailable

    @property
    def queue(self) -> list[Request]:
        """The waiting requests, in the order they are served."""
        return self.waiting.requests

    @property
    def aging_s(self) -> float:
        return self.waiting.aging_s

    @aging_s.setter
    def aging_s(self, value: float) -> None:
        self.waiting.aging_s = value

    # -- inventory ---------------------------------------------------------------------

    def set_inventory(self, devices: Sequence[Device], unavailable: Mapping[str, str] | None = None) -> list[Lease]:
        """Replace the device picture. Leases on a device that vanished or turned unhealthy
        end as LOST (their holders are told); busy-but-healthy devices keep their lease."""
        if self.devices != {d.uuid: d for d in devices}:
            self._evaluations.clear()
            self.holdings.devices = {d.uuid: d for d in devices}
            # Queued requests were judged against the old devices: judge them again.
            for request in self.queue:
                request.evaluation = evaluate(request.requirement, list(self.devices.values()))
        self.holdings.unavailable = dict(unavailable or {})
        return [self._end(lease, LOST, why) for lease, why in self.holdings.on_lost_devices()]

    def drain(self, uuid: str, reason: str, *, undo: bool = False) -> None:
        """Take a device out of the pool (a lease it carries runs on), or put it back."""
        self.holdings.drain(uuid, reason, undo=undo)

    def set_sharing(self, uuids: Iterable[str]) -> None:
        """Which devices are leased by memory from now on (brokerd/leasing/shares.py); the
        shares and whole leases already granted run on as they are."""
        self.holdings.shared = frozenset(uuids)

    # -- requests ----------------------------------------------------------------------

    def submit(
        self,
        holder: Holder,
        requirement: Requirement,
        *,
        wait: bool,
        terms: LeaseTerms = _NO_TERMS,
        cache_key: Hashable | None = None,
        ask: Ask = _NO_ASK,
        limits: UserLimits = _NO_LIMITS,
    ) -> Lease | Request:
        """Grant now, or queue (wait=True), or refuse. Raises Unsatisfiable when no device
        set on this host could ever satisfy the request (or a limit never lets it), Busy
        when it would have to wait and the caller won't. Requests with the same
        `cache_key` (same requirement, same client facts) share one evaluation until the
        inventory changes."""
        if requirement.gpus < 1:
            raise Unsatisfiable("gpus must be at least 1")
        if limits.max_devices and requirement.gpus > limits.max_devices:
            raise Unsatisfiable(f"limit max_devices={limits.max_devices} for {limits.policy}: a request for "
                                f"{requirement.gpus} devices can never start here")
        evaluation = self._evaluations.satisfiable(requirement, self.devices.values(), cache_key)
        if ask.only:
            evaluation = self.waiting.only(evaluation, ask.only, requirement.gpus)
        request = Request(self._new_id("r-"), holder, requirement, evaluation, terms, self._clock(), ask, limits)
        if ask.memory_mib and (problem := share_problem(request, self.holdings)):
            raise Unsatisfiable(problem, evaluation)
        # The requests ahead of it in the queue's order keep what they will start on; the
        # newcomer may take only what they leave it (or backfill).
        order, basis = self.waiting.fair_order_with(request)
        # Found by identity: list.index compares with the dataclass's __eq__, which builds
        # and compares a tuple of every field for each request ahead (0.11 ms per scan
        # of 500; 0.016 ms by identity).
        ahead_of_it = order[:next(i for i, r in enumerate(order) if r is request)]
        reserved = self.waiting.reservations()
        free = self.holdings.free()
        eligible = set(evaluation.eligible)
        # What those ahead keep matters only if enough free devices (or shared memory) exist
        # to take: on a full host (hundreds waiting) a newcomer then costs no pass over the queue.
        if (sum(1 for d in free if d.uuid in eligible) >= requirement.gpus if not ask.memory_mib
                else any(self.holdings.room(d.uuid) >= ask.memory_mib for d in self.holdings.shareable())):
            for ahead in ahead_of_it:
                if not self.waiting.limit(ahead, reserved):  # their reasons stay the last pump's
                    reserved.add(ahead)
        request.reason = self.waiting.limit(request, reserved)
        if not request.reason:
            lease = self._try_grant(request, reserved, free)
            if lease is not None:
                return lease
            ahead = {r.holder.uid for r in ahead_of_it} - {holder.uid}
            request.reason = self.waiting.wait_reason(request, reserved, free, len(ahead))
            self.waiting.backfill_told |= request.reason.startswith(BACKFILL)
        if not wait:
            what = "no shared device has room for the share" if ask.memory_mib else \
                "no free device satisfies the request"
            raise Busy(f"{what} now ({request.reason or 'busy'}); {self.holders_summary()}")
        self.waiting.set_in_order(order, basis)
        return request

    def _try_grant(self, request: Request, reserved: Reservations, free: list[Device]) -> Lease | None:
        """Grant `request` on what is `free` (still true) and not kept for those ahead, if
        enough is; a share on a shared device's memory."""
        if request.ask.memory_mib:
            device = pick_share_device(request, self.holdings, reserved)
            return self._grant(request, [device]) if device is not None else None
        chosen = whole_devices_for(request, reserved, free, self.holdings)
        if chosen is None:
            return None
        # One lease drives one backend: the policy never mixes vendors in one grant.
        assert len({d.backend for d in chosen}) == 1, "selection mixed backends"
        return self._grant(request, chosen)

    def _grant(self, request: Request, devices: Sequence[Device]) -> Lease:
        uuids = tuple(d.uuid for d in devices)
        share = request.ask.memory_mib
        assert len(set(uuids)) == len(uuids) == request.requirement.gpus
        assert all(u not in self.owner and (share or u not in self.holdings.shares) for u in uuids), \
            "device granted twice"
        assert not share or self.holdings.room(uuids[0]) >= share, "share over the device's memory"
        lease = lease_for(request, devices, self._new_id("l-"), self._clock(), self.max_duration_s)
        self.holdings.take(lease)
        self.waiting.runtimes.plan(lease)  # its planned run is its user's history at its grant
        return lease

    def rollback(self, lease_id: str) -> None:
        """Undo a grant that could not be made durable, as if it never happened."""
        if (lease := self.leases.get(lease_id)) is not None:
            self.holdings.give_back(lease)
            self.waiting.runtimes.forget(lease.id)

    # -- leases ------------------------------------------------------------------------

    def get(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id) or self.ended.get(lease_id)
        if lease is None:
            raise NotFound(f"no lease {lease_id!r} on this broker (see `vaccel leases`)")
        return lease

    def active(self, lease_id: str) -> Lease:
        """The lease if it is still running; NotFound or Ended (saying how) otherwise."""
        lease = self.get(lease_id)
        if not lease.active:
            raise Ended(f"lease {lease_id} has ended: {lease.state} ({lease.end_reason})")
        return lease

    def heartbeat(self, lease_id: str) -> Lease:
        """The holder is still at work: the TTL counts from now."""
        lease = self.active(lease_id)
        lease.last_heartbeat = self._clock()
        return lease

    def join(self, lease_id: str, process: ProcessId) -> Lease:
        """A process started inside the lease becomes a member of it."""
        lease = self.active(lease_id)
        if process != lease.holder.process:
            lease.members.add(process)
        return lease

    def hold_by_container(self, lease_id: str, hold: ContainerHold) -> Lease:
        """Apply the lease to a confirmed container, whose init's exit ends it (`held`: and no other's)."""
        lease = self.active(lease_id)
        lease.container = hold
        if hold.held:
            lease.holder = replace(lease.holder, pid=hold.init.pid, start_time=hold.init.start_time)
        return lease

    def release(self, lease_id: str, by_uid: int, reason: str = "") -> Lease:
        """End a lease on request: released when its holder's user asks, revoked when
        someone else does (permissions let only an admin get this far)."""
        lease = self.active(lease_id)
        if lease.ending_state == REVOKED:  # told it was revoked, it gave up early: still a revoke...
            if lease.borrowed and by_uid == lease.holder.uid:  # ...but a borrower giving back when called back
                return self._end(lease, RELEASED, f"gave back what it borrowed: {lease.notice}")  # is not reaped
            return self._end(lease, REVOKED, endings.past(lease.notice))
        if by_uid == lease.holder.uid:
            return self._end(lease, RELEASED, reason or "released by its holder")
        return self._end(lease, REVOKED, reason or f"revoked by admin uid {by_uid}")

    def expire(self) -> list[Lease]:
        """End leases whose heartbeats stopped or whose end is reached (brokerd/leasing/endings.py)."""
        now = self._clock()
        ended = []
        for lease in list(self.leases.values()):
            how = endings.due(lease, now, self.ttl_s, self.max_duration_s)
            if how is not None:
                ended.append(self._end(lease, *how))
        return ended

    def end_early(self, lease_id: str, at: float, state: str, notice: str) -> Lease:
        """The lease will end at `at` (sooner than it would), in `state`, saying `notice` to
        its holder meanwhile (an admin's revoke with grace, an idle reclaim)."""
        lease = self.active(lease_id)
        if lease.notice and lease.expires_at and at >= lease.expires_at:
            return lease  # an earlier early end is announced already: it stands
        lease.expires_at = min(at, lease.expires_at) if lease.expires_at else at
        lease.notice, lease.ending_state = notice, state
        return lease

    def call_off_ending(self, lease_id: str) -> Lease:
        """An early end announced (idle reclaim) no longer applies: back to its own limit."""
        lease = self.active(lease_id)
        lease.notice, lease.ending_state = "", ""
        lease.expires_at = endings.end_of(lease.granted_at, lease.time_limit_s, self.max_duration_s)
        return lease

    def next_deadline(self) -> float | None:
        """The earliest time `expire` could end something, for the daemon's timer."""
        soonest = min(map(self.deadline, self.leases.values()), default=math.inf)
        return None if soonest == math.inf else soonest

    def deadline(self, lease: Lease) -> float:
        """When `expire` would end this lease if nothing changed (inf: never)."""
        return endings.deadline(lease, self.ttl_s)

    def process_exited(self, process: ProcessId) -> tuple[list[Lease], list[Request]]:
        """The kernel says it is gone: end its leases, drop its queued requests, forget it as a member."""
        ended = [self._end(lease, *endings.on_exit(lease, process, self._clock(), self.max_duration_s))
                 for lease in list(self.leases.values()) if endings.held_by(lease, process)]
        for lease in self.leases.values():
            lease.members.discard(process)
        dropped = [r for r in self.queue if r.holder.process == process]
        if dropped:
            self.waiting.remove_all(dropped)
        return ended, dropped

    def involves(self, process: ProcessId) -> bool:
        """Whether the process holds, has joined or waits for anything."""
        pid, start = process
        # Compared field by field: building a ProcessId per lease and request made this
        # the largest cost of a release on a host with hundreds waiting.
        return (any((lease.holder.pid == pid and lease.holder.start_time == start and not lease.reservation)
                    or (lease.members and process in lease.members)
                    or (lease.container is not None and lease.container.init == process)
                    for lease in self.leases.values())
                or any(r.holder.pid == pid and r.holder.start_time == start for r in self.queue))

    def end(self, lease_id: str, state: str, reason: str) -> Lease:
        return self._end(self.active(lease_id), state, reason)

    def _end(self, lease: Lease, state: str, reason: str) -> Lease:
        assert state in ENDED_STATES
        now = self._clock()
        self.holdings.give_back(lease, used_at=now)
        lease.state, lease.end_reason, lease.ended_at = state, reason, now
        self.waiting.ended(lease)
        self.ended[lease.id] = lease
        while len(self.ended) > _HISTORY:
            del self.ended[next(iter(self.ended))]
        return lease

    def restore(self, lease: Lease) -> None:
        """Put back a lease read from the store at start-up; its heartbeat clock restarts."""
        clash = [u for u in lease.devices if u in self.owner or (not lease.share_mib and u in self.holdings.shares)]
        if clash:
            raise LeaseError(f"state holds two live leases on device {clash[0]}")
        if lease.share_mib and sum(self.holdings.shares.get(lease.devices[0], {}).values()) + lease.share_mib \
                > lease.share_of_mib:
            raise LeaseError(f"state holds shares of device {lease.devices[0]} over its memory")
        self.holdings.take(replace(lease, last_heartbeat=self._clock()))

    # -- views -------------------------------------------------------------------------

    def holders_summary(self) -> str:
        """"gpu0 alice since 10:02, gpu1 bob since 09:41", or counted per user (holders_line.py)."""
        return holders_line(self.holdings)

    # -- the queue ---------------------------------------------------------------------

    def ordered(self, queue: list[Request] | None = None) -> list[Request]:
        """The queue (or `queue`, sorted afresh) in the order it is served."""
        return self.waiting.ordered(queue)

    def pump(self) -> list[Grant]:
        """Grant queued requests that can now be satisfied, in the queue's order, and
        leave on each one left waiting the reason it waits; then lend what stays idle
        (brokerd/leasing/lending.py: `lending.recalled` are the borrowed leases told to end)."""
        grants = self.waiting.pump(self._try_grant)
        return grants + self.lending.after_pump(self._try_grant, self.end_early)

    def cancel(self, request_id: str) -> bool:
        """Take a waiting request off the queue; False when it is not there."""
        return self.waiting.cancel(request_id)

    def check_invariants(self) -> None:
        self.holdings.check_invariants()
        assert not set(self.leases) & set(self.ended), "a lease is both active and ended"

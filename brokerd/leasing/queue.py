"""The waiting side of the lease core: the queue in its fair order, what each waiter keeps
back (brokerd/leasing/reservations.py), the limits that hold a request back, and the pump
that grants what can start. Plain Python, no I/O, the manager's clock; given what the
devices are doing (Holdings) and each user's recent use (UsageBook), and granting through
the manager's `try_grant`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from brokerd.contract import Evaluation
from brokerd.devices.model import Device
from brokerd.leasing.errors import Unsatisfiable
from brokerd.leasing.fairshare import UsageBook
from brokerd.leasing.holdings import Holdings
from brokerd.leasing.model import Grant, Lease, Request
from brokerd.leasing.queue_rules import BACKFILL, OrderBasis, fair_order_and_basis, limit_reason, wait_reason
from brokerd.leasing.reservations import NEVER, Reservations, Room
from brokerd.leasing.runtimes import RuntimeBook
from brokerd.leasing.shares import share_wait_reason

TryGrant = Callable[[Request, Reservations, list[Device]], "Lease | None"]


class LeaseQueue:
    def __init__(self, holdings: Holdings, usage: UsageBook, clock: Callable[[], float]) -> None:
        self.holdings = holdings
        self.usage = usage
        self.runtimes = RuntimeBook()  # how long users' leases really run: the queue plans with it
        self._clock = clock
        self.requests: list[Request] = []
        self.aging_s = 24 * 3600.0  # a request this old goes ahead of all younger ones
        # Whether a queued request may carry a "backfill window" reason, which the next pump
        # must replace if no free device is left. Reasons are told only by the manager's
        # submit() and pump(): each sets it when it tells one, and the pump clears it once
        # it has told every such request again.
        self.backfill_told = False
        # The queue as it was last put in fair order (the very list and its length then),
        # and what that order rested on: see fair_order.
        self._sorted_queue: list[Request] | None = None
        self._sorted_length = 0
        self._order_basis: OrderBasis | None = None

    def only(self, evaluation: Evaluation, only: tuple[str, ...], gpus: int) -> Evaluation:
        """The evaluation narrowed to the devices the request named."""
        eligible = tuple(u for u in evaluation.eligible if u in only)
        if len(eligible) < gpus:
            devices = self.holdings.devices
            unfit = [u for u in only if u not in eligible]
            why = "; ".join(
                f"{devices[u].label}: " + "; ".join(
                    f"{ln.name}: {ln.message}" for ln in evaluation.per_device.get(u, ()) if ln.level == "ERROR")
                for u in unfit if u in devices)
            named = len(only)
            raise Unsatisfiable(f"the {named} device{'s' if named > 1 else ''} named cannot satisfy a request "
                                f"for {gpus}" + (f" ({why})" if why else ""), evaluation)
        return replace(evaluation, eligible=eligible)

    # -- the fair order ----------------------------------------------------------------

    def ordered(self, queue: list[Request] | None = None) -> list[Request]:
        """The queue (or `queue`, sorted afresh) in the order it is served
        (brokerd/leasing/queue_rules.py: fair, with aging)."""
        return self.fair_order(queue)[0]

    def fair_order(self, queue: list[Request] | None = None) -> tuple[list[Request], OrderBasis]:
        now = self._clock()
        recent = self._recent_use(now)
        if queue is None:
            reordered = self._reordered(now, recent)
            if reordered is not None:
                return reordered
            queue = self.requests
        return fair_order_and_basis(queue, now, self.aging_s, recent)

    def fair_order_with(self, request: Request) -> tuple[list[Request], OrderBasis]:
        """The queue and the newcomer `request`, in fair order, and that order's basis."""
        now = self._clock()
        recent = self._recent_use(now)
        reordered = self._reordered(now, recent)
        if reordered is not None:
            placed = reordered[1].with_newcomer(reordered[0], request, now, self.aging_s, recent)
            if placed is not None:
                return placed
        return fair_order_and_basis([*self.requests, request], now, self.aging_s, recent)

    def _recent_use(self, now: float) -> Callable[[int], float]:
        """Each user's recent use (brokerd/leasing/fairshare.py) as of `now`, each worked out
        once however often it is asked (the reorder and the newcomer's place both ask)."""
        # Each running lease is looked at once, here, not once per waiting user (64
        # leases x 12 users at every pump and newcomer on a large host).
        running = self.holdings.leases_by_user()
        known: dict[int, float] = {}

        def recent(uid: int) -> float:
            if uid not in known:
                known[uid] = self.usage.recent(uid, now, running.get(uid, ()))
            return known[uid]

        return recent

    def in_order(self) -> OrderBasis | None:
        """The basis of the queue's order while the queue is the list the last sort (or
        pump) left, less what cancel() took: None once anything else changed it."""
        if self.requests is self._sorted_queue and len(self.requests) == self._sorted_length:
            return self._order_basis
        return None

    def _reordered(self, now: float, recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis] | None:
        """The queue as the last sort left it, or fewer of it, put in fair order from what
        that sort rested on (queue_rules.OrderBasis), when that still can be."""
        basis = self.in_order()
        return basis.reorder(self.requests, now, self.aging_s, recent) if basis is not None else None

    def set_in_order(self, queue: list[Request], basis: OrderBasis) -> None:
        """Make `queue` the queue: it is in the fair order `basis` describes."""
        self.requests = self._sorted_queue = queue
        self._sorted_length = len(queue)
        self._order_basis = basis

    def remove_all(self, dropped: list[Request]) -> None:
        """Take these requests off the queue (their process exited)."""
        basis = self.in_order()
        kept = [r for r in self.requests if r not in dropped]
        if basis is not None:
            self.set_in_order(kept, basis)  # fewer of an ordered queue: in order still
        else:
            self.requests = kept

    def ended(self, lease: Lease) -> None:
        """A lease ended: its use counts in its user's recent use, its run in their runtimes."""
        self.usage.add(lease)
        self.runtimes.add(lease)

    # -- what waiters keep, and what holds them back ------------------------------------

    def reservations(self, lent_out: frozenset[str] = frozenset()) -> Reservations:
        """What the waiters keep, built in queue order by the caller. `lent_out`: borrowed
        leases to plan as if they had ended (brokerd/leasing/lending.py asks what their
        devices would let start)."""
        now = self._clock()
        holdings = self.holdings

        def ends(lease_id: str) -> float:
            return now if lease_id in lent_out else holdings.leases[lease_id].expires_at or NEVER

        def planned_end(lease: Lease) -> float:  # a whole-device lease: by its prediction (runtimes)
            return now if lease.id in lent_out else self.runtimes.end_of(lease, now) or NEVER

        def available_at() -> dict[str, float]:
            when = {}
            for uuid in holdings.devices:
                state = holdings.device_state(uuid)
                if state == "free":
                    when[uuid] = now
                elif state == "leased":
                    when[uuid] = planned_end(holdings.leases[holdings.owner[uuid]])
                elif state == "shared":  # whole once its last share ends
                    when[uuid] = max(map(ends, holdings.shares[uuid]))
            return when

        def rooms() -> dict[str, Room]:
            return {d.uuid: Room(d.memory_mib, [(mib, ends(lease_id)) for lease_id, mib in
                                                holdings.shares.get(d.uuid, {}).items()],
                                 ends(holdings.owner[d.uuid]) if d.uuid in holdings.owner else now)
                    for u in holdings.shared if (d := holdings.devices.get(u)) is not None and d.healthy
                    and u not in holdings.drained and u not in holdings.unavailable}

        leases = [lease for lease in holdings.leases.values() if lease.id not in lent_out] if lent_out \
            else holdings.leases.values()
        return Reservations(leases, now=now, available_at=available_at, rooms=rooms,
                            run_s=lambda r: self.runtimes.run_s(r.holder.uid, r.ask.time_limit_s),
                            end_of=planned_end)

    def wait_reason(self, request: Request, reserved: Reservations, free: list[Device], users_ahead: int) -> str:
        """Why a request that no limit holds back still waits (queue_rules, or for a memory
        share brokerd/leasing/shares.py)."""
        if request.ask.memory_mib:
            return share_wait_reason(request, self.holdings, reserved, users_ahead)
        return wait_reason(request, reserved, free, users_ahead)

    def limit(self, request: Request, reserved: Reservations) -> str:
        """The policy limit that holds the request back now ("" when none does): such a
        request keeps nothing for itself."""
        if not (request.limits.max_devices or request.limits.max_device_hours or request.limits.max_leases):
            return ""  # the common case, on every request of every pump: no work
        now = self._clock()
        return limit_reason(request, reserved, self.holdings.devices,
                            lambda uid, window: self.usage.in_window(uid, now, window,
                                                                     self.holdings.leases.values()))

    def blocked_by_own_leases(self, request: Request) -> bool:
        """Whether the request's user holds so many of its eligible devices that the rest
        cannot satisfy it."""
        return Reservations(self.holdings.leases.values()).blocked(request)

    # -- changes -----------------------------------------------------------------------

    def cancel(self, request_id: str) -> bool:
        for i, request in enumerate(self.requests):
            if request.id == request_id:
                if self.in_order() is not None:
                    self._sorted_length -= 1  # one fewer is still in order
                del self.requests[i]
                return True
        return False

    def pump(self, try_grant: TryGrant) -> list[Grant]:
        """Grant queued requests that can now be satisfied, in the queue's order, and
        leave on each one left waiting the reason it waits."""
        grants: list[Grant] = []
        waiting: list[Request] = []
        if not self.requests:
            return grants  # after most releases on a host nobody waits for
        # Built once and kept up to date as the pass goes: rebuilding it for every request
        # made a pump quadratic in the queue's length.
        reserved = self.reservations()
        free = self.holdings.free()
        users_ahead: set[int] = set()
        order, basis = self.fair_order()
        told_backfill_before, self.backfill_told = self.backfill_told, False
        for at, request in enumerate(order):
            if not free and not self.holdings.share_room_left():  # nothing left to grant: the rest keep
                # their place and their reasons...
                rest = order[at:]
                if told_backfill_before:  # ...but "backfill window": no free device is kept any more
                    self._tell_backfill_waiters(rest, reserved, users_ahead)
                waiting += rest
                break
            held_back = self.limit(request, reserved)
            if held_back:
                request.reason = held_back
                waiting.append(request)
                continue
            lease = try_grant(request, reserved, free)
            if lease is None:
                waiting.append(request)
                others = len(users_ahead - {request.holder.uid})
                request.reason = self.wait_reason(request, reserved, free, others)
                self.backfill_told |= request.reason.startswith(BACKFILL)
                reserved.add(request)
                users_ahead.add(request.holder.uid)
            else:
                grants.append(Grant(request, lease))
                reserved.granted(lease)
                free = [d for d in free if d.uuid not in lease.devices]
        self.set_in_order(waiting, basis)  # the order, less what was granted
        return grants

    def _tell_backfill_waiters(self, rest: list[Request], reserved: Reservations, users_ahead: set[int]) -> None:
        """The requests behind the last free device that were told of a backfill window
        are told why they wait now. A pass over all of them, taken only when some request
        was told of one: the pump's common case, a release on a full host, takes none
        (the pass cost ~0.7 ms of the daemon per grant at 500 waiting)."""
        for request in rest:
            if request.reason.startswith(BACKFILL):
                request.reason = self.wait_reason(request, reserved, [], len(users_ahead - {request.holder.uid}))
            users_ahead.add(request.holder.uid)

    def position(self, request_id: str) -> tuple[int, int]:
        for i, request in enumerate(self.requests):
            if request.id == request_id:
                return i + 1, len(self.requests)
        return 0, len(self.requests)

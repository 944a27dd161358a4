"""The queue's order and the reasons a request waits, for the lease manager.

Order (the fair queue): each waiting request stands at its user's recent use
(brokerd/leasing/fairshare.py, device-hours) less what its wait has earned back,
WAIT_CREDIT device-hours per hour waited; the least goes first, ties by arrival. Waiting
is weighed against use, as Slurm's age factor is against fair share, so a light user's
newcomer goes ahead of a heavy user's request only until that request has waited about as
many hours as its user used device-hours lately. A request that has waited `aging_s` or
longer goes ahead of every younger one, oldest first, whatever its user used: the bound
this gives is that once a request has waited `aging_s`, only requests that arrived before
it can be served ahead of it, so a stream of newcomers can hold it back for at most
`aging_s` (plus the time the requests older than it take), never for ever.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import pairwise

from brokerd.devices.model import Device
from brokerd.leasing.model import Request
from brokerd.leasing.reservations import NEVER, Reservations
from brokerd.leasing.shares import request_weight
from vaccel_common.units import format_duration

BACKFILL = "backfill window"  # how a wait_reason() that names a backfill window starts
_SLACK = 1e-9  # shares add up in floating point: four quarters make one device
_HOUR = 3600.0

# Device-hours of recent use one hour of waiting earns back in the fair order. With the
# aging bound as the only weight (a 4 h tier, no credit) a busy day's queue turned first
# come, first served after 4 h and light users waited behind it; with one device-hour per
# hour and the bound at 24 h, 30 simulated lab days (bench.lab.simulate) give Jain 0.840
# against 0.810 at 0.750 utilisation against 0.751 (idle-while-waiting 5.8 against 5.1
# device-hours); half or twice the credit did no better (docs/performance.md).
WAIT_CREDIT = 1.0

# A request this close to turning old enough to go first is sorted again rather than
# trusted to the basis below (its age is computed as now - since, the basis adds).
_AGING_MARGIN_S = 0.001


def _order_key(request: Request, now: float, aging_s: float,
               use: Callable[[int], float]) -> tuple[int, float, float]:
    """Where a request stands in the fair order: the aged first by arrival, then the rest
    by their user's recent use less their wait's credit, then by arrival."""
    since = request.since
    if aging_s > 0 and now - since >= aging_s:  # waited aging_s: it goes first (`since` read once)
        return (0, since, since)
    return (1, use(request.holder.uid) - WAIT_CREDIT * (now - since) / _HOUR, since)


# How much larger than the users' drift the smallest gap must stay for an order to be
# trusted: keys are a few thousand device-hours at most, and floating point's error on them
# is below 1e-10.
_GAP_MARGIN = 1e-9


def _gap(before: tuple[int, float, float], after: tuple[int, float, float]) -> float:
    """How far apart two neighbouring keys are in use (inf: the aged tier is involved, and
    its order is by arrival alone)."""
    return after[1] - before[1] if before[0] == after[0] == 1 else math.inf


@dataclass(frozen=True)
class OrderBasis:
    """What a fair order was sorted on, besides arrival times (they never change).

    A request's key is its user's recent use less WAIT_CREDIT per hour since its arrival.
    The clock's part is the same for every request, so from one moment to another the keys
    of one user's requests all move by that user's change in use, and two requests of
    different users can change places only when their users' changes differ by more than
    the gap between their keys. The basis keeps each user's use when the order was known
    right and the smallest gap then between neighbours of different users: while the
    users' changes spread by less than that and no request grows old, the order stands, so
    a pump or a newcomer looks at one figure per user instead of sorting every request
    (~0.9 ms of the daemon's CPU at 500 waiting, on the way from a release to the next
    grant; 4.6 ms a newcomer at 10,000). Users who wait holding nothing (no use, or use
    fading alike) leave an order standing for long; a waiting user who holds a device moves
    theirs within seconds, and the next pump sorts again."""

    sorted_at: float
    aging_s: float
    ages_at: float  # the soonest a request that was not old enough to go first becomes so
    use: Mapping[int, float]  # each user's recent use when the order was known right
    gap: float  # the smallest gap then between the keys of neighbours of different users

    def _ages_alike(self, now: float, aging_s: float) -> bool:
        """Whether the requests old enough to go first are the same now: not when the rules
        changed, the clock went back, or a request grew old."""
        return aging_s == self.aging_s and self.sorted_at <= now < self.ages_at

    def _still(self, recent: Callable[[int], float]) -> tuple[dict[int, float], float] | None:
        """The users' use now and how much of the gap is left, if the order still stands."""
        use = {uid: recent(uid) for uid in self.use}
        if not use:
            return use, self.gap
        moved = [use[uid] - was for uid, was in self.use.items()]
        left = self.gap - (max(moved) - min(moved))
        return (use, left) if left > _GAP_MARGIN else None

    def reorder(self, queue: list[Request], now: float, aging_s: float,
                recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis] | None:
        """`queue` (in the order this basis describes, or any part of it: taking requests
        out only widens the gaps) in fair order now, and that order's basis; None when
        only sorting it again can tell."""
        if not self._ages_alike(now, aging_s):
            return None
        still = self._still(recent)
        if still is None:
            return None
        use, left = still
        return list(queue), OrderBasis(now, aging_s, self.ages_at, use, left)

    def with_newcomer(self, order: list[Request], request: Request, now: float, aging_s: float,
                      recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis] | None:
        """`order` (in fair order now: reorder()'s or the sort's, at this same moment) with
        the newcomer `request` in its place, found by bisection, and that order's basis;
        None when only sorting can tell. The place is the one a full sort of
        `order + [request]` gives."""
        if not self._ages_alike(now, aging_s) or self.sorted_at != now:
            return None
        use = dict(self.use)
        use[request.holder.uid] = recent(request.holder.uid)

        def key(r: Request) -> tuple[int, float, float]:
            return _order_key(r, now, aging_s, use.__getitem__)  # KeyError: a user not ranked

        try:
            at = bisect_right(order, key(request), key=key)
            gap = self.gap
            neighbours = (order[at - 1] if at else None, request, order[at] if at < len(order) else None)
            for before, after in pairwise(neighbours):
                if before is not None and after is not None and before.holder.uid != after.holder.uid:
                    gap = min(gap, _gap(key(before), key(after)))
        except KeyError:  # a user the sort never saw: not the order it sorted after all
            return None
        # (A gap of nothing, a tie with a neighbour of another user, is placed all the same,
        # by arrival as the sort would; the next look then sorts again.)
        ages_at = min(self.ages_at, request.since + aging_s - _AGING_MARGIN_S) if aging_s > 0 else self.ages_at
        return [*order[:at], request, *order[at:]], OrderBasis(now, aging_s, ages_at, use, gap)


def fair_order_and_basis(queue: list[Request], now: float, aging_s: float,
                         recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis]:
    used: dict[int, float] = {}

    def use(uid: int) -> float:
        if uid not in used:
            used[uid] = recent(uid)
        return used[uid]

    # Keys kept beside their requests for the gaps below (the index keeps equal keys in
    # the list's order, as a stable sort would).
    keyed = sorted(((_order_key(r, now, aging_s, use), at, r) for at, r in enumerate(queue)),
                   key=lambda entry: entry[:2])
    gap = math.inf
    for (before, _, first), (after, _, second) in pairwise(keyed):
        if first.holder.uid != second.holder.uid:
            gap = min(gap, _gap(before, after))
    ages_at = math.inf
    if aging_s > 0:
        ages_at = min((r.since + aging_s - _AGING_MARGIN_S for k, _, r in keyed if k[0]), default=math.inf)
    return [r for _, _, r in keyed], OrderBasis(now, aging_s, ages_at, used, gap)


def fair_order(queue: list[Request], now: float, aging_s: float, recent: Callable[[int], float]) -> list[Request]:
    return fair_order_and_basis(queue, now, aging_s, recent)[0]


def _names(uuids: set[str], devices: Mapping[str, Device]) -> str:
    return ", ".join(sorted(devices[u].label for u in uuids if u in devices))


def limit_reason(request: Request, reserved: Reservations, devices: Mapping[str, Device],
                 window_hours: Callable[[int, float], float]) -> str:
    """Why a policy limit holds the request back now, "" when none does. A memory share
    counts as its part of its device (brokerd/leasing/shares.py)."""
    limits, uid = request.limits, request.holder.uid
    if limits.max_leases and (count := reserved.count_of(uid)) >= limits.max_leases:
        return (f"limit max_leases={limits.max_leases} for {limits.policy}: you hold {count} leases and shares; "
                "release one first")
    held = reserved.held_by(uid)
    weight = reserved.weight_of(uid)
    if limits.max_devices and weight + request_weight(request, devices) > limits.max_devices + _SLACK:
        return (f"limit max_devices={limits.max_devices} for {limits.policy}: you hold {weight:.3g}"
                f" ({_names(held, devices)})")
    if limits.max_device_hours:
        used = window_hours(uid, limits.window_s)
        if used >= limits.max_device_hours:
            return (f"limit max_device_hours={limits.max_device_hours:g} for {limits.policy}: you used "
                    f"{used:.1f} device-hours in the last {format_duration(limits.window_s)}")
    return ""


def wait_reason(request: Request, reserved: Reservations, free: list[Device], users_ahead: int) -> str:
    """Why a request that no limit holds back still waits, in words a student can act on."""
    if reserved.blocked(request):
        return "blocked by your own leases: it starts once you release one"
    eligible = set(request.evaluation.eligible)
    kept = [d for d in free if d.uuid in eligible and not reserved.permits(d.uuid, request)]
    if kept:
        until = min(reserved.kept_until(d.uuid) or NEVER for d in kept)
        if until != NEVER:
            window = max(0.0, until - reserved.now)
            same_day = time.localtime(until)[:3] == time.localtime(reserved.now)[:3]
            at = time.strftime("%H:%M" if same_day else "%a %H:%M", time.localtime(until))
            return (f"{BACKFILL}: free devices are kept for a request ahead that starts by {at}; "
                    f"with --time under {format_duration(window)} this would start now")
        return f"fair share, {users_ahead} user{'s' if users_ahead != 1 else ''} ahead"
    if users_ahead:
        return f"fair share, {users_ahead} user{'s' if users_ahead != 1 else ''} ahead"
    return "waiting for a device to come free"

"""The queue's order and the reasons a request waits, for the lease manager.

Order (the fair queue): a request that has waited `aging_s` or longer goes ahead of every
younger one, oldest first; among the younger ones the user with the least recent use
(brokerd/leasing/fairshare.py) goes first, ties by arrival. The bound this gives: once a request
has waited `aging_s`, only requests that arrived before it can be served ahead of it, so a
stream of newcomers can hold it back for at most `aging_s` (plus the time the requests
older than it take), never for ever.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from brokerd.devices.model import Device
from brokerd.leasing.model import Request
from brokerd.leasing.reservations import NEVER, Reservations
from brokerd.leasing.shares import request_weight
from vaccel_common.units import format_duration

BACKFILL = "backfill window"  # how a wait_reason() that names a backfill window starts
_SLACK = 1e-9  # shares add up in floating point: four quarters make one device


# A request this close to turning old enough to go first is sorted again rather than
# trusted to the basis below (its age is computed as now - since, the basis adds).
_AGING_MARGIN_S = 0.001


def _aged(request: Request, at: float, aging_s: float) -> bool:
    """Whether the request is old enough at `at` to go ahead of every younger one."""
    return aging_s > 0 and at - request.since >= aging_s


def _order_key(request: Request, now: float, aging_s: float,
               use: Callable[[int], float]) -> tuple[int, float, float]:
    """Where a request stands in the fair order: the aged first by arrival, then the rest
    by their user's recent use, then by arrival."""
    if _aged(request, now, aging_s):
        return (0, request.since, request.since)
    return (1, use(request.holder.uid), request.since)


def _ranking(use: dict[int, float]) -> tuple[tuple[int, ...], ...]:
    """The users by recent use, least first; users whose use is equal side by side in
    one group (their requests then go by arrival)."""
    groups: list[list[int]] = []
    last = 0.0
    for value, uid in sorted((value, uid) for uid, value in use.items()):
        if groups and value == last:
            groups[-1].append(uid)
        else:
            groups.append([uid])
        last = value
    return tuple(tuple(group) for group in groups)


@dataclass(frozen=True)
class OrderBasis:
    """What a fair order was sorted on, besides arrival times (they never change).

    The order is the requests old enough to go first, by arrival, then one block per
    group of users in `ranking`, each block by arrival. While no request grows old and
    the rules stay, the same requests (or any of them) are in fair order again once their
    blocks follow the users' ranking now: the blocks are found by bisection and moved as
    they are, so a pump looks at a few requests instead of sorting them all (~0.9 ms of
    the daemon's CPU at 500 waiting, on the way from a release to the next grant)."""

    sorted_at: float
    aging_s: float
    ages_at: float  # the soonest a request that was not old enough to go first becomes so
    ranking: tuple[tuple[int, ...], ...]  # the users of those requests, as _ranking() groups them

    def _ages_alike(self, now: float, aging_s: float) -> bool:
        """Whether the requests old enough to go first are the same now: not when the rules
        changed, the clock went back, or a request grew old."""
        return aging_s == self.aging_s and self.sorted_at <= now < self.ages_at

    def _use(self, recent: Callable[[int], float]) -> dict[int, float]:
        """The recent use now of the users this basis ranks."""
        return {uid: recent(uid) for group in self.ranking for uid in group}

    def reorder(self, queue: list[Request], now: float, aging_s: float,
                recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis] | None:
        """`queue` (in the order this basis describes, or any part of it) in fair order
        now, and that order's basis; None when only sorting it again can tell."""
        if not self._ages_alike(now, aging_s):
            return None
        ranking = _ranking(self._use(recent))
        if ranking == self.ranking:
            return list(queue), self
        place = {group: at for at, group in enumerate(self.ranking)}
        if any(group not in place for group in ranking):
            return None  # users whose use was equal differ now, or the other way round
        # The old order's blocks, in its order: where each group's block ends.
        aged = bisect_left(queue, 1, key=lambda r: 0 if _aged(r, self.sorted_at, aging_s) else 1)
        group_of = {uid: at for at, group in enumerate(self.ranking) for uid in group}
        try:
            ends = [bisect_right(queue, at, lo=aged, key=lambda r: group_of[r.holder.uid])
                    for at in range(len(self.ranking))]
        except KeyError:  # a user the sort never saw: not the queue it sorted after all
            return None
        starts = [aged, *ends[:-1]]
        order = queue[:aged]
        for group in ranking:
            at = place[group]
            order += queue[starts[at]:ends[at]]
        return order, OrderBasis(now, aging_s, self.ages_at, ranking)

    def with_newcomer(self, order: list[Request], request: Request, now: float, aging_s: float,
                      recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis] | None:
        """`order` (in fair order now, as this basis says) with the newcomer `request` in
        its place, found by bisection, and that order's basis; None when only sorting can
        tell. The place is the one a full sort of `order + [request]` gives."""
        if not self._ages_alike(now, aging_s):
            return None
        use = self._use(recent)
        use[request.holder.uid] = recent(request.holder.uid)

        def key(r: Request) -> tuple[int, float, float]:
            return _order_key(r, now, aging_s, use.__getitem__)  # KeyError: a user not ranked

        try:
            at = bisect_right(order, key(request), key=key)
        except KeyError:  # a user the sort never saw: not the order it sorted after all
            return None
        ages_at = min(self.ages_at, request.since + aging_s - _AGING_MARGIN_S) if aging_s > 0 else self.ages_at
        return [*order[:at], request, *order[at:]], OrderBasis(now, aging_s, ages_at, _ranking(use))


def fair_order_and_basis(queue: list[Request], now: float, aging_s: float,
                         recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis]:
    used: dict[int, float] = {}
    ages_at = math.inf

    def use(uid: int) -> float:
        if uid not in used:
            used[uid] = recent(uid)
        return used[uid]

    def key(request: Request) -> tuple[int, float, float]:
        nonlocal ages_at
        position = _order_key(request, now, aging_s, use)
        if position[0] and aging_s > 0:
            ages_at = min(ages_at, request.since + aging_s - _AGING_MARGIN_S)
        return position

    order = sorted(queue, key=key)
    return order, OrderBasis(now, aging_s, ages_at, _ranking(used))


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

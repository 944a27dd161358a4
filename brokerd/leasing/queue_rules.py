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


def _aged(request: Request, at: float, aging_s: float) -> bool:
    """Whether the request is old enough at `at` to go ahead of every younger one."""
    return aging_s > 0 and at - request.since >= aging_s


def _order_key(request: Request, now: float, aging_s: float,
               use: Callable[[int], float]) -> tuple[int, float, float]:
    """Where a request stands in the fair order: the aged first by arrival, then the rest
    by their user's recent use less their wait's credit, then by arrival."""
    since = request.since
    if aging_s > 0 and now - since >= aging_s:  # _aged(), with `since` read once: a pump keys every request
        return (0, since, since)
    return (1, use(request.holder.uid) - WAIT_CREDIT * (now - since) / _HOUR, since)


def _keyed(now: float, aging_s: float, recent: Callable[[int], float]) -> Callable[[Request], tuple[int, float, float]]:
    """The order key at `now`, each user's use asked once however many requests they have."""
    used: dict[int, float] = {}

    def use(uid: int) -> float:
        if uid not in used:
            used[uid] = recent(uid)
        return used[uid]

    return lambda request: _order_key(request, now, aging_s, use)


@dataclass(frozen=True)
class OrderBasis:
    """When a fair order was sorted, and until when no request in it grows old enough to
    go first. Use and the wait's credit move every key as time passes, so an order is
    sorted again at each pump; but the queue the last pump left is nearly in order still,
    and sorting it again runs through it about once (Python's sort finds the runs), so it
    is sorted from that order, never from arrival."""

    sorted_at: float
    aging_s: float
    ages_at: float  # the soonest a request that was not old enough to go first becomes so

    def _ages_alike(self, now: float, aging_s: float) -> bool:
        """Whether the requests old enough to go first are the same now: not when the rules
        changed, the clock went back, or a request grew old."""
        return aging_s == self.aging_s and self.sorted_at <= now < self.ages_at

    def reorder(self, queue: list[Request], now: float, aging_s: float,
                recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis] | None:
        """`queue` (in the order this basis describes, or any part of it) in fair order
        now, and that order's basis; None when only sorting it afresh can tell."""
        if not self._ages_alike(now, aging_s):
            return None
        return sorted(queue, key=_keyed(now, aging_s, recent)), OrderBasis(now, aging_s, self.ages_at)

    def with_newcomer(self, order: list[Request], request: Request, now: float, aging_s: float,
                      recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis] | None:
        """`order` (in fair order now, as reorder() left it) with the newcomer `request` in
        its place, found by bisection, and that order's basis; None when only sorting can
        tell. The place is the one a full sort of `order + [request]` gives."""
        if not self._ages_alike(now, aging_s):
            return None
        key = _keyed(now, aging_s, recent)
        at = bisect_right(order, key(request), key=key)
        ages_at = min(self.ages_at, request.since + aging_s - _AGING_MARGIN_S) if aging_s > 0 else self.ages_at
        return [*order[:at], request, *order[at:]], OrderBasis(now, aging_s, ages_at)


def fair_order_and_basis(queue: list[Request], now: float, aging_s: float,
                         recent: Callable[[int], float]) -> tuple[list[Request], OrderBasis]:
    key = _keyed(now, aging_s, recent)
    ages_at = math.inf
    if aging_s > 0:
        ages_at = min((r.since + aging_s - _AGING_MARGIN_S for r in queue if not _aged(r, now, aging_s)),
                      default=math.inf)
    return sorted(queue, key=key), OrderBasis(now, aging_s, ages_at)


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

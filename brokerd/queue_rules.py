"""The queue's order and the reasons a request waits, for the lease manager.

Order (the fair queue): a request that has waited `aging_s` or longer goes ahead of every
younger one, oldest first; among the younger ones the user with the least recent use
(brokerd/fairshare.py) goes first, ties by arrival. The bound this gives: once a request
has waited `aging_s`, only requests that arrived before it can be served ahead of it, so a
stream of newcomers can hold it back for at most `aging_s` (plus the time the requests
older than it take), never for ever.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from brokerd.devices import Device
from brokerd.lease_model import Request
from brokerd.reservations import NEVER, Reservations
from vaccel_common.units import format_duration

BACKFILL = "backfill window"  # how a wait_reason() that names a backfill window starts


def fair_order(queue: list[Request], now: float, aging_s: float, recent: Callable[[int], float]) -> list[Request]:
    used: dict[int, float] = {}

    def key(request: Request) -> tuple[int, float, float]:
        if aging_s > 0 and now - request.since >= aging_s:
            return (0, request.since, request.since)
        uid = request.holder.uid
        if uid not in used:
            used[uid] = recent(uid)
        return (1, used[uid], request.since)

    return sorted(queue, key=key)


def _names(uuids: set[str], devices: Mapping[str, Device]) -> str:
    return ", ".join(sorted(f"gpu{devices[u].index}" for u in uuids if u in devices))


def limit_reason(request: Request, reserved: Reservations, devices: Mapping[str, Device],
                 window_hours: Callable[[int, float], float]) -> str:
    """Why a policy limit holds the request back now, "" when none does."""
    limits, uid = request.limits, request.holder.uid
    held = reserved.held_by(uid)
    if limits.max_devices and len(held) + request.requirement.gpus > limits.max_devices:
        return (f"limit max_devices={limits.max_devices} for {limits.policy}: you hold {len(held)}"
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

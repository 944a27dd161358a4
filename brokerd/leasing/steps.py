"""A step of the wall clock, applied to what is live: every time a live lease or a waiting
request carries moves by the step, so time limits, heartbeat TTLs and ages keep their
monotonic length (brokerd/base/clock.py says why the numbers stay wall-clock ones). Ended
leases keep the times they were recorded with."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from brokerd.leasing.model import Lease, Request


def shift(leases: Iterable[Lease], requests: Iterable[Request], by: float) -> None:
    for lease in leases:
        lease.granted_at += by
        if lease.expires_at:
            lease.expires_at += by
        if lease.last_heartbeat:
            lease.last_heartbeat += by
        if lease.requested_at:
            lease.requested_at += by
    for request in requests:
        request.since += by


def stepped(clock: Callable[[], float], steps: Callable[[], float],
            on_step: Callable[[float], None]) -> Callable[[], float]:
    """`clock`, with what lives moved by any step seen before the time is read."""
    def now() -> float:
        jump = steps()
        if jump:
            on_step(jump)
        return clock()
    return now

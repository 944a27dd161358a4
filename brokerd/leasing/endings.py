"""When and how a lease ends, as pure rules over a lease, the time and the broker's TTL
and maximum duration: the lease manager applies them (brokerd/leasing/manager.py).

A lease ends on release, on its holder's exit (or its container's), after `ttl_s` without a
heartbeat (not a reservation, whose user holds it, nor a lease a container holds), or at
`expires_at`: its time limit, else
the maximum duration, or sooner when an early end was announced (a revoke with grace, an
idle reclaim), in the state that announcement named.
"""

from __future__ import annotations

import math
import re

from brokerd.base.process import ProcessId
from brokerd.leasing.model import EXPIRED, HOLDER_EXITED, OVER_BUDGET, REVOKED, TIME_LIMIT, Lease
from vaccel_common.units import format_duration


def end_of(granted_at: float, time_limit_s: float, max_duration_s: float) -> float:
    """A lease's hard end: its time limit, else the maximum duration, else none (0)."""
    limit = time_limit_s or max_duration_s
    return granted_at + limit if limit else 0.0


def deadline(lease: Lease, ttl_s: float) -> float:
    """When the lease ends if nothing changes (inf: never)."""
    silent_at = lease.last_heartbeat + ttl_s if lease.beats else math.inf
    return min(silent_at, lease.expires_at) if lease.expires_at else silent_at


def due(lease: Lease, now: float, ttl_s: float, max_duration_s: float) -> tuple[str, str] | None:
    """The state and reason the lease ends in at `now`, None while it runs on."""
    if lease.expires_at and now >= lease.expires_at:
        return at_its_end(lease, max_duration_s)
    if lease.beats and now - lease.last_heartbeat > ttl_s:
        silent = format_duration(now - lease.last_heartbeat)
        return EXPIRED, f"no heartbeat for {silent} (TTL {format_duration(ttl_s)})"
    return None


# The future-tense tail of an early end's notice, as brokerd/core/governing.py and budgets.py
# write it: " (ends at 17:33:54)", " at 17:36:11 unless it computes", " at 17:36:11 (10s from
# now) unless it is back within its share".
_WILL_END = re.compile(r"(?: \(ends at [0-9:]+\)| at [0-9:]+(?: \([^()]* from now\))?(?: unless .*)?)$")


def past(notice: str) -> str:
    """An early end's notice as the ended lease's reason: what happened, not what will
    unless ("revoked by root: maintenance", "idle for 12m while others wait: reclaimed")."""
    return _WILL_END.sub("", notice)


def at_its_end(lease: Lease, max_duration_s: float) -> tuple[str, str]:
    """The state and reason of a lease that reached its expires_at."""
    if lease.notice:
        return lease.ending_state or REVOKED, past(lease.notice)
    if lease.time_limit_s:
        return TIME_LIMIT, f"reached its time limit of {format_duration(lease.time_limit_s)}"
    return EXPIRED, f"reached the maximum lease duration of {format_duration(max_duration_s)}"


def held_by(lease: Lease, process: ProcessId) -> bool:
    """Whether the exit of `process` ends the lease: its holder's (not a reservation's: its
    user holds it, not the process that asked), or its container's init."""
    return ((lease.holder.process == process and not lease.reservation)
            or (lease.container is not None and lease.container.init == process))


def on_exit(lease: Lease, process: ProcessId, now: float, max_duration_s: float) -> tuple[str, str]:
    """How a lease ends when its holder exits: at or after its end (the holder stopped
    because its time was up) or after being told of a revoke or of its share going over
    its budget (its client may stop on the notice a moment before the broker's timer, or
    on an end the broker has moved since), as that end; else as holder_exited. (An idle
    reclaim's holder that exits first simply finished.)"""
    if (lease.expires_at and now >= lease.expires_at) or lease.ending_state in (REVOKED, OVER_BUDGET):
        return at_its_end(lease, max_duration_s)
    if lease.container is not None and lease.container.init == process:
        return HOLDER_EXITED, f"container {lease.container.name or lease.container.id[:12]} exited"
    return HOLDER_EXITED, f"holder pid {process.pid} exited"

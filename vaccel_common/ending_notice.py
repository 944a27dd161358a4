"""When a lease's holder is warned of its coming end, the same for every holder: a `vaccel run`
or `with lease()` client (its heartbeat thread) and a container the broker warns itself
(brokerd/addons/containers/warning.py)."""

from __future__ import annotations


def warning_lead_s(time_limit: float) -> float:
    """How long before a time limit the holder is warned: a tenth of the limit, between
    1 second and 5 minutes (a 2 h job hears at 1 h 55 m, a 30 s test at 27 s)."""
    return min(300.0, max(1.0, time_limit / 10)) if time_limit else 300.0


def warn_at(expires_at: float, time_limit_s: float, notice: str) -> float:
    """When the holder of a lease that ends at `expires_at` is warned: at once (0) for an early
    end announced with a notice (a revoke with grace, an idle reclaim), else the lead before."""
    return 0.0 if notice else expires_at - warning_lead_s(time_limit_s)

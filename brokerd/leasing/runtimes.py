"""How long each user's leases really run, for planning the queue (never for ending a lease).

A lab's jobs mostly give no `--time`, so they run under the default time limit (24 h),
while most of them end within the hour. Planned by their limits alone, a request for four
devices that waits behind such leases keeps the free ones idle for a day's worth of
"could still be running", and nothing without a shorter `--time` may backfill them.

So the queue plans with a prediction, as Tsafrir, Etsion and Feitelson ("Backfilling using
system-generated predictions rather than user runtime estimates", IEEE TPDS 2007) do: a
lease is expected to run as long as the mean of its user's last two leases that ended by
themselves (at most its own limit). Where the prediction is wrong it only moves a plan:
a lease that outlives its prediction is planned by its limit again, exactly as before, and
a request's user with no history is planned by its limit. The limit still ends the lease.

In memory only, like the fair queue's recent use (brokerd/leasing/fairshare.py): after a
restart the queue plans by limits until users' leases end again.
"""

from __future__ import annotations

from collections import deque

from brokerd.leasing.model import EXPIRED, HOLDER_EXITED, RELEASED, TIME_LIMIT, Lease

# The ends that tell how long the job ran: it gave the lease back, exited, hit its limit or
# stopped heartbeating. A revoke, a lost device or an idle reclaim say what the broker did.
_SELF_ENDED = frozenset({RELEASED, HOLDER_EXITED, TIME_LIMIT, EXPIRED})
_HISTORY = 2  # the last two runs: recent behaviour, as the paper found best


class RuntimeBook:
    def __init__(self) -> None:
        self._runs: dict[int, deque[float]] = {}
        # lease id -> its planned run, fixed when it is first planned (at its grant): a
        # lease's plan does not shrink because its user's next job was short.
        self._planned: dict[str, float] = {}

    def add(self, lease: Lease) -> None:
        """An ended lease's run, when it ended by itself (a memory share says nothing about
        whole devices' jobs)."""
        self._planned.pop(lease.id, None)
        if lease.state in _SELF_ENDED and not lease.share_mib and lease.ended_at:
            self._runs.setdefault(lease.holder.uid, deque(maxlen=_HISTORY)).append(
                max(0.0, lease.ended_at - lease.granted_at))

    def run_s(self, uid: int, limit_s: float) -> float:
        """How long a lease of `uid` with time limit `limit_s` (0: none) is planned to run
        (0: by its limit, or for ever without one)."""
        runs = self._runs.get(uid)
        if not runs:
            return limit_s
        predicted = max(sum(runs) / len(runs), 1.0)
        return min(predicted, limit_s) if limit_s else predicted

    def plan(self, lease: Lease) -> float:
        """Fix a new lease's planned run from its user's history now."""
        limit_s = lease.expires_at - lease.granted_at if lease.expires_at else 0.0
        run_s = self._planned[lease.id] = self.run_s(lease.holder.uid, limit_s)
        return run_s

    def end_of(self, lease: Lease, now: float) -> float:
        """When a running lease is planned to end: its prediction, while that is still ahead;
        else its time limit's end (0: none)."""
        run_s = self._planned.get(lease.id)
        if run_s is None:  # restored at a start: planned now
            run_s = self.plan(lease)
        planned = lease.granted_at + run_s
        return planned if planned > now and planned < (lease.expires_at or float("inf")) else lease.expires_at

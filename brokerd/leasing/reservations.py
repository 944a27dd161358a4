"""Which free devices the waiting requests keep for themselves, and until when: the
lease manager's queue rule, with EASY backfill and the exceptions that stop a user from
hogging the queue.

Requests are visited in the queue's order (brokerd/leasing/queue_rules.py decides it). A
request that cannot start now keeps the devices it will start on ("its shadow"): the
devices it can use that come free first, judged by the time limits of the leases holding
them and of the requests ahead that keep them. It keeps them until that shadow time. A
later request may still take a kept device when its own time limit ends before the
shadow time (backfill): it is gone by the time the request ahead could start, so it
never delays it. A request without a time limit never
backfills, and a request whose shadow cannot be known (a lease without a time limit is
in the way) keeps its devices with no end.

A request that its own user's leases block (it could only start once that user releases
one of them), or that a policy limit holds back, keeps nothing: else a user holding 1 of
2 devices and asking for 2 would keep the free one from everyone, for as long as they
like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from brokerd.leasing.model import Lease, Request

NEVER = math.inf


class Reservations:
    """Built in queue order: `add` each request that waits, `granted` each grant made."""

    def __init__(self, leases: Iterable[Lease], *, now: float = 0.0,
                 available_at: Callable[[], Mapping[str, float]] | None = None) -> None:
        self.now = now
        self._own: dict[int, set[str]] = {}
        for lease in leases:
            self._own.setdefault(lease.holder.uid, set()).update(lease.devices)
        # uuid -> when it comes free (now for a free device, a lease's end, NEVER); asked
        # for only once a request must wait: most passes grant or find an empty queue.
        self._source = available_at
        self._known: dict[str, float] | None = None
        self._until: dict[str, float] = {}  # kept device -> until when

    @property
    def _available_at(self) -> dict[str, float]:
        if self._known is None:
            self._known = dict(self._source() if self._source is not None else {})
        return self._known

    def held_by(self, uid: int) -> set[str]:
        """The devices this user holds, grants of this pass included."""
        return self._own.get(uid, set())

    def blocked(self, request: Request) -> bool:
        own = self._own.get(request.holder.uid, set())
        usable = sum(1 for u in request.evaluation.eligible if u not in own)
        return usable < request.requirement.gpus

    def shadow(self, request: Request) -> float:
        """When the request could start at the latest, by the time limits in its way."""
        times = sorted(self._available_at.get(u, NEVER) for u in request.evaluation.eligible)
        n = request.requirement.gpus
        return times[n - 1] if len(times) >= n else NEVER

    def add(self, request: Request) -> None:
        """`request` waits: it keeps the devices it will start on, until it can start."""
        if self.blocked(request):
            return
        start = self.shadow(request)
        limit = request.ask.time_limit_s
        for uuid in request.evaluation.eligible:
            if self._available_at.get(uuid, NEVER) <= start:
                self._until[uuid] = min(self._until.get(uuid, NEVER), start)
                # Requests further back see it busy for this one's whole run.
                self._available_at[uuid] = start + limit if limit and start != NEVER else NEVER

    def permits(self, uuid: str, request: Request) -> bool:
        """Whether `request` may take this free device now."""
        until = self._until.get(uuid)
        if until is None:
            return True
        limit = request.ask.time_limit_s
        return until != NEVER and limit > 0 and self.now + limit <= until

    @property
    def keeps_nothing(self) -> bool:
        """No request ahead keeps a device: every free device may be taken."""
        return not self._until

    def kept_until(self, uuid: str) -> float | None:
        """Until when a request ahead keeps this device (None: nobody keeps it)."""
        return self._until.get(uuid)

    def granted(self, lease: Lease) -> None:
        """Later requests of the same user see this lease among their own; its devices
        come free at its end."""
        self._own.setdefault(lease.holder.uid, set()).update(lease.devices)
        if self._known is not None:  # else it is read later, with this lease in it
            for uuid in lease.devices:
                self._known[uuid] = lease.expires_at or NEVER

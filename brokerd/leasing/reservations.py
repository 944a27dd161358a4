"""Which free devices the waiting requests keep for themselves, and until when: the
lease manager's queue rule, with EASY backfill and the exceptions that stop a user from
hogging the queue.

Requests are visited in the queue's order (brokerd/leasing/queue_rules.py decides it). A
request that cannot start now keeps the devices it will start on ("its shadow"): the
devices it can use that come free first, judged by when the leases holding them and the
requests ahead that keep them are planned to end. It keeps them until that shadow time. A
later request may still take a kept device when it is planned to end before the shadow
time (backfill): it is gone by the time the request ahead could start. Plans for whole
devices come from how long users' leases really run, at most their time limits
(brokerd/leasing/runtimes.py; a lease past its plan is planned by its limit again);
a request that fits a kept window only by its prediction, not by its time limit, may take
it while its user holds at most one lease (PREDICTED_BACKFILL_HELD); shares are planned by
their limits. A request without a time limit never backfills, and
a request whose shadow cannot be known (a lease without a time limit is in the way) keeps
its devices with no end.

A request that its own user's leases block (it could only start once that user releases
one of them), or that a policy limit holds back, keeps nothing: else a user holding 1 of
2 devices and asking for 2 would keep the free one from everyone, for as long as they
like.

Memory shares (brokerd/leasing/shares.py) follow the same rule in memory: a share request
that cannot start now keeps its memory on the shared device where it fits soonest (by the
time limits of the shares there), from that shadow time. A later share may still take
memory there when it is gone by then, or when the memory still suffices at that time for
the shares that will still run, those kept ahead and itself; a later whole-device request
may take that device only when it is gone by then. A request for whole devices that waits
for a shared device keeps it whole, as any device: later shares backfill it or wait.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from brokerd.leasing.model import Lease, Request

NEVER = math.inf
# A prediction is not a promise: two short jobs teach the queue that a user's jobs are short,
# and a burst of day-long jobs would then all backfill in front of a waiting request. A
# request that fits a kept window only by its prediction may take it while its user holds
# fewer leases than this; by its own time limit, always. On 30 simulated lab days it costs
# 0.3 % of utilisation (0.751 against 0.753); one lease cost 1.5 %.
PREDICTED_BACKFILL_HELD = 2


@dataclass
class Room:
    """A shared device's memory as the queue plans it: its size, the shares on it with when
    each ends (NEVER: no limit), and when it is free of a lease holding it whole."""

    memory_mib: int
    shares: list[tuple[int, float]] = field(default_factory=list)  # (MiB, ends at)
    whole_free_at: float = 0.0


class Reservations:
    """Built in queue order: `add` each request that waits, `granted` each grant made."""

    def __init__(self, leases: Iterable[Lease], *, now: float = 0.0,
                 available_at: Callable[[], Mapping[str, float]] | None = None,
                 rooms: Callable[[], Mapping[str, Room]] | None = None,
                 run_s: Callable[[Request], float] | None = None,
                 end_of: Callable[[Lease], float] | None = None) -> None:
        self.now = now
        # How long a request for whole devices is planned to run, and when a lease granted in
        # this pass is planned to end: by predictions (brokerd/leasing/runtimes.py), else by
        # their time limits.
        self._run_s = run_s or (lambda request: request.ask.time_limit_s)
        self._end_of = end_of or (lambda lease: lease.expires_at or NEVER)
        self._own: dict[int, set[str]] = {}
        self._leases = list(leases)
        for lease in self._leases:
            self._own.setdefault(lease.holder.uid, set()).update(lease.devices)
        self._weights: dict[int, float] | None = None  # summed only when a limit asks (weight_of)
        self._counts: dict[int, int] = {}  # ... and the leases counted with them
        # uuid -> when it comes free (now for a free device, a lease's end, NEVER); asked
        # for only once a request must wait: most passes grant or find an empty queue.
        self._source = available_at
        self._known: dict[str, float] | None = None
        self._until: dict[str, float] = {}  # kept device -> until when
        self._rooms_source = rooms  # the shared devices' memory, asked for as lazily
        self._rooms: dict[str, Room] | None = None
        self._kept_mib: dict[str, int] = {}  # shared device -> memory kept by share requests ahead
        self._mib_until: dict[str, float] = {}  # ... from when the first of them starts

    @property
    def _available_at(self) -> dict[str, float]:
        if self._known is None:
            self._known = dict(self._source() if self._source is not None else {})
        return self._known

    @property
    def rooms(self) -> dict[str, Room]:
        if self._rooms is None:
            source = self._rooms_source() if self._rooms_source is not None else {}
            self._rooms = {u: Room(r.memory_mib, list(r.shares), r.whole_free_at) for u, r in source.items()}
        return self._rooms

    def held_by(self, uid: int) -> set[str]:
        """The devices this user holds (whole or a share of), grants of this pass included."""
        return self._own.get(uid, set())

    def weight_of(self, uid: int) -> float:
        """How many devices this user holds, a share as its part of its device."""
        if self._weights is None:
            self._weights = {}
            for lease in self._leases:
                self._weights[lease.holder.uid] = self._weights.get(lease.holder.uid, 0.0) + lease.weight
                self._counts[lease.holder.uid] = self._counts.get(lease.holder.uid, 0) + 1
        return self._weights.get(uid, 0.0)

    def count_of(self, uid: int) -> int:
        """How many leases this user holds, whole devices and shares alike."""
        self.weight_of(uid)
        return self._counts.get(uid, 0)

    def blocked(self, request: Request) -> bool:
        if request.ask.memory_mib:
            return False  # other users' shares end too: a share waits for memory, not for its user
        own = self._own.get(request.holder.uid, set())
        usable = sum(1 for u in request.evaluation.eligible if u not in own)
        return usable < request.requirement.gpus

    def shadow(self, request: Request) -> float:
        """When the request could start at the latest, by the time limits in its way."""
        times = sorted(self._available_at.get(u, NEVER) for u in request.evaluation.eligible)
        n = request.requirement.gpus
        return times[n - 1] if len(times) >= n else NEVER

    def fits_at(self, uuid: str, need: int) -> float:
        """When `need` MiB could be had on shared device `uuid`, by the time limits in the
        way, after what requests ahead keep there (NEVER: not in a time that is known)."""
        room = self.rooms.get(uuid)
        if room is None:
            return NEVER
        start = room.whole_free_at
        if uuid in self._until:  # kept whole for a request ahead: free of it after its run
            start = max(start, self._available_at.get(uuid, NEVER))
        if start == NEVER:
            return NEVER
        free = room.memory_mib - self._kept_mib.get(uuid, 0)
        running = sorted((end, mib) for mib, end in room.shares if end > start)
        used = sum(mib for _, mib in running)
        if free - used >= need:
            return start
        for end, mib in running:
            used -= mib
            if free - used >= need:
                return end
        return NEVER

    def _add_share(self, request: Request) -> None:
        need = request.ask.memory_mib
        times = {u: self.fits_at(u, need) for u in request.evaluation.eligible if u in self.rooms}
        if not times:
            return
        uuid = min(times, key=lambda u: (times[u], u))
        start, limit = times[uuid], request.ask.time_limit_s
        self._kept_mib[uuid] = self._kept_mib.get(uuid, 0) + need
        self._mib_until[uuid] = min(self._mib_until.get(uuid, NEVER), start)
        # Requests for whole devices further back see it busy until this share's end too.
        end = start + limit if limit and start != NEVER else NEVER
        self._available_at[uuid] = max(self._available_at.get(uuid, self.now), end)

    def add(self, request: Request) -> None:
        """`request` waits: it keeps the devices it will start on, until it can start."""
        if request.ask.memory_mib:
            self._add_share(request)
            return
        if self.blocked(request):
            return
        start = self.shadow(request)
        limit = self._run_s(request)
        for uuid in request.evaluation.eligible:
            if self._available_at.get(uuid, NEVER) <= start:
                self._until[uuid] = min(self._until.get(uuid, NEVER), start)
                # Requests further back see it busy for this one's whole run.
                self._available_at[uuid] = start + limit if limit and start != NEVER else NEVER

    def permits(self, uuid: str, request: Request) -> bool:
        """Whether `request` may take this free device (or memory on it, for a share) now."""
        limit = request.ask.time_limit_s if request.ask.memory_mib else self._run_s(request)
        ends = self.now + limit if limit > 0 else NEVER
        until = self._until.get(uuid)
        if until is not None:
            if not (until != NEVER and ends <= until):
                return False
            if not self._fits_by_limit(request, until) and self.count_of(request.holder.uid) >= PREDICTED_BACKFILL_HELD:
                return False  # it fits only by its prediction, and its user holds enough already
        share_starts = self._mib_until.get(uuid)
        if share_starts is None or (share_starts != NEVER and ends <= share_starts):
            return True
        if not request.ask.memory_mib or share_starts == NEVER:
            return False  # it would keep the share ahead from starting
        room = self.rooms[uuid]
        then = sum(mib for mib, end in room.shares if end > share_starts)
        return room.memory_mib - then - self._kept_mib[uuid] >= request.ask.memory_mib

    def _fits_by_limit(self, request: Request, until: float) -> bool:
        """Whether the request's time limit itself ends it by `until` (not only its prediction)."""
        limit = request.ask.time_limit_s
        return bool(limit) and self.now + limit <= until

    @property
    def keeps_nothing(self) -> bool:
        """No request ahead keeps a device: every free device may be taken."""
        return not self._until and not self._mib_until

    def kept_until(self, uuid: str) -> float | None:
        """Until when a request ahead keeps this device (None: nobody keeps it)."""
        times = [t for t in (self._until.get(uuid), self._mib_until.get(uuid)) if t is not None]
        return min(times) if times else None

    def granted(self, lease: Lease) -> None:
        """Later requests of the same user see this lease among their own; its devices
        come free at its end."""
        self._own.setdefault(lease.holder.uid, set()).update(lease.devices)
        if self._weights is None:
            self._leases.append(lease)  # summed with the others when first asked
        else:
            self._weights[lease.holder.uid] = self._weights.get(lease.holder.uid, 0.0) + lease.weight
            self._counts[lease.holder.uid] = self._counts.get(lease.holder.uid, 0) + 1
        end = (lease.expires_at or NEVER) if lease.share_mib else self._end_of(lease)
        if self._known is not None:  # else it is read later, with this lease in it
            for uuid in lease.devices:
                self._known[uuid] = max(self._known.get(uuid, self.now), end) if lease.share_mib else end
        if self._rooms is not None and lease.share_mib and lease.devices[0] in self._rooms:
            self._rooms[lease.devices[0]].shares.append((lease.share_mib, end))

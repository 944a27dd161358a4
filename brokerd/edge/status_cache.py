"""The Status reply, built once and served to every poller until something it shows
changes (or it is a second old: time left and fair-share use move with the clock).

Twenty students' `watch vaccel status` and the dashboard ask every second; building the
reply for 64 devices and 500 waiters costs milliseconds each time, and the answer is
nearly the same for everyone, so each picture is built at most once per change or per
second. What counts as a change is read from the service's state, not announced by it,
so a path that forgets to announce cannot serve a stale picture.

The pictures differ only in the rows of use against the limits (BrokerService.usage_seen_by):
admins see everyone's, anyone else only their own (issue 31: device-hours are other users'
history). So there is one picture for those who see all, one per user who holds or waits
for something, and one shared by every other user (who has no row to see).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from brokerd.base.process import Identity
from brokerd.core.service import BrokerService
from vaccel_common.v1 import broker_pb2 as pb

MAX_AGE_S = 1.0


def fingerprint(service: BrokerService) -> Hashable:
    """Everything the reply shows that can change without the clock moving."""
    manager = service.manager
    return (
        id(service.snapshot), id(service.config), id(service.occupancy),
        tuple((lease.id, lease.expires_at, lease.notice, lease.holder.pid) for lease in manager.leases.values()),
        tuple((request.id, request.reason) for request in manager.queue),
        tuple(manager.drained.items()), tuple(manager.unavailable.items()), len(manager.ended),
        service.allocator.version() if service.allocator is not None else None,
        tuple((stop.id, stop.at) for stop in service.holds.stopped()),
    )


def view_of(service: BrokerService, identity: Identity) -> Hashable:
    """Which picture `identity` gets: "all", their uid, or "none" (no row of theirs to see)."""
    only = service.usage_seen_by(identity)
    if only is None:
        return "all"
    manager = service.manager
    involved = any(lease.holder.uid == only for lease in manager.leases.values()) or \
        any(request.holder.uid == only for request in manager.queue)
    return only if involved else "none"


class StatusCache:
    MAX_PICTURES = 64  # distinct pictures kept between changes; past that, start again

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._key: Hashable = None
        self._replies: dict[Hashable, tuple[pb.StatusReply, float]] = {}

    def reply(self, service: BrokerService, identity: Identity, build: Callable[[], pb.StatusReply]) -> pb.StatusReply:
        key, view, now = fingerprint(service), view_of(service, identity), self._clock()
        if key != self._key or len(self._replies) >= self.MAX_PICTURES:
            self._replies.clear()
            self._key = key
        cached = self._replies.get(view)
        if cached is None or now - cached[1] >= MAX_AGE_S:
            cached = self._replies[view] = (build(), now)
        return cached[0]

"""The Status reply, built once and served to every poller until something it shows
changes (or it is a second old: time left and fair-share use move with the clock).

Twenty students' `watch vaccel status` and the dashboard ask every second; building the
reply for 64 devices and 500 waiters costs milliseconds each time, and the answer is the
same for everyone (Status shows every user the same picture), so it is built at most once
per change or per second. What counts as a change is read from the service's state, not
announced by it, so a path that forgets to announce cannot serve a stale picture.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from brokerd.core.service import BrokerService
from vaccel_common.v1 import broker_pb2 as pb

MAX_AGE_S = 1.0


def fingerprint(service: BrokerService) -> Hashable:
    """Everything the reply shows that can change without the clock moving."""
    manager = service.manager
    return (
        id(service.snapshot), id(service.config), id(service.occupancy),
        tuple((lease.id, lease.expires_at, lease.notice) for lease in manager.leases.values()),
        tuple((request.id, request.reason) for request in manager.queue),
        tuple(manager.drained.items()), tuple(manager.unavailable.items()), len(manager.ended),
        service.allocator.version() if service.allocator is not None else None,
    )


class StatusCache:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._key: Hashable = None
        self._built_at = 0.0
        self._reply: pb.StatusReply | None = None

    def reply(self, service: BrokerService, build: Callable[[], pb.StatusReply]) -> pb.StatusReply:
        key = fingerprint(service)
        now = self._clock()
        if self._reply is None or key != self._key or now - self._built_at >= MAX_AGE_S:
            self._reply, self._key, self._built_at = build(), key, now
        return self._reply

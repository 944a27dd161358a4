"""Lease expiry: the loop that ends leases at their deadlines (TTL without heartbeat, time
limit, an announced early end) and looks at the queue again now and then (a user's use
slides out of the limits' window with time alone)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from brokerd.base.clock import wall
from brokerd.core.tasks import Tasks, logged
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Lease

# How often the queue is looked at again with nothing else happening.
_LOOK_AGAIN_S = 30.0


class Expiry:
    def __init__(self, manager: LeaseManager, *, tasks: Tasks,
                 record_end: Callable[[Lease], asyncio.Future[None]], pump_soon: Callable[[], None]) -> None:
        self.manager = manager
        self.tasks = tasks
        self._record_end = record_end
        self._pump_soon = pump_soon
        self._wakeup = asyncio.Event()
        self._due = 0.0  # when the loop wakes by itself (0: it is awake)
        self._looked_at = 0.0

    def start(self) -> None:
        self.tasks.spawn(self._expire_forever(), name="expiry")

    def wake(self) -> None:
        """Look again now (a reload may have shortened the TTL or the maximum duration)."""
        self._wakeup.set()

    def expire_by(self, at: float) -> None:
        """Something may end at `at` (unix time): wake the loop if it sleeps past that.
        Most news ends later (a grant's first deadline is a TTL away), and waking the loop
        for it read every lease twice for nothing."""
        if at < self._due:
            self._wakeup.set()

    async def _expire_forever(self) -> None:
        while True:
            saving = [self._record_end(lease) for lease in self.manager.expire()]
            for saved in saving:
                await logged(saved)
            deadline = self.manager.next_deadline()
            delay = 60.0 if deadline is None else max(0.05, deadline - wall() + 0.01)
            if self.manager.queue:
                delay = min(delay, _LOOK_AGAIN_S)
                if wall() - self._looked_at >= _LOOK_AGAIN_S:
                    self._looked_at = wall()
                    self._pump_soon()
            self._wakeup.clear()
            self._due = wall() + delay
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), delay)
            self._due = 0.0  # awake: what changes now is read before the next sleep

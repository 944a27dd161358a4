"""The timers and the inventory of BrokerService (a mixin, like brokerd/core/queueing.py):
the loop that ends leases at their deadlines and looks at the queue again, and the
adoption of each fresh probe (devices held back, leases on lost devices ended, idle
reclaim)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from brokerd.base.journal import log_event
from brokerd.devices.model import Snapshot
from brokerd.devices.watch import occupancy_of

if TYPE_CHECKING:
    from brokerd.core.service import BrokerService

# How often the queue is looked at again with nothing else happening (a user's use slides
# out of the max_device_hours window with time alone).
_LOOK_AGAIN_S = 30.0


class Timers:
    async def _expiry_loop(self: BrokerService) -> None:
        while True:
            saving = [self._record_end(lease) for lease in self.manager.expire()]
            for saved in saving:
                await self._logged(saved)
            deadline = self.manager.next_deadline()
            delay = 60.0 if deadline is None else max(0.05, deadline - time.time() + 0.01)
            if self.manager.queue:
                # Use slides out of the limits' window with time alone: look again.
                delay = min(delay, _LOOK_AGAIN_S)
                if time.time() - self._looked_at >= _LOOK_AGAIN_S:
                    self._looked_at = time.time()
                    self._spawn(self._pump())
            self._expiry_wakeup.clear()
            self._expiry_due = time.time() + delay
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._expiry_wakeup.wait(), delay)
            self._expiry_due = 0.0  # awake: what changes now is read before the next sleep

    def _expire_by(self: BrokerService, at: float) -> None:
        """Something may end at `at` (unix time): wake the expiry loop if it sleeps past
        that. Most news ends later (a grant's first deadline is a TTL away), and waking
        the loop for it read every lease twice for nothing."""
        if at < self._expiry_due:
            self._expiry_wakeup.set()

    def apply_snapshot(self: BrokerService, snapshot: Snapshot) -> None:
        """Adopt a fresh probe: grant what it freed, tell the systemd status line."""
        before = (self.manager.devices.keys(), dict(self.manager.unavailable))
        self._set_inventory(snapshot)
        if before != (self.manager.devices.keys(), self.manager.unavailable):
            log_event("inventory", f"devices now: {self.summary()}")
            self._spawn(self._pump())
            self.on_change()
        if self.config.unleased_processes == "signal":
            self._unleased.signal(self.occupancy, self.config.unleased_grace_s)
        self.reclaim_idle()

    def _set_inventory(self: BrokerService, snapshot: Snapshot) -> None:
        """Adopt a snapshot: hold back unhealthy devices and devices used without a lease
        (allocation fails closed), end leases on lost devices."""
        self.snapshot = snapshot
        self.occupancy, unavailable = occupancy_of(snapshot, self.manager.leases.values(), self.config.enforce_mode)
        for lost in self.manager.set_inventory(snapshot.devices, unavailable):
            self._spawn(self._logged(self._record_end(lost)))

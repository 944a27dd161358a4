"""The wall clock's steps, for the lease manager (which moves every live lease's times by
each step: brokerd/leasing/steps.py), and the moved times put on disk, so that a restart
after a step restores the limits as they run now (docs/durability.md "A wall-clock step")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from brokerd.base.clock import StepWatch
from brokerd.leasing.model import Lease
from brokerd.state.store import LeaseStore

log = logging.getLogger(__name__)


class FollowedSteps:
    def __init__(self, store: LeaseStore, leases: Callable[[], Iterable[Lease]]) -> None:
        self._watch = StepWatch()
        self._store, self._leases = store, leases

    def __call__(self) -> float:
        jump = self._watch.step()
        if jump:
            # Called as the manager reads the clock, before it moves the times: saved once
            # they have moved, in the loop's next turn.
            with contextlib.suppress(RuntimeError):  # no loop (a test's manager): nothing to save
                asyncio.get_running_loop().call_soon(self._save)
        return jump

    def _save(self) -> None:
        leases = list(self._leases())
        if leases:
            self._store.save_times(leases).add_done_callback(self._saved)

    @staticmethod
    def _saved(done: asyncio.Future[None]) -> None:
        if done.cancelled():
            return
        if done.exception() is not None:
            # Not fatal: a restart then restores the times from before the step.
            log.error("could not record the leases' times after a wall-clock step: %s", done.exception())
        else:
            log.info("the leases' times after the wall-clock step are on disk")

"""The core's background work: tasks nobody awaits (commits of ends, a pump after a
change, a restored request's reattach grace), kept so that shutting down cancels them,
and whether the broker is shutting down (a stream cut by the shutdown is no client
leaving: its request keeps its place on disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("vaccel.brokerd")


class Tasks:
    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[Any]] = []
        self.stopping = False  # shutting down: streams closing now are not clients leaving

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run `coro` in the background until it ends or the core closes."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
        return task

    def keep(self, saved: asyncio.Future[None], what: str = "the end of a lease") -> None:
        """Await a commit nobody waits for, in the background (`logged`)."""
        self.spawn(logged(saved, what))

    async def close(self) -> None:
        """Cancel every task and wait for each to finish."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def logged(saved: asyncio.Future[None], what: str = "the end of a lease") -> None:
    """Await a commit nobody waits for; a failure is logged, naming `what` was lost."""
    try:
        await saved
    except Exception as exc:
        log.error("could not record %s: %s", what, exc)

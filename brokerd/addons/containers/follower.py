"""The broker follows its engines (docs/containers.md, "Containers after their lease"): each
rootful engine it asks (`[containers] docker`, `podman`) is followed through its event
stream (`GET /events`, container `start` and `restart`), and every container that starts is
judged (verdict.py) and, if it must not run, stopped at once, as at a lease's end.

That covers every way a stopped container comes back: `docker start` the next morning,
`docker restart`, a restart policy. An engine restart closes the stream: the follower
connects again (at once, then backing off to `RETRY_MAX_S`) and, as at every connect, first
looks at every running container, so one that the engine's own start brought back (a
`--restart always` container, before the API answers) is judged too. The broker's own start
is such a connect: what started while it was down is judged then.

The stream is opened before the running containers are listed: a container that starts
between the two is reported by the stream, so none is missed. An idle stream costs nothing
but an open socket: the loop wakes only when the engine writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from brokerd.addons.containers.engine import EngineClient
from brokerd.addons.containers.info import ContainerInfo, EngineError

log = logging.getLogger("vaccel.brokerd")

ACTIONS = ("start", "restart", "rename")
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0

# (the container, its image's labels, what brought it to the broker's eyes) -> nothing; it
# judges and stops (the guard's `judge`). A rename is told (`renamed`) and not judged.
Judge = Callable[[EngineClient, ContainerInfo, dict[str, str], str], Awaitable[None]]
Renamed = Callable[[ContainerInfo], None]


class Follower:
    """One engine's event stream, followed until `close`."""

    def __init__(self, engine: EngineClient, judge: Judge, renamed: Renamed) -> None:
        self.engine = engine
        self._judge = judge
        self._renamed = renamed
        self._task: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[None]] = set()
        self.connected = asyncio.Event()  # set while the stream is open and the reconcile is done
        self.events_seen = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow())

    async def close(self) -> None:
        for task in [self._task, *self._checks]:
            if task is not None:
                task.cancel()
        self._task = None

    async def _follow(self) -> None:
        delay, down_since = RETRY_FIRST_S, 0.0
        while True:
            try:
                async for action, container in self.engine.events(ACTIONS):
                    if container:
                        self.events_seen += 1
                        self._check(container, "renamed" if action == "rename" else "started")
                        continue
                    if down_since:
                        log.warning("containers: following %s again (its events were lost for %.1fs); "
                                    "looking at its running containers", self.engine.engine, time.time() - down_since)
                    delay, down_since = RETRY_FIRST_S, 0.0
                    looked = [self._check(running, "running when the broker began to follow its engine")
                              for running in await self.engine.running()]
                    self._watch(self._reconciled(looked))
                    self.connected.set()
            except EngineError as exc:
                if not down_since:
                    log.warning("containers: cannot follow %s's events (%s); trying again", self.engine.engine, exc)
                    down_since = time.time()
            except Exception:  # a bug here must not end the following for good
                log.exception("containers: following %s", self.engine.engine)
                down_since = down_since or time.time()
            self.connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    def _check(self, container: str, how: str) -> asyncio.Task[None]:
        # Each container on a task of its own: a stop waits out a grace, the stream must not.
        return self._watch(self._judged(container, how))

    def _watch(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)  # type: ignore[arg-type]
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)
        return task

    async def _reconciled(self, looked: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*looked, return_exceptions=True)
        log.info("containers: following %s's events; the %d containers running as it connected are judged",
                 self.engine.engine, len(looked))

    async def _judged(self, container: str, how: str) -> None:
        try:
            info = await self.engine.inspect(container)
            if info is not None and how == "renamed":
                self._renamed(info)
                return
            if info is None or not info.running:
                return
            await self._judge(self.engine, info, await self.engine.image_labels(info.image_id), how)
        except EngineError as exc:
            log.warning("containers: %s", exc)
        except Exception:
            log.exception("containers: judging container %s", container[:12])

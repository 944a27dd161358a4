"""The start guard: what the broker does with the containers its engines report starting
(follower.py follows the streams, verdict.py says which must not run). A container that must
not run is stopped at once, as at a lease's end (SIGTERM, SIGKILL after `[containers]
stop_grace`); the journal (`container_stop`) and `vaccel status` say which, why, and how to
run it again under a lease (`vaccel run -- docker start -a NAME`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from brokerd.addons.containers.info import ContainerInfo, EngineError
from brokerd.addons.containers.membership import USER_LABEL, Containers
from brokerd.addons.containers.verdict import own_lease_label, why_stop
from brokerd.base.journal import log_event
from brokerd.core.plugins import ContainerStopped

if TYPE_CHECKING:
    from brokerd.addons.containers.engine import EngineClient
    from brokerd.addons.containers.follower import Follower

KEPT = 20  # the last stops `vaccel status` shows
SHOWN_FOR_S = 24 * 3600.0
log = logging.getLogger("vaccel.brokerd")


class StartGuard:
    def __init__(self, service: Any) -> None:
        self._service = service  # a BrokerService, typed loosely as in keeper.py
        self._followers: list[Follower] = []
        self._stopping: set[str] = set()
        self._stopped: deque[ContainerStopped] = deque(maxlen=KEPT)
        self.let_start: dict[str, str] = {}  # container id -> the live lease it may start under
        self.names: dict[str, str] = {}  # container id -> name, as last seen (`vaccel status`'s busy_by)

    @property
    def followers(self) -> list[Follower]:
        return list(self._followers)

    async def follow(self, engines: Containers | None) -> None:
        """Follow these engines (None: none), instead of those followed so far."""
        await self.close()
        if engines is None:
            return
        from brokerd.addons.containers.follower import Follower  # aiohttp: only with an engine configured

        self._followers = [Follower(engine, self.judge, self.renamed) for engine in engines.engines]
        for follower in self._followers:
            follower.start()

    async def close(self) -> None:
        followers, self._followers = self._followers, []
        for follower in followers:
            await follower.close()

    def renamed(self, info: ContainerInfo) -> None:
        """`docker rename`: the lease it holds, if any, shows the new name."""
        self.names[info.id] = info.name
        self._service.holds.renamed(info.id, info.name)

    def name_of(self, container_id: str) -> str:
        """The container's name as last seen starting or renamed, else its short id."""
        return self.names.get(container_id) or container_id[:12]

    def forget(self, lease_id: str) -> None:
        """The lease ended: a container it was let start is judged by its label again."""
        for container in [c for c, lease in self.let_start.items() if lease == lease_id]:
            del self.let_start[container]

    def stopped(self) -> list[ContainerStopped]:
        """The containers stopped for starting outside a live lease, the last day's, newest last."""
        since = time.time() - SHOWN_FOR_S
        return [stop for stop in self._stopped if stop.at >= since]

    async def judge(self, engine: EngineClient, info: ContainerInfo, image_labels: dict[str, str], how: str) -> None:
        manager = self._service.manager
        if len(self.names) > 4096:  # a name per container seen: bounded on a host that makes many
            self.names.clear()
        self.names[info.id] = info.name
        # A live lease's confirmed container is that lease's whatever its label (one started again
        # under it, after a broker restart too: `let_start` is not kept, the lease's container is).
        confirmed = {lease.container.id: lease.id for lease in manager.leases.values() if lease.container is not None}
        reason = why_stop(info, image_labels, manager.leases, manager.ended, list(manager.devices.values()),
                          {**self.let_start, **confirmed})
        if not reason or info.id in self._stopping:
            return
        self._stopping.add(info.id)
        name = info.name or info.id[:12]
        lease_id = own_lease_label(info.labels, image_labels)
        user = info.labels.get(USER_LABEL, "") if lease_id else ""
        grace = self._service.config.containers_stop_grace_s
        again = f"`vaccel run -- {engine.engine} start -a {name}` runs it again under a new lease of its devices"
        try:
            stopped = await engine.stop(info.id, grace)
        except EngineError as exc:
            log_event("container_stop", f"{engine.engine} container {name} {how} and {reason}, but could not be "
                      f"stopped: {exc}", lease_id=lease_id, user=user, level=logging.ERROR)
            return
        finally:
            self._stopping.discard(info.id)
        if not stopped:
            return  # it stopped by itself meanwhile
        self._stopped.append(ContainerStopped(engine.engine, info.id, info.name, info.image, reason, time.time(),
                                              lease_id, user))
        log_event("container_stop", f"{engine.engine} container {name} {how} and {reason}: stopped it (SIGTERM, "
                  f"SIGKILL after {grace:g}s); {again}", lease_id=lease_id, user=user)
        self._service.changes.changed()

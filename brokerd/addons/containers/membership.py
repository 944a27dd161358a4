"""Whether a process or a container belongs to a lease, and stopping that container: decided
only on what an engine (rootful) or the kernel (rootless) says, never on a client's word.

Rootful (Docker, podman as root; `[containers] docker`, `podman` name their API sockets):
- `container_of(pid)`: the process's cgroup names a container id (brokerd/addons/containers/locate.py),
  an engine the broker was configured to ask knows a running container by that id, and the
  process shares that container init's pid namespace. A cgroup path alone is not enough: the
  namespace is what runc put the process in.
- `lease_container_of(pid, lease)`: that, and the container carries `org.vaccel.lease=LEASE`.
  A process in any other container, or on the host, gets None: processes in a Docker container
  run as uid 0 on the host, so their uid says nothing about whose they are.
- `named_container(id, lease, user)`: the container a client names (the id its engine wrote to
  `--cidfile`), when the engine says it carries the lease's and the user's labels and runs, and
  the kernel shows its init in that container's cgroup. A client that names some other process
  or container gets None, so nothing of it is watched or stopped.

Rootless podman (cgroup v1: no cgroup per container; its API socket is the user's own, so its
answers are the user's word): `RootlessContainer.of(pid, uid)` is the init of the pid namespace
the process runs in, when the kernel shows both as that uid's own processes. The broker may
signal it: the user could themselves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from brokerd.addons.containers import locate
from brokerd.addons.containers.info import ContainerInfo, EngineError
from brokerd.base.procinfo import PROC, process_info

if TYPE_CHECKING:
    from brokerd.addons.containers.engine import EngineClient

LEASE_LABEL = "org.vaccel.lease"
USER_LABEL = "org.vaccel.user"
DEVICES_LABEL = "org.vaccel.devices"  # the leased UUIDs it was made with (client/vaccel/containers/argv.py)
_FULL_ID = re.compile(r"[0-9a-f]{64}")
START_WAIT_S = 5.0  # a container created and not yet started: how long to wait for its start
log = logging.getLogger("vaccel.brokerd")


class Containers:
    """The engines the broker may ask, and what it decides with their answers."""

    def __init__(self, engines: Sequence[EngineClient], proc_root: Path = PROC) -> None:
        self.engines = tuple(engines)
        self.proc_root = proc_root

    @classmethod
    def configured(cls, docker: str, podman: str) -> Containers | None:
        """From `[containers] docker` and `podman` (sockets, "" = none); None when both are ""
        (and aiohttp, which the engine client needs, is then not imported)."""
        if not docker and not podman:
            return None
        from brokerd.addons.containers.engine import EngineClient

        return cls([EngineClient(name, socket) for name, socket in (("docker", docker), ("podman", podman)) if socket])

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()

    async def _inspect(self, engine: EngineClient, container: str) -> ContainerInfo | None:
        try:
            return await engine.inspect(container)
        except EngineError as exc:
            log.warning("containers: %s", exc)
            return None

    async def container_of(self, pid: int) -> ContainerInfo | None:
        """The running container `pid` is in, confirmed by its engine and the kernel; None when
        it is in none, the engine does not know it, or the engine cannot be asked."""
        ref = locate.container_of(pid, self.proc_root)
        if ref is None:
            return None
        for engine in self.engines:
            if ref.engine and engine.engine != ref.engine:
                continue
            info = await self._inspect(engine, ref.id)
            if info is not None and info.id == ref.id:
                if info.running and info.pid and locate.same_pid_namespace(pid, info.pid, self.proc_root):
                    return info
                return None
        return None

    async def described(self, container: str) -> ContainerInfo | None:
        """The container as the first engine that knows it describes it, whatever its state."""
        for engine in self.engines:
            info = await self._inspect(engine, container)
            if info is not None:
                return info
        return None

    async def lease_container_of(self, pid: int, lease_id: str) -> ContainerInfo | None:
        """The container of lease `lease_id` that `pid` runs in; None for any other process."""
        info = await self.container_of(pid)
        return info if info is not None and info.labels.get(LEASE_LABEL) == lease_id else None

    async def named_container(self, container: str, lease_id: str, user: str,
                              relabelled: bool = False) -> ContainerInfo | None:
        """The container a client names, when it is lease `lease_id`'s (started by `user`) and
        running, with its init in that container's cgroup; None otherwise. Only a full id is
        looked up: an engine takes a short prefix or a name too, which could match another.
        `relabelled`: the lease was let start it (`vaccel run -- docker start`), so it carries
        an older lease's label; its user's label must still be `user`."""
        if not _FULL_ID.fullmatch(container):
            return None
        for engine in self.engines:
            info = await self._inspect(engine, container)
            if info is None:
                continue
            labelled = ((relabelled or info.labels.get(LEASE_LABEL) == lease_id)
                        and info.labels.get(USER_LABEL) == user)
            ref = locate.container_of(info.pid, self.proc_root) if info.running and info.pid else None
            return info if labelled and ref is not None and ref.id == info.id else None
        return None

    async def started(self, container: str, timeout_s: float) -> None:
        """Return once no engine knows `container` as created and not yet started (the engine
        writes its --cidfile at create, a moment before the start), or after `timeout_s`."""
        if not _FULL_ID.fullmatch(container):
            return
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            infos = [await self._inspect(engine, container) for engine in self.engines]
            if not any(info is not None and info.status == "created" for info in infos):
                return
            await asyncio.sleep(0.05)

    async def lease_containers(self, lease_id: str, user: str) -> list[ContainerInfo]:
        """Every running container of lease `lease_id` started by `user`, as `named_container`
        confirms each: those the engines list with the lease's label, whether or not a client
        named them (one started as its lease ended, before it could: one created and starting
        is waited for, up to `START_WAIT_S`)."""
        found = []
        for engine in self.engines:
            try:
                ids = await engine.labelled(f"{LEASE_LABEL}={lease_id}")
            except EngineError as exc:
                log.warning("containers: %s", exc)
                continue
            for container in ids:
                await self.started(container, START_WAIT_S)
                info = await self.named_container(container, lease_id, user)
                if info is not None:
                    found.append(info)
        return found

    async def image_labels(self, info: ContainerInfo) -> dict[str, str]:
        """The labels of the container's image, as the engine that described it has them."""
        engine = next((e for e in self.engines if e.engine == info.engine), None)
        try:
            return await engine.image_labels(info.image_id) if engine is not None else {}
        except EngineError as exc:
            log.warning("containers: %s", exc)
            return {}

    async def stop(self, info: ContainerInfo, grace_s: float) -> bool:
        """Stop a container found above, through the engine that described it (SIGTERM, then
        SIGKILL after the grace); False when it had already stopped. Raises EngineError."""
        engine = next((e for e in self.engines if e.engine == info.engine), None)
        if engine is None:
            raise EngineError(f"no {info.engine} engine configured to stop {info.name or info.id}")
        return await engine.stop(info.id, grace_s)


@dataclass(frozen=True)
class RootlessContainer:
    """The init of a rootless container, held by a pidfd so that a reused pid is never signalled."""

    pid: int
    uid: int
    pidfd: int

    @classmethod
    def of(cls, pid: int, uid: int, proc_root: Path = PROC) -> RootlessContainer | None:
        """The container init of a process of `uid`'s, when the kernel shows the process and the
        init both as that uid's; None for a process in the broker's own pid namespace, another
        user's, or one that is gone. Close it (`close`) when done."""
        init = locate.namespace_init(pid, proc_root)
        return None if init is None else cls._held(pid, init, uid, proc_root)

    @classmethod
    def of_init(cls, pid: int, uid: int, proc_root: Path = PROC) -> RootlessContainer | None:
        """As `of`, for a pid its caller names as the container's init: it must be the init of
        its own pid namespace (brokerd/addons/containers/locate.py is_namespace_init), which its
        own /proc entries say, with no look through every process."""
        return cls._held(pid, pid, uid, proc_root) if locate.is_namespace_init(pid, proc_root) else None

    @classmethod
    def _held(cls, pid: int, init: int, uid: int, proc_root: Path) -> RootlessContainer | None:
        if not _owned_by(pid, uid, proc_root) or not _owned_by(init, uid, proc_root):
            return None
        try:
            pidfd = os.pidfd_open(init)
        except OSError:
            return None
        if not _owned_by(init, uid, proc_root):  # the pid was reused between the look and the open
            os.close(pidfd)
            return None
        return cls(init, uid, pidfd)

    def close(self) -> None:
        os.close(self.pidfd)

    async def stop(self, grace_s: float) -> bool:
        """SIGTERM to the init, SIGKILL after `grace_s` if it is still there (the kernel then ends
        every process of the namespace). True once it is gone; False when it already was."""
        if not _send(self.pidfd, signal.SIGTERM):
            return False
        if not await _exited(self.pidfd, grace_s):
            _send(self.pidfd, signal.SIGKILL)
            await _exited(self.pidfd, 5.0)
        return True


def _owned_by(pid: int, uid: int, proc_root: Path) -> bool:
    info = process_info(pid, proc_root)
    return info is not None and info.uid == uid


def _send(pidfd: int, sig: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False


async def _exited(pidfd: int, timeout_s: float) -> bool:
    """Wait until the pidfd reports its process gone (readable), on the running loop."""
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(True))
    try:
        async with asyncio.timeout(timeout_s):
            return await gone
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)

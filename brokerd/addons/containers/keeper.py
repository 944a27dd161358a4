"""The broker's container keeper (brokerd/core/plugins.py, ContainerKeeper): it confirms the
containers leases are applied to, tells whether a caller runs in a lease's container, stops a
lease's containers when it ends (a lease hook), and warns them of a coming end (warning.py).

Always plugged in: rootless podman needs no engine, the kernel answers for it. The engines of
`[containers] docker` and `podman` are asked only when configured (aiohttp is imported then),
and followed across a reload.

Stopping, at any end of a lease (release, revoke, time limit, idle reclaim, the holder's or the
container's exit): every running container the engines list with the lease's label and confirm
as the lease's user's (membership.py: the labels, and its init in its own cgroup), including
one started as the lease ended, before its client could name it, but not one whose label came
from its image (a container of an image committed from the lease's: verdict.py); for a
rootless container, its init, if it is still the same process of the holder's uid. A
container that starts after its lease's end is the start guard's (guard.py: engine events).
SIGTERM to the init, SIGKILL after `[containers] stop_grace`. The freed devices are granted
meanwhile, as after any end: the stop runs beside the hand-over, like the clean-up of brokerd/core/reaper.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from brokerd.addons.containers import locate
from brokerd.addons.containers.guard import StartGuard
from brokerd.addons.containers.info import EngineError
from brokerd.addons.containers.membership import DEVICES_LABEL, LEASE_LABEL, USER_LABEL, Containers, RootlessContainer
from brokerd.addons.containers.verdict import held_devices, own_lease_label
from brokerd.addons.containers.warning import Warnings
from brokerd.base.clock import wall
from brokerd.base.journal import log_event
from brokerd.base.process import Identity, ProcessId
from brokerd.base.procinfo import start_time
from brokerd.core.plugins import ContainerStopped
from brokerd.leasing.errors import LeaseError, NotFound
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.model import ContainerHold, Lease

ROOTLESS = "podman-rootless"
HANDOVER_FIRST_S = 0.1  # as the reaper: the next waiter's grant goes first
START_WAIT_S = 30.0  # a container named at create is confirmed once it has started
log = logging.getLogger("vaccel.brokerd")


class ContainerKeeper(LeaseHook):
    name = "containers"

    def __init__(self, service: Any) -> None:
        # `service` is a BrokerService: typed loosely, as the other add-ons, so that nothing
        # here names the core's classes beyond what the plug-in interfaces promise.
        self._service = service
        self._sockets: tuple[str, str] = ("", "")
        self._engines: Containers | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # The leases that may be applied to a container: those one was confirmed for (or that
        # had one at a restart), so that a change of the broker's state looks at those only.
        self._applied: set[str] = set()
        self.warnings = Warnings(self._held_leases, wall)
        self.guard = StartGuard(service)
        self._following = False  # started: the engines' events are followed (start)

    # -- the engines, as configured now ----------------------------------------------

    def engines(self) -> Containers | None:
        config = self._service.config
        sockets = (config.containers_docker, config.containers_podman)
        if sockets != self._sockets:
            old, self._engines, self._sockets = self._engines, Containers.configured(*sockets), sockets
            if self._following:
                self._spawn(self.guard.follow(self._engines))
            if old is not None:
                self._spawn(old.close())
        return self._engines

    def start(self) -> None:
        """Follow the configured engines' events from now on (the daemon's loop runs, the
        leases are restored): a container that starts outside a live lease is stopped."""
        self._following = True
        self._spawn(self.guard.follow(self.engines()))

    def stopped_containers(self) -> list[ContainerStopped]:
        return self.guard.stopped()

    def container_of(self, pid: int) -> str:
        """The name (else short id) of the container `pid` runs in, as the kernel shows it; "" none."""
        ref = locate.container_of(pid)
        return self.guard.name_of(ref.id) if ref is not None else ""

    async def close(self) -> None:
        self.warnings.close()
        await self.guard.close()
        for task in list(self._tasks):
            task.cancel()
        if self._engines is not None:
            await self._engines.close()

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- ContainerKeeper ---------------------------------------------------------------

    async def confirm(self, lease: Lease, caller: Identity, container: str, init_pid: int,
                      shown: tuple[str, str]) -> ContainerHold:
        engines = self.engines()
        named = container[:12] or f"with init pid {init_pid}"
        if container and engines is not None:
            await engines.started(container, START_WAIT_S)
            relabelled = self.guard.let_start.get(container) == lease.id
            info = await engines.named_container(container, lease.id, lease.holder.user, relabelled)
            started = start_time(info.pid) if info is not None else None
            if info is not None and started is not None:
                self._applied.add(lease.id)
                return ContainerHold(info.engine, info.id, info.name, info.image, ProcessId(info.pid, started))
        if init_pid and caller.uid != 0:
            hold = self._rootless(init_pid, caller.uid, container, shown)
            if hold is not None:
                self._applied.add(lease.id)
                return hold
        if container and engines is not None and await self._exited(engines, container, lease):
            raise NotFound(f"container {named} of lease {lease.id} has exited already")
        if engines is None and not init_pid:
            raise LeaseError(f"container {named} cannot be confirmed as lease {lease.id}'s: this broker asks no "
                             "container engine ([containers] docker or podman in its brokerd.toml)")
        raise LeaseError(f"container {named} is not lease {lease.id}'s: neither a container engine the broker asks "
                         f"nor the kernel says it runs with lease {lease.id}'s labels, started by "
                         f"{lease.holder.user}")

    @staticmethod
    async def _exited(engines: Containers, container: str, lease: Lease) -> bool:
        """Whether the engine knows the container as the lease's and it has stopped (a short
        command can end before its client names it): nothing is left to follow."""
        info = await engines.described(container)
        return (info is not None and not info.running and info.labels.get(LEASE_LABEL) == lease.id
                and info.labels.get(USER_LABEL) == lease.holder.user)

    @staticmethod
    def _rootless(init_pid: int, uid: int, container: str, shown: tuple[str, str]) -> ContainerHold | None:
        """A rootless container's init, as the kernel shows it: the init of its own pid namespace,
        a process of the caller's own uid (which could signal it itself)."""
        held = RootlessContainer.of_init(init_pid, uid)
        if held is None:
            return None
        try:
            started = start_time(init_pid)
            if held.pid != init_pid or started is None:
                return None
            return ContainerHold(ROOTLESS, container, shown[0], shown[1], ProcessId(init_pid, started))
        finally:
            held.close()

    async def let_start(self, lease: Lease, container: str) -> None:
        """Let the container start under `lease` (`vaccel run -- docker start NAME`): it must be
        the lease's user's (its engine's label) and made with the lease's devices, no other."""
        engines = self.engines()
        info = await engines.described(container) if engines is not None and container else None
        named = container[:12]
        if info is None or info.id != container:
            raise NotFound(f"no engine the broker asks knows container {named} (by its full id)")
        if info.labels.get(USER_LABEL) != lease.holder.user:
            raise LeaseError(f"container {info.name or named} was not made by {lease.holder.user} under vaccel run: "
                             "it cannot start under their lease")
        manager = self._service.manager
        made_with = {device.uuid for device in held_devices(info, list(manager.devices.values()))}
        if not made_with:  # podman 4.3 shows no --device in inspect: the devices vaccel labelled it with
            made_with = set(info.labels.get(DEVICES_LABEL, "").split(",")) & set(manager.devices)
        if not made_with or made_with != set(lease.devices):
            shown = ", ".join(sorted(d.label for d in manager.devices.values() if d.uuid in made_with)) or "none"
            raise LeaseError(f"container {info.name or named} was made with devices {shown}, lease {lease.id} holds "
                             "others: lease exactly its devices")
        self.guard.let_start[info.id] = lease.id

    async def runs_inside(self, caller: Identity, lease: Lease) -> bool:
        engines = self.engines()
        if engines is None:
            return False  # rootless: the caller is the holder's uid, and needs no container to say so
        info = await engines.lease_container_of(caller.pid, lease.id)
        return (info is not None and info.labels.get(USER_LABEL) == lease.holder.user
                and (lease.container is None or lease.container.id == info.id))

    def stop_container(self, lease: Lease) -> None:
        self._applied.discard(lease.id)
        self._spawn(self._stop(lease))

    # -- LeaseHook ---------------------------------------------------------------------

    def restored(self, active: Sequence[Lease]) -> None:
        self._applied.update(lease.id for lease in active if lease.container is not None)

    def ended(self, lease: Lease) -> None:
        self._applied.discard(lease.id)
        self.warnings.forget(lease.id)
        self.guard.forget(lease.id)
        if lease.container is not None or self.engines() is not None:
            self._spawn(self._stop(lease))

    def changed(self) -> None:
        """After every change of the broker's state: move the warnings' timers, and follow
        the engines a reload configured."""
        self.warnings.changed()
        self.engines()

    def _held_leases(self) -> list[Lease]:
        leases = self._service.manager.leases
        return [lease for lease_id in self._applied if (lease := leases.get(lease_id)) and lease.container]

    async def _stop(self, lease: Lease) -> None:
        await asyncio.sleep(HANDOVER_FIRST_S)
        grace = self._service.config.containers_stop_grace_s
        hold = lease.container
        try:
            if hold is not None and hold.engine == ROOTLESS:
                stopped = await self._stop_rootless(hold, lease.holder.uid, grace)
            else:
                stopped = await self._stop_rootful(lease, grace)
        except Exception as exc:  # an engine that fails must never take the daemon down
            log_event("container_stop", f"could not stop the container of lease {lease.id}: {exc}",
                      lease_id=lease.id, level=logging.ERROR)
            return
        if stopped:
            engine = {ROOTLESS: "podman"}.get(hold.engine, hold.engine) if hold is not None else "docker"
            log_event("container_stop", f"lease {lease.id} ended ({lease.state}): stopped container "
                      f"{', '.join(stopped)} (SIGTERM, SIGKILL after {grace:g}s); started outside a lease it is "
                      f"stopped again: `vaccel run -- {engine} start -a {stopped[0]}` runs it under a new lease",
                      lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices)

    async def _stop_rootful(self, lease: Lease, grace_s: float) -> list[str]:
        engines = self.engines()
        if engines is None:
            return []
        stopped = []
        confirmed = lease.container.id if lease.container is not None else ""
        found = await engines.lease_containers(lease.id, lease.holder.user)
        if confirmed and all(info.id != confirmed for info in found):  # started again under this lease
            again = await engines.named_container(confirmed, lease.id, lease.holder.user, relabelled=True)
            found += [again] if again is not None else []
        for info in found:
            # Not one whose label its image gave it (an image committed from the lease's
            # container): that container was never made for this lease.
            if info.id != confirmed and own_lease_label(info.labels, await engines.image_labels(info)) != lease.id:
                continue
            try:
                if await engines.stop(info, grace_s):
                    stopped.append(info.name or info.id[:12])
            except EngineError as exc:
                log.error("containers: %s", exc)
        return stopped

    @staticmethod
    async def _stop_rootless(hold: ContainerHold, uid: int, grace_s: float) -> list[str]:
        held = RootlessContainer.of_init(hold.init.pid, uid)
        if held is None:
            return []
        try:
            if held.pid != hold.init.pid or start_time(held.pid) != hold.init.start_time:
                return []  # not the same process any more: nothing of the lease's to stop
            return [hold.name or hold.id[:12] or f"init pid {held.pid}"] if await held.stop(grace_s) else []
        finally:
            held.close()

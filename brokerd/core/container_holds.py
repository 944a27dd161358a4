"""Leases applied to containers (`vaccel run -- docker run ...`, docs/containers.md): the
lease follows the container.

- `attach`: the client names the container it started for its lease (the engine's id from
  `--cidfile`, or a rootless container's init pid); the container keeper confirms it with the
  engine or the kernel (brokerd/core/plugins.py: ContainerKeeper), never on the client's word.
  What it confirms is recorded with the lease and its init watched by a pidfd like any holder:
  the container's exit ends the lease at once. A container started with `-d` holds the lease
  alone: its init becomes the lease's holder, and no heartbeat is due.
- `runs_inside`: a process that asks to join a lease from inside its container is let in
  because its engine and the kernel put it there, not because of its uid (container root is
  uid 0 to the host).
- `restore`: after a restart the container's init is watched again by pid and start time, the
  identity confirmed before; gone, the lease ends.
Any end of such a lease stops its container: the keeper's lease hook does that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from brokerd.base.journal import log_event
from brokerd.base.process import Identity, ProcessId
from brokerd.core.changes import ChangeFeed
from brokerd.core.liveness import ProcessWatcher
from brokerd.core.plugins import ContainerKeeper, ContainerStopped
from brokerd.leasing.errors import Ended, LeaseError
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Lease
from brokerd.state.store import LeaseStore

# Signals a container's processes may be warned with (those that catch it get it): any one a
# process can catch, so not SIGKILL (9) nor SIGSTOP (19).
WARN_SIGNALS = frozenset(range(1, 65)) - {9, 19}


class ContainerHolds:
    def __init__(self, manager: LeaseManager, store: LeaseStore, *, watcher: ProcessWatcher, changes: ChangeFeed,
                 keeper: Callable[[], ContainerKeeper | None], forget_if_idle: Callable[[ProcessId], None]) -> None:
        self.manager = manager
        self.store = store
        self.watcher = watcher
        self.changes = changes
        self._keeper = keeper
        self._forget_if_idle = forget_if_idle

    def _confirmer(self) -> ContainerKeeper:
        keeper = self._keeper()
        if keeper is None:
            raise LeaseError("this broker keeps no containers: it cannot apply a lease to one")
        return keeper

    async def attach(self, caller: Identity, lease_id: str, container: str, init_pid: int, *, held: bool = False,
                     warn_signal: int = 0, shown: tuple[str, str] = ("", ""), starting: bool = False) -> Lease:
        """Apply lease `lease_id` (the caller's: the service checked) to the container the caller
        started for it; the Lease as it is now. LeaseError when the container is not confirmed
        as the lease's, has exited, or the lease has another container already. `starting`:
        only let that existing container start under the lease (the keeper's `let_start`)."""
        keeper = self._confirmer()
        lease = self.manager.active(lease_id)
        if starting:
            await keeper.let_start(lease, container)
            return lease
        if lease.container is not None:
            if container and lease.container.id == container and held and not lease.container.held:
                return await self._detached(lease)
            if container and lease.container.id == container:
                return lease  # the same call again (its reply was lost)
            raise LeaseError(f"lease {lease_id} is applied to container {lease.container.name} already")
        if warn_signal and warn_signal not in WARN_SIGNALS:
            raise LeaseError(f"signal {warn_signal} is not one a container may be warned with")
        hold = replace(await keeper.confirm(lease, caller, container, init_pid, shown), held=held,
                       warn_signal=warn_signal)
        if not lease.active:  # it ended while the engine was asked: its container must not run on
            keeper.stop_container(replace(lease, container=hold))
            raise Ended(f"lease {lease_id} has ended: {lease.state} ({lease.end_reason})")
        if not self.watcher.watch(hold.init):
            raise LeaseError(f"container {hold.name or hold.id[:12]} exited before lease {lease_id} was applied "
                             "to it")
        asked_by = lease.holder.process
        self.manager.hold_by_container(lease_id, hold)
        await self.store.save_holder(lease)
        if held:
            self._forget_if_idle(asked_by)  # its exit no longer ends the lease
        log_event("container", f"lease {lease.id} of {lease.holder.user} applied to {hold.engine} container "
                  f"{hold.name or hold.id[:12]} (init pid {hold.init.pid})" + (", which holds it" if held else ""),
                  lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices, pid=hold.init.pid)
        self.changes.changed()
        return lease

    async def _detached(self, lease: Lease) -> Lease:
        """The foreground container was detached from (Ctrl-P Ctrl-Q): it holds the lease alone
        from now on, as if started with -d; its client's exit no longer ends the lease."""
        assert lease.container is not None
        asked_by = lease.holder.process
        self.manager.hold_by_container(lease.id, replace(lease.container, held=True))
        await self.store.save_holder(lease)
        self._forget_if_idle(asked_by)
        log_event("container", f"lease {lease.id} of {lease.holder.user} handed to container "
                  f"{lease.container.name or lease.container.id[:12]}, detached from its client: it holds it alone",
                  lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices, pid=lease.container.init.pid)
        self.changes.changed()
        return lease

    def renamed(self, container_id: str, name: str) -> None:
        """Its engine renamed a lease's container (`docker rename`): the lease shows the new name."""
        for lease in list(self.manager.leases.values()):
            if lease.container is not None and lease.container.id == container_id and lease.container.name != name:
                self.manager.hold_by_container(lease.id, replace(lease.container, name=name))
                self.store.save_holder(lease)  # written in order with the rest; a restart shows the new name
                log_event("container", f"lease {lease.id}'s container is now named {name}", lease_id=lease.id,
                          user=lease.holder.user)
                self.changes.changed()

    def container_of(self, pid: int) -> str:
        """The name (else the short id) of the container a process runs in, "" none."""
        keeper = self._keeper()
        return keeper.container_of(pid) if keeper is not None else ""

    def stopped(self) -> list[ContainerStopped]:
        """The containers stopped lately for starting outside a live lease (`vaccel status`)."""
        keeper = self._keeper()
        return keeper.stopped_containers() if keeper is not None else []

    async def runs_inside(self, caller: Identity, lease: Lease) -> bool:
        keeper = self._keeper()
        return keeper is not None and await keeper.runs_inside(caller, lease)

    def restore(self, lease: Lease, holder_alive: bool) -> str:
        """Watch a restored lease's container init again; what of the lease exited while the
        broker was down ("" nothing): its holder, or its container (gone, or another process
        now: the pid and start time both must match)."""
        hold = lease.container
        if hold is not None and not (holder_alive if hold.held else self.watcher.watch(hold.init)):
            return f"container {hold.name or hold.id[:12]}"
        return "" if holder_alive else f"holder pid {lease.holder.pid}"

"""Putting back the leases the store held when the daemon starts again.

A restored lease's holder (and its container, or the members that joined it) is watched
again; one whose holder exited while the daemon was down ends at once as holder_exited,
and its end is recorded like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from brokerd.base.journal import log_event
from brokerd.core.container_holds import ContainerHolds
from brokerd.core.liveness import ProcessWatcher
from brokerd.core.tasks import Tasks
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import HOLDER_EXITED, Lease


def restore_leases(manager: LeaseManager, active: list[Lease], ended: list[Lease], drained: dict[str, str], *,
                   watcher: ProcessWatcher, holds: ContainerHolds, tasks: Tasks,
                   record_end: Callable[[Lease], asyncio.Future[None]]) -> None:
    """Put `active`, `ended` and `drained` back into `manager`. Must run inside the loop
    (watching opens pidfds)."""
    manager.drained.update(drained)
    last_used = manager.holdings.last_used
    for lease in ended:
        manager.ended[lease.id] = lease
        for uuid in lease.devices:
            last_used[uuid] = max(last_used.get(uuid, 0), lease.ended_at)
    for lease in active:
        manager.restore(lease)
        restored = manager.leases[lease.id]
        # A reservation is held by its user: the command that booked it is long gone.
        alive = restored.reservation or watcher.watch(lease.holder.process)
        restored.members = {m for m in lease.members if watcher.watch(m)}
        gone = holds.restore(restored, alive)
        if not gone:
            log_event("restore", f"lease {lease.id} restored for {lease.holder.user}",
                      lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices)
        else:
            ended_lease = manager.end(lease.id, HOLDER_EXITED, f"{gone} exited while the broker was down")
            tasks.keep(record_end(ended_lease))

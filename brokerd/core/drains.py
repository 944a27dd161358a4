"""Taking a device out of the pool, or putting it back (`vaccel drain`).

Who drained it and when are kept with the reason, as Slurm keeps a node's ("fan
[root@2026-12-02T10:00:00]"), so that they survive restarts with it. A drained device's
running lease goes on to its end; a device put back is granted at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from brokerd.base.journal import log_event
from brokerd.core.views import find_device
from brokerd.devices.model import Device
from brokerd.leasing.manager import LeaseManager
from brokerd.state.store import LeaseStore
from vaccel_common.text import printable


async def drain_device(manager: LeaseManager, store: LeaseStore, device: str, reason: str, *, undo: bool,
                       user: str, pump_soon: Callable[[], None], changed: Callable[[], None]) -> Device:
    """Drain (or with `undo` return) the device `device` names, durably; the device."""
    target = find_device(manager, device)
    said = f"{printable(reason) or 'no reason given'} [{user}@{time.strftime('%Y-%m-%dT%H:%M:%S')}]"
    manager.drain(target.uuid, said, undo=undo)
    await store.save_drain(target.uuid, manager.drained.get(target.uuid, ""), undo)
    verb = "returned to the pool" if undo else f"drained ({manager.drained[target.uuid]})"
    log_event("undrain" if undo else "drain", f"{target.label} {verb} by {user}", user=user,
              device_uuids=(target.uuid,))
    if undo:
        pump_soon()
    changed()
    return target

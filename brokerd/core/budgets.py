"""Memory shares held to their budget (docs/sharing.md): at every probe refresh, each share
lease's measured device memory against its share.

What a share uses is the memory the probe reads per process (the vendor library's; a
simulated device's `usage_file`), for the processes matched to the lease as unleased use
is matched (brokerd/devices/occupancy.py: the holder, its members, and what they started),
on the lease's device. Over its share, the lease is told at once through its notice (the
path idle reclaim takes, brokerd/core/governing.py): `vaccel run` and `lease(on_ending=...)`
show it, and it ends as `over_budget` after `[sharing] over_budget_grace`, when what still
runs under it is stopped (brokerd/core/reaper.py). Back within its share before then, the
end is called off. The client's allocator cap (the per-process memory fraction) keeps a
well-behaved job from getting there; this is for the job that does not use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from brokerd.config.loader import Config
from brokerd.devices.model import Snapshot
from brokerd.devices.occupancy import Occupancy
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import OVER_BUDGET, Lease
from vaccel_common.units import format_duration, format_mib


def used_by_lease(snapshot: Snapshot, occupancy: Occupancy, manager: LeaseManager) -> dict[str, int]:
    """Lease id -> MiB its processes use on its devices, as the last probe read it."""
    used: dict[str, int] = {}
    for process in snapshot.processes:
        lease_id = occupancy.matched.get(process.pid)
        lease = manager.leases.get(lease_id) if lease_id else None
        if lease is not None and process.device_uuid in lease.devices:
            used[lease.id] = used.get(lease.id, 0) + process.used_memory_mib
    return used


class ShareBudgets:
    def __init__(self, manager: LeaseManager, *, config: Callable[[], Config], snapshot: Callable[[], Snapshot],
                 occupancy: Callable[[], Occupancy], note_ending: Callable[[Lease, str], None]) -> None:
        self.manager = manager
        self._config = config
        self._snapshot = snapshot
        self._occupancy = occupancy
        self._note_ending = note_ending  # save the notice, say it, wake the expiry (Governance)

    def used(self) -> Mapping[str, int]:
        """Lease id -> MiB it uses now (leases using none are absent)."""
        return used_by_lease(self._snapshot(), self._occupancy(), self.manager)

    def check(self) -> None:
        """Warn the shares over their budget, call the warning off for those back within it."""
        manager = self.manager
        shares = [lease for lease in manager.leases.values() if lease.share_mib]
        if not shares:
            return
        used, now, grace = self.used(), time.time(), self._config().sharing_over_budget_grace_s
        for lease in shares:
            over = used.get(lease.id, 0) > lease.share_mib
            # Once its end has come the client stops its command: processes gone then are the
            # end carried out (the expiry records it), not a share back within its budget.
            if lease.ending_state == OVER_BUDGET and not over and now < lease.expires_at:
                self._note_ending(manager.call_off_ending(lease.id), "back within its share: its end is called off")
            elif over and not lease.notice:
                at = now + grace
                notice = (f"uses {format_mib(used[lease.id])} of device memory, over its share of "
                          f"{format_mib(lease.share_mib)}: stopped at {time.strftime('%H:%M:%S', time.localtime(at))}"
                          f" ({format_duration(grace)} from now) unless it is back within its share")
                self._note_ending(manager.end_early(lease.id, at, OVER_BUDGET, notice), notice)

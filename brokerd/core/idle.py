"""Is a leased device in use? For idle reclaim ([policy] idle_reclaim, off by default).

A lease counts as computing when, since the last look, any of its devices reported
utilisation above zero (as the vendor probes report it in Device.extra), or, on devices that report none
(the simulated ones, which compute on the CPU), the lease's own processes (holder,
members, and everything they started) used CPU time. A lease that has not computed for
`idle_reclaim` while someone waits for its devices is warned and then reclaimed; one that
computes again before the end is left alone (brokerd/core/governing.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from brokerd.base.process import ProcessId
from brokerd.base.procinfo import PROC, stat_fields
from brokerd.core.reaper import lease_processes, process_table
from brokerd.devices.model import UTILISATION_KEY, Device
from brokerd.leasing.model import Lease

# Less CPU than this between two looks is a process sleeping (a shell prompt, a notebook
# kernel waiting for input), not a job computing: clock ticks, 1/100 s each.
_BUSY_TICKS = 5


def _cpu_ticks(processes: Iterable[ProcessId], proc_root: Path) -> int:
    """utime + stime of the processes (those still alive)."""
    total = 0
    for process in processes:
        fields = stat_fields(process.pid, proc_root)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total


class IdleWatch:
    """When each lease last computed, as seen at each probe refresh."""

    def __init__(self, proc_root: Path = PROC) -> None:
        self.proc_root = proc_root
        self._last: dict[str, tuple[int, float]] = {}  # lease id -> (cpu ticks, last time it computed)

    def observe(self, leases: Iterable[Lease], devices: Mapping[str, Device], now: float) -> dict[str, float]:
        """Lease id -> seconds since it last computed, for every active lease."""
        leases = list(leases)
        table = process_table(self.proc_root) if leases else None
        idle: dict[str, float] = {}
        for lease in leases:
            measured = [devices[u].extra.get(UTILISATION_KEY) for u in lease.devices if u in devices]
            readings = [float(m) for m in measured if isinstance(m, int | float)]
            roots = [lease.holder.process, *lease.members]
            if lease.reservation:
                roots = list(lease.members)  # its holder was the command that booked it
            ticks = 0
            if not readings:  # the lease's own processes, as the reaper would find them
                ticks = _cpu_ticks(lease_processes(roots, lease.holder.uid, self.proc_root, table), self.proc_root)
            before = self._last.get(lease.id)
            if readings:
                computing = any(r > 0 for r in readings)
            else:  # first look: nothing to compare with, so it gets the benefit of the doubt
                computing = before is None or ticks - before[0] >= _BUSY_TICKS
            since = now if computing else before[1] if before is not None else now
            self._last[lease.id] = (ticks, since)
            idle[lease.id] = now - since
        for gone in set(self._last) - {lease.id for lease in leases}:
            del self._last[gone]
        return idle

"""Is a leased device in use? For idle reclaim ([policy] idle_reclaim, off by default).

A lease counts as computing when, since the last look, any of its devices reported
utilisation above zero (as the vendor probes report it in Device.extra), or, on devices that report none
(the simulated ones, which compute on the CPU), the lease's own processes (holder,
members, and everything they started) used CPU time. A lease that has not computed for
`idle_reclaim` while someone waits for its devices is warned and then reclaimed; one that
computes again before the end is left alone (brokerd/governing.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from brokerd.devices import UTILISATION_KEY, Device
from brokerd.lease_model import Lease
from brokerd.procinfo import PROC, stat_fields

# Less CPU than this between two looks is a process sleeping (a shell prompt, a notebook
# kernel waiting for input), not a job computing: clock ticks, 1/100 s each.
_BUSY_TICKS = 5


def _children_of(proc_root: Path) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir(proc_root):
        if entry.isdigit():
            fields = stat_fields(int(entry), proc_root)
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _cpu_ticks(pids: Iterable[int], children: Mapping[int, list[int]], proc_root: Path) -> int:
    """utime + stime of the processes and all their descendants (those alive now)."""
    total, todo, seen = 0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        fields = stat_fields(pid, proc_root)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
        todo.extend(children.get(pid, ()))
    return total


class IdleWatch:
    """When each lease last computed, as seen at each probe refresh."""

    def __init__(self, proc_root: Path = PROC) -> None:
        self.proc_root = proc_root
        self._last: dict[str, tuple[int, float]] = {}  # lease id -> (cpu ticks, last time it computed)

    def observe(self, leases: Iterable[Lease], devices: Mapping[str, Device], now: float) -> dict[str, float]:
        """Lease id -> seconds since it last computed, for every active lease."""
        leases = list(leases)
        children = _children_of(self.proc_root) if leases else {}
        idle: dict[str, float] = {}
        for lease in leases:
            measured = [devices[u].extra.get(UTILISATION_KEY) for u in lease.devices if u in devices]
            readings = [float(m) for m in measured if isinstance(m, int | float)]
            pids = [lease.holder.pid, *(m.pid for m in lease.members)]
            if lease.reservation:
                pids = [m.pid for m in lease.members]  # its holder was the command that booked it
            ticks = _cpu_ticks(pids, children, self.proc_root) if not readings else 0
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

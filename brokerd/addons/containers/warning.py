"""The warning before a container's lease ends (its time limit near, an admin's revoke with
grace, an idle reclaim), sent by the broker itself: the engine's client would pass any signal
on to the container's command, which may die of one it does not handle, and a container
started with `-d` has no client at all.

At the moment a `vaccel run` client would warn its command (vaccel_common/ending_notice.py),
the processes of the container's pid namespace that catch the lease's warning signal get it
(SigCgt in /proc/PID/status), as the client does for the processes of its command. An init
that only passes signals on (docker-init, catatonit, tini) is left out: it would hand the
signal to a command that may not catch it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from brokerd.base.journal import log_event
from brokerd.base.process import ProcessId
from brokerd.base.procinfo import PROC, pid_namespace, start_time
from brokerd.core.reaper import signal_all
from brokerd.leasing.model import Lease
from vaccel_common.ending_notice import warn_at

# Inits a container engine adds (`--init`) that forward every signal to their child.
FORWARDING_INITS = frozenset({"docker-init", "catatonit", "tini", "tini-static", "dumb-init"})


def catching(init: ProcessId, sig: int, proc_root: Path = PROC) -> list[ProcessId]:
    """The processes of `init`'s pid namespace that catch `sig`, but a forwarding init."""
    namespace = pid_namespace(init.pid, proc_root)
    if namespace is None or start_time(init.pid, proc_root) != init.start_time:
        return []
    found = []
    for entry in os.listdir(proc_root):
        if not entry.isdigit() or pid_namespace(entry, proc_root) != namespace:
            continue
        pid = int(entry)
        if pid == init.pid and _comm(pid, proc_root) in FORWARDING_INITS:
            continue
        started = start_time(pid, proc_root)
        if started is not None and _catches(pid, sig, proc_root):
            found.append(ProcessId(pid, started))
    return found


def _comm(pid: int, proc_root: Path) -> str:
    try:
        return (proc_root / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _catches(pid: int, sig: int, proc_root: Path) -> bool:
    try:
        with open(proc_root / str(pid) / "status") as status:
            line = next((line for line in status if line.startswith("SigCgt:")), "")
    except OSError:
        return False
    try:
        return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (IndexError, ValueError):
        return False


class Warnings:
    """One timer per container lease with a coming end, moved whenever that end moves (every
    change of the broker's state is looked at: `changed`)."""

    def __init__(self, leases: Callable[[], list[Lease]], clock: Callable[[], float]) -> None:
        self._leases = leases  # the active leases applied to a container
        self._clock = clock
        self._timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}
        self._told: set[tuple[str, float, str]] = set()

    def changed(self) -> None:
        due = {}
        for lease in self._leases():
            hold = lease.container
            if hold is None or not hold.warn_signal or not lease.expires_at:
                continue
            if (lease.id, lease.expires_at, lease.notice) not in self._told:
                due[lease.id] = (warn_at(lease.expires_at, lease.time_limit_s, lease.notice), lease)
        for lease_id in set(self._timers) - set(due):
            self._timers.pop(lease_id)[1].cancel()
        loop = asyncio.get_running_loop()
        for lease_id, (at, lease) in due.items():
            current = self._timers.get(lease_id)
            if current is not None and current[0] == at:
                continue
            if current is not None:
                current[1].cancel()
            delay = max(0.0, at - self._clock())
            self._timers[lease_id] = (at, loop.call_later(delay, self._warn, lease))

    def _warn(self, lease: Lease) -> None:
        self._timers.pop(lease.id, None)
        hold = lease.container
        if not lease.active or hold is None:
            return
        self._told.add((lease.id, lease.expires_at, lease.notice))
        hit = signal_all(catching(hold.init, hold.warn_signal), hold.warn_signal)
        log_event("container_warn", f"lease {lease.id} ends at {lease.expires_at:.0f}: signal {hold.warn_signal} to "
                  f"the processes of container {hold.name or hold.id[:12]} that catch it: "
                  f"{', '.join(str(p.pid) for p in hit) or 'none'}", lease_id=lease.id, user=lease.holder.user)

    def forget(self, lease_id: str) -> None:
        timer = self._timers.pop(lease_id, None)
        if timer is not None:
            timer[1].cancel()
        self._told = {told for told in self._told if told[0] != lease_id}

    def close(self) -> None:
        for _, timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

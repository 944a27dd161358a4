"""A lease that ends for any reason but a release leaves nothing of its own computing on
its devices.

When a lease expires, is revoked, loses its device, reaches its time limit or its holder
exits, the processes that were working under it (the holder, the members that joined it,
and every descendant of theirs, taken at the moment it ended) first get the chance a
well-behaved client takes by itself: it hears of the end at its next heartbeat and stops
its command. After that grace whatever is still alive gets SIGTERM, and SIGKILL a few
seconds later (a SIGSTOPped holder included: SIGKILL needs no cooperation). The journal
says which pids got which signal.

Each process is named by pid *and* start time and signalled through a pidfd opened and
then checked against that start time, so a pid reused by someone else is never hit. Only
processes of the lease holder's own uid are signalled, never pid 1, the daemon or an
ancestor of the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from brokerd.base.journal import log_event
from brokerd.base.process import ProcessId
from brokerd.base.procinfo import PROC, ancestors, stat_fields
from brokerd.leasing.model import RELEASED, Lease, heartbeat_interval

TERM_GRACE_S = 5.0
_tasks: set[asyncio.Task[None]] = set()


def client_grace_s(ttl_s: float) -> float:
    """Two heartbeat intervals plus slack: the time a live client needs to hear of the end
    and stop its command itself."""
    return 2 * heartbeat_interval(ttl_s) + 2.0


HANDOVER_FIRST_S = 0.1  # the next waiter's grant takes a few ms; the clean-up waits seconds anyway


def reap_after_end(lease: Lease, ttl_s: float, *, term_grace_s: float = TERM_GRACE_S,
                   more: Iterable[ProcessId] = ()) -> None:
    """Schedule the clean-up of an ended lease (nothing for a release). `more`: processes of
    the lease's besides its holder's and members' trees (a share's user's on its device,
    however they were started). Needs a running loop."""
    if lease.state == RELEASED:
        return
    task = asyncio.get_running_loop().create_task(
        _reap(lease, client_grace_s(ttl_s), term_grace_s, tuple(more)), name=f"reap {lease.id}")
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


async def _reap(lease: Lease, client_grace: float, term_grace: float, more: tuple[ProcessId, ...] = ()) -> None:
    loop = asyncio.get_running_loop()
    roots = [lease.holder.process, *lease.members, *more]
    uid = lease.holder.uid
    try:
        # Not before the hand-over: the scan of /proc competes for the interpreter with the
        # loop, which is granting the freed devices to the next waiter right now.
        await asyncio.sleep(HANDOVER_FIRST_S)
        tree = await loop.run_in_executor(None, lease_processes, roots, uid)
        for sig, wait in ((signal.SIGTERM, client_grace), (signal.SIGKILL, term_grace)):
            await asyncio.sleep(wait)
            tree = await loop.run_in_executor(None, lease_processes, tree, uid)
            hit = await loop.run_in_executor(None, signal_all, tree, sig)
            if not hit:
                return
            log_event("reap", f"lease {lease.id} ended ({lease.state}); {sig.name} to what still ran under it: "
                      f"pid {', '.join(str(p.pid) for p in hit)}", lease_id=lease.id, user=lease.holder.user,
                      device_uuids=lease.devices, signal=sig.name, level=logging.WARNING)
    except Exception as exc:  # the clean-up must never take the daemon down
        log_event("reap", f"could not clean up after lease {lease.id}: {exc}", lease_id=lease.id,
                  level=logging.ERROR)


def _stat(pid: int, proc_root: Path) -> tuple[int, int, int] | None:
    """(ppid, start time, uid) of a live process, None when it is gone."""
    fields = stat_fields(pid, proc_root)
    if fields is None or fields[0] == "Z":
        return None
    try:
        uid = (proc_root / str(pid)).stat().st_uid
    except OSError:
        return None
    return int(fields[1]), int(fields[19]), uid


class ProcessTable(NamedTuple):
    """Every live process once: whom each started, and who each is."""

    children: dict[int, list[tuple[int, int]]]  # ppid -> [(pid, start time)]
    owners: dict[int, tuple[int, int]]  # pid -> (start time, uid)


def process_table(proc_root: Path = PROC) -> ProcessTable:
    """One pass over /proc, for as many lease_processes() questions as there are leases."""
    table = ProcessTable({}, {})
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        facts = _stat(int(entry.name), proc_root)
        if facts is not None:
            ppid, start, owner = facts
            table.owners[int(entry.name)] = (start, owner)
            table.children.setdefault(ppid, []).append((int(entry.name), start))
    return table


def lease_processes(roots: Iterable[ProcessId], uid: int, proc_root: Path = PROC,
                    table: ProcessTable | None = None) -> list[ProcessId]:
    """The roots that still live as themselves, plus all their live descendants, limited
    to processes of `uid`; never the daemon, its ancestors, pid 1 or what runs under them."""
    protected = {0, 1, os.getpid(), *ancestors(os.getpid(), proc_root)}
    children, owners = table if table is not None else process_table(proc_root)
    found: dict[int, ProcessId] = {}
    todo = [p for p in roots if owners.get(p.pid, (None,))[0] == p.start_time]
    while todo:
        process = todo.pop()
        if process.pid in found or process.pid in protected:
            continue  # never through the daemon or an ancestor of it: they are not the lease's
        found[process.pid] = process
        todo.extend(ProcessId(pid, start) for pid, start in children.get(process.pid, ()))
    return [p for pid, p in sorted(found.items()) if owners[pid][1] == uid]


def signal_all(processes: Iterable[ProcessId], sig: int, proc_root: Path = PROC) -> list[ProcessId]:
    """Send `sig` to each process that is still itself; the ones signalled."""
    hit = []
    for process in processes:
        try:
            fd = os.pidfd_open(process.pid)
        except OSError:
            continue
        try:
            facts = _stat(process.pid, proc_root)
            if facts is not None and facts[1] == process.start_time:
                signal.pidfd_send_signal(fd, sig)
                hit.append(process)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return hit

"""The process tree of the command `vaccel run` supervises, read from /proc: which of its
processes handle a signal, everything below it, and signalling all of it (a shell wrapper
must not leave its children computing on a device the lease no longer holds)."""

from __future__ import annotations

import os
import signal


def is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] in (b"T", b"t")


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next((line.split()[1] for line in f if line.startswith("SigCgt:")), "0")
    except OSError:
        return False
    return bool(int(caught, 16) >> (sig - 1) & 1)


def warn(pid: int, sig: int | None) -> str:
    """Send the warning signal to the processes of the command that handle it, and say so.
    Only to those: SIGUSR1's default action ends a process, and a job that never asked
    for a warning must not die of one minutes before its time is up."""
    if sig is None:
        return ""
    name = signal.Signals(sig).name
    targets = [p for p in [pid, *descendants(pid)] if catches(p, sig)]
    for target in targets:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass
    if not targets:
        return f"; the command does not handle {name}, so it was not sent"
    return f"; sent {name} to the command" + (f" ({len(targets)} processes)" if len(targets) > 1 else "")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children of children...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_tree(pid: int, sig: int) -> None:
    """Signal the command and everything it started: a shell wrapper must not leave its
    children computing on a device the lease no longer holds."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass

"""Which processes hold a device node open: an ACL closes the node to new opens only, so
what still has it open when a lease ends must be found and stopped.

A process holds a node through an open file (/proc/PID/fd/N, recognised by the device
number: the same whichever node of that device it was opened through, a container's copy
included) or through a memory mapping it kept after closing the file (/proc/PID/maps,
recognised by the node's filesystem and inode). Process facts come from brokerd/base/procinfo.py;
a process that exits part-way through is simply not reported.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from brokerd.base.process import ProcessId
from brokerd.base.procinfo import PROC, ancestors, process_info
from brokerd.devices.nodes import NodeId

LOGIN_DEFS = Path("/etc/login.defs")


@dataclass(frozen=True)
class Opener:
    process: ProcessId
    uid: int  # the real uid, as procinfo reads it
    user: str
    command: str
    nodes: tuple[str, ...]  # the paths of the asked nodes it holds


def first_login_uid(login_defs: Path = LOGIN_DEFS) -> int:
    """UID_MIN: uids below it are system accounts (root, daemons such as a driver's
    persistence daemon, which keep device nodes open by design)."""
    with contextlib.suppress(OSError, ValueError):
        for line in login_defs.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "UID_MIN":
                return int(parts[1])
    return 1000


def _by_fd(pid: int, rdevs: dict[int, str], proc_root: Path) -> set[str]:
    held: set[str] = set()
    fd_dir = proc_root / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return held
    for fd in fds:
        try:
            st = os.stat(fd_dir / fd)  # follows the link to the open file itself
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev in rdevs:
            held.add(rdevs[st.st_rdev])
    return held


def _by_mapping(pid: int, inodes: dict[tuple[int, int, int], str], proc_root: Path) -> set[str]:
    held: set[str] = set()
    try:
        maps = (proc_root / str(pid) / "maps").read_text()
    except (OSError, UnicodeDecodeError):
        return held
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or fields[4] == "0":
            continue
        major, _, minor = fields[3].partition(":")
        with contextlib.suppress(ValueError):
            key = (int(major, 16), int(minor, 16), int(fields[4]))
            if key in inodes:
                held.add(inodes[key])
    return held


def find_openers(
    nodes: Iterable[NodeId],
    *,
    uid: int | None = None,
    also: Iterable[int] = (),
    only: Iterable[int] | None = None,
    proc_root: Path = PROC,
) -> list[Opener]:
    """The processes (of `uid` only, when given; among the pids `only`, when given) that
    hold one of `nodes` open, root's excepted. `also`: pids another source (the probe's
    process list) saw using these devices; they count as openers even without an open
    file found here. Never the daemon, its ancestors or pid 1."""
    nodes = list(nodes)
    rdevs = {n.rdev: n.path for n in nodes}
    inodes = {(os.major(n.dev), os.minor(n.dev), n.ino): n.path for n in nodes}
    protected = {1, os.getpid(), *ancestors(os.getpid(), proc_root)}
    also = set(also)
    found = []
    entries = proc_root.iterdir() if only is None else (proc_root / str(pid) for pid in only)
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) in protected:
            continue
        pid = int(entry.name)
        try:
            owner = entry.stat().st_uid  # the effective uid; root's for a non-dumpable process
        except OSError:
            continue
        if uid is not None and owner not in (uid, 0):
            continue
        held = _by_fd(pid, rdevs, proc_root)
        if not held and pid in also:
            held = set(rdevs.values())
        if not held and owner != 0:  # maps are long: read them only where a user's process may be
            held = _by_mapping(pid, inodes, proc_root)
        if not held:
            continue
        info = process_info(pid, proc_root)
        if info is None or info.uid == 0 or (uid is not None and info.uid != uid):
            continue
        found.append(Opener(ProcessId(pid, info.starttime), info.uid, info.user, info.command, tuple(sorted(held))))
    return found

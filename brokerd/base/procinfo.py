"""Read-only facts about processes from /proc: owner, command, parent, start time.

Pure readers with an injectable proc root, so tests use a fake tree. A process can exit
between any two reads; every reader then answers None (or a shorter list), never raises.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_COMMAND_MAX = 80


@dataclass(frozen=True)
class ProcInfo:
    """One process as /proc shows it. `starttime` is in clock ticks since boot (field 22
    of /proc/PID/stat): with the pid it identifies the process across pid reuse."""

    pid: int
    uid: int
    user: str
    command: str  # short command line: program basename plus arguments, truncated
    ppid: int
    starttime: int


def stat_fields(pid: int, proc_root: Path) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (after the command name, which may hold spaces and
    parentheses, so split at the last ')')."""
    try:
        text = (proc_root / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    return fields if sep and len(fields) >= 20 else None


def _comm(pid: int, proc_root: Path) -> str:
    try:
        return (proc_root / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _uid(pid: int, proc_root: Path) -> int | None:
    try:
        status = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            parts = line.split()
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return None


def user_name(uid: int) -> str:
    """The login name for `uid`, or the number as text when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def short_command(argv: list[str], fallback: str = "") -> str:
    """`/usr/bin/python3 train.py --lr 3e-4` -> `python3 train.py --lr 3e-4`, cut to 80
    characters. Kernel threads and zombies have no argv: use the comm name. Any process
    can set its own argv and comm to anything (`exec -a`): the text is kept exact here and
    escaped wherever it is shown to a person (vaccel_common/text.py)."""
    if not argv or not argv[0]:
        return fallback
    text = " ".join([os.path.basename(argv[0]), *argv[1:]])
    return text if len(text) <= _COMMAND_MAX else text[: _COMMAND_MAX - 1] + "…"


def _argv(pid: int, proc_root: Path) -> list[str]:
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def process_info(pid: int, proc_root: Path = PROC) -> ProcInfo | None:
    """Owner, command, parent and start time of `pid`, or None when it does not exist."""
    fields = stat_fields(pid, proc_root)
    uid = _uid(pid, proc_root)
    if fields is None or uid is None:
        return None
    return ProcInfo(
        pid=pid,
        uid=uid,
        user=user_name(uid),
        command=short_command(_argv(pid, proc_root), _comm(pid, proc_root)),
        ppid=int(fields[1]),
        starttime=int(fields[19]),
    )


def start_time(pid: int, proc_root: Path = PROC) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when it does not exist."""
    fields = stat_fields(pid, proc_root)
    return int(fields[19]) if fields else None


def ancestors(pid: int, proc_root: Path = PROC) -> list[int]:
    """Parent, grandparent, ... of `pid` up to (not including) pid 0; [] when `pid` is gone.
    Stops at a loop or a vanished link instead of raising."""
    chain: list[int] = []
    seen = {pid}
    current = pid
    while True:
        fields = stat_fields(current, proc_root)
        if fields is None:
            return chain
        parent = int(fields[1])
        if parent <= 0 or parent in seen:
            return chain
        chain.append(parent)
        seen.add(parent)
        current = parent


def pid_namespace(pid: int | str, proc_root: Path = PROC) -> int | None:
    """The inode of `pid`'s pid namespace ("self" for ours), None when it is gone."""
    try:
        return os.stat(proc_root / str(pid) / "ns" / "pid").st_ino
    except OSError:
        return None


def in_another_pid_namespace(pid: int, proc_root: Path = PROC) -> bool:
    """Whether `pid` runs in a pid namespace other than ours: in a container (Docker, podman,
    nspawn, unshare --pid). False when it is gone."""
    namespace = pid_namespace(pid, proc_root)
    return namespace is not None and namespace != pid_namespace("self", proc_root)

"""Which container a host process is in, as the kernel shows it: pure readers of /proc with an
injectable root, like brokerd/base/procinfo.py. A process can exit between two reads; every
reader then answers None, never raises.

- Rootful engines give each container a cgroup named after its id: Docker with the cgroupfs
  driver `/docker/<64 hex>`, with the systemd driver `docker-<id>.scope`; podman
  `libpod-<id>` (`/libpod_parent/libpod-<id>` with cgroupfs). `--cgroup-parent` moves it under
  another parent, keeping the id as the last part. The id found here is only a claim until
  the engine confirms it (brokerd/addons/containers/membership.py): whoever can write to cgroupfs
  could name a folder after someone else's container.
- Rootless podman on cgroup v1 makes no cgroup at all (`/`). What the kernel does show is the
  process's own uid (the user's, for container root) and its pid namespace, whose init is the
  container's init.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from brokerd.base.procinfo import PROC, pid_namespace

_ID = r"[0-9a-f]{64}"
# (pattern on one cgroup path, the engine it names; "" = either). The first that matches wins.
_CGROUP_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(rf"(?:^|/)libpod-({_ID})(?:\.scope)?(?:/|$)"), "podman"),
    (re.compile(rf"(?:^|/)docker-({_ID})\.scope(?:/|$)"), "docker"),
    (re.compile(rf"(?:^|/)docker/({_ID})(?:/|$)"), "docker"),
    (re.compile(rf"/({_ID})$"), ""),
)


@dataclass(frozen=True)
class ContainerRef:
    """A container as a process's cgroup names it: not yet confirmed by any engine."""

    engine: str  # "docker", "podman", or "" when the path does not say
    id: str  # the full 64-hex id


def container_of(pid: int, proc_root: Path = PROC) -> ContainerRef | None:
    """The container whose cgroup `pid` is in, or None for a process in none (a host process,
    a rootless container on cgroup v1), one that is gone, or one whose hierarchies disagree."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    found: set[ContainerRef] = set()
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for pattern, engine in _CGROUP_PATTERNS:
            match = pattern.search(path)
            if match:
                found.add(ContainerRef(engine, match.group(1)))
                break
    ids = {ref.id for ref in found}
    if len(ids) != 1:
        return None
    # Where one hierarchy names the engine and another only the id, the named one counts.
    return max(found, key=lambda ref: bool(ref.engine))


def same_pid_namespace(pid: int, other: int, proc_root: Path = PROC) -> bool:
    mine = pid_namespace(pid, proc_root)
    return mine is not None and mine == pid_namespace(other, proc_root)


def namespace_init(pid: int, proc_root: Path = PROC) -> int | None:
    """The host pid of the init (pid 1) of `pid`'s pid namespace: the container's init for a
    process in a container. None for a process in the broker's own namespace, or gone.

    A process that entered the namespace later (`docker exec`, `podman exec`) is no child of
    that init, so the init is found by looking, not by walking up the parents."""
    namespace = pid_namespace(pid, proc_root)
    if namespace is None or namespace == pid_namespace("self", proc_root):
        return None
    for entry in os.listdir(proc_root):
        if entry.isdigit() and pid_namespace(entry, proc_root) == namespace and _innermost_pid(entry, proc_root) == 1:
            return int(entry)
    return None


def is_namespace_init(pid: int, proc_root: Path = PROC) -> bool:
    """Whether `pid` is itself the init (pid 1) of a pid namespace other than the broker's,
    from its own /proc entries only: a caller that names a container's init is confirmed
    or refused without a look through every process (namespace_init's scan, on the loop,
    at each refused AttachContainer: issue 43)."""
    namespace = pid_namespace(pid, proc_root)
    return (namespace is not None and namespace != pid_namespace("self", proc_root)
            and _innermost_pid(pid, proc_root) == 1)


def _innermost_pid(pid: int | str, proc_root: Path) -> int | None:
    """The process's pid in its own namespace: the last number of NSpid in its status."""
    try:
        with open(proc_root / str(pid) / "status") as f:
            line = next((line for line in f if line.startswith("NSpid:")), "")
    except OSError:
        return None
    numbers = line.split()[1:]
    return int(numbers[-1]) if numbers and numbers[-1].isdigit() else None


"""What the running process may do, found by trying: the capabilities it holds, the address
families it may open, whether its network is a private one, the system calls a seccomp
filter refuses, the folders it may write.

A systemd unit confines the daemon (CapabilityBoundingSet=, RestrictAddressFamilies=,
PrivateNetwork=, SystemCallFilter=, ProtectSystem=); a feature the unit blocks must be
refused with the setting's name rather than "served" while it cannot work (issue 41). Every
check here is harmless: a socket opened and closed, a credential call that changes nothing.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

# capability(7) numbers of the ones the daemon's features use.
CAPABILITIES = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_KILL": 5,
                "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SYS_PTRACE": 19}
FAMILIES = {"AF_UNIX": socket.AF_UNIX, "AF_INET": socket.AF_INET, "AF_INET6": socket.AF_INET6,
            "AF_NETLINK": socket.AF_NETLINK}
_TYPES = {"AF_NETLINK": socket.SOCK_DGRAM}  # SOCK_STREAM for the others


def _cap_set(field: str, status: str) -> set[str]:
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            mask = int(value.strip(), 16)
            return {cap for cap, bit in CAPABILITIES.items() if mask >> bit & 1}
    return set()


def capabilities(status_path: Path = Path("/proc/self/status")) -> tuple[set[str], set[str]]:
    """(effective, bounding): the capabilities of CAPABILITIES this process holds now, and
    those it could ever hold (what a unit's CapabilityBoundingSet= left)."""
    try:
        status = status_path.read_text()
    except OSError:
        return set(), set()
    return _cap_set("CapEff", status), _cap_set("CapBnd", status)


def family_blocked(name: str) -> bool:
    """Whether opening a socket of the family is refused (RestrictAddressFamilies= answers
    EAFNOSUPPORT; a kernel without the family does too)."""
    try:
        socket.socket(FAMILIES[name], _TYPES.get(name, socket.SOCK_STREAM)).close()
    except OSError as exc:
        return exc.errno in (errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES)
    return False


def _socket_inodes(pid: str = "self") -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _interfaces(net_dev: Path = Path("/proc/self/net/dev")) -> list[str]:
    """Our namespace's interfaces, from /proc (if_nameindex() needs AF_NETLINK, which a
    unit may well refuse)."""
    try:
        return [line.split(":", 1)[0].strip() for line in net_dev.read_text().splitlines()[2:] if ":" in line]
    except OSError:
        return []


def private_network(net_unix: Path = Path("/proc/self/net/unix")) -> bool:
    """Whether this process has a network namespace of its own (PrivateNetwork=yes,
    `unshare -n`): an address it listens on there is reachable from nowhere else.

    The Unix sockets the kernel lists for our namespace tell it: on a host's namespace there
    are always others' (journald's, PID 1's, any service's); in a private one only ours. A
    namespace with an interface besides loopback is a real network (a container's, whose
    ports are published), whoever else is in it."""
    if any(name != "lo" for name in _interfaces()):
        return False
    try:
        lines = net_unix.read_text().splitlines()[1:]
        ours = _socket_inodes()
    except OSError:
        return False
    others = [fields[6] for line in lines if len(fields := line.split()) > 6 and fields[6] not in ours]
    return not others


def syscalls_blocked(group: str) -> bool:
    """Whether a seccomp filter (SystemCallFilter=) refuses the group's calls: each is made
    as a no-op (the same ids, the same groups, the same owner), which only a filter refuses
    for root (a missing capability answers EPERM too, which blocks the feature as well)."""
    try:
        if group == "@setuid":
            os.setresuid(-1, -1, -1)
            os.setresgid(-1, -1, -1)
            os.setgroups(os.getgroups())
        elif group == "capset":  # setpriv sets the new user's capabilities after the switch
            return _capset_blocked()
        elif group == "@chown":
            read, write = os.pipe()
            try:
                os.fchown(read, -1, -1)
            finally:
                os.close(read)
                os.close(write)
        else:
            raise ValueError(f"no check for the system call group {group}")
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno == errno.EPERM
    return False


def _capset_blocked() -> bool:
    """capset(2) with the capabilities we already have (capget's answer): a no-op that only a
    filter refuses. Python has no binding; libc's wrappers take the kernel's structs."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # two __user_cap_data_struct: effective, permitted, inheritable
    if libc.capget(header, data) != 0:
        return False
    return libc.capset(header, data) != 0 and ctypes.get_errno() == errno.EPERM


def writable(folder: Path) -> bool:
    """Whether the daemon can write in `folder`, or make it where it is missing (a folder
    ProtectSystem=strict left read-only answers EROFS)."""
    path = folder
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.access(path, os.W_OK)

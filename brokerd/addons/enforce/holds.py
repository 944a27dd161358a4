"""What the gate does about a node held open without a lease there: the device is not
granted while that lasts, and what held it for a lease that has ended is stopped as on
any end.

An ACL closes a node to new opens only. A process that still has it open can use the
device, so granting the device to the next user while it is open shares it (issue 31:
after a `kill -9` of the daemon, a lease that ended while the daemon was down, or just
before, left its process holding the node, and the restarted daemon granted the device
to the next user while that process still had it). So:

- every device whose gated node a process of a login user holds without a lease there is
  held back from the queue (`vaccel status` says by whom), until that process is gone;
  system accounts (a driver's persistence daemon keeps every node open) do not hold a
  device back, and root's processes are not counted at all;
- at start-up, before anyone is served, a process found holding a node of a device its
  user had a lease on, which has ended, is stopped as that end would have stopped it:
  SIGTERM, then SIGKILL `enforce.grace` later, and after a release first what is left of
  the grace the release gave.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from brokerd.addons.enforce.openers import Opener
from brokerd.devices.model import Device
from brokerd.leasing.model import RELEASED, Lease


def held_open(openers: Iterable[Opener], wanted: Callable[[str], set[int]], devices: Iterable[Device],
              system_below: int) -> dict[str, tuple[Opener, str]]:
    """Device uuid -> the process that holds one of its nodes without a lease there, and
    that node (the first such process found)."""
    device_of = {path: device for device in devices for path in device.device_nodes}
    held: dict[str, tuple[Opener, str]] = {}
    for opener in openers:
        if opener.uid < system_below:
            continue
        for path in opener.nodes:
            device = device_of.get(path)
            if device is not None and opener.uid not in wanted(path) and device.uuid not in held:
                held[device.uuid] = (opener, path)
    return held


def in_words(opener: Opener, path: str) -> str:
    """Why a device is held back, as `vaccel status` and a refusal say it."""
    return f"{opener.user}'s pid {opener.process.pid} ({opener.command[:40]}) holds {path} open without a lease there"


def leftover_of(opener: Opener, ended: Iterable[Lease], devices: Mapping[str, Device]) -> Lease | None:
    """The latest ended lease of the opener's user on a device whose node it holds: what it
    is left over from (None: it is not, it opened the node some other way)."""
    mine = [lease for lease in ended if lease.holder.uid == opener.uid and any(
        path in devices[uuid].device_nodes for uuid in lease.devices if uuid in devices for path in opener.nodes)]
    return max(mine, key=lambda lease: lease.ended_at, default=None)


def grace_left(lease: Lease, grace_s: float, now: float) -> float:
    """How long a leftover of `lease` may still run before its SIGTERM: what remains of the
    grace a release gives its holder to let go; nothing after any other end."""
    return max(0.0, lease.ended_at + grace_s - now) if lease.state == RELEASED else 0.0

"""Which nodes gate a device, and whether they can.

A device is gated when its probe named its nodes (Device.device_nodes) and each one is a
character device node that other users cannot open by its mode. Anything else fails
closed: while enforcement is on, such a device is not granted (brokerd/devices/watch.py
holds it back) and `vaccel status` shows why. A symlink is refused too: ACLs follow links,
and a node is named by the path the probe or the admin gave, never by what it points to.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from brokerd.devices.model import Device


@dataclass(frozen=True)
class NodeId:
    """How an open file of the node is recognised: its device number (the same through any
    node of that device, a container's copy included), and for a memory mapping, the
    filesystem and inode of the node itself (what /proc/PID/maps shows)."""

    path: str
    rdev: int
    dev: int
    ino: int


def node_id(path: str) -> NodeId | None:
    """The node at `path`, or None when it is not a character device node."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    return NodeId(path, st.st_rdev, st.st_dev, st.st_ino)


def node_problem(path: str) -> str:
    """Why `path` cannot gate its device, "" when it can."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} not found"
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISCHR(st.st_mode):
        return f"{path} is not a character device node"
    if st.st_mode & 0o006:
        return (f"{path} is mode {stat.S_IMODE(st.st_mode):04o}: every user can open it "
                "(make it 0660, see docs/enforcement.md)")
    return ""


def gate_problem(device: Device) -> str:
    """Why `device` cannot be gated, "" when every node of it can."""
    if device.vendor == "cpu":
        return "the CPU pseudo-device has no node to gate"
    if not device.device_nodes:
        return "no device node found for it"
    for path in device.device_nodes:
        problem = node_problem(path)
        if problem:
            return problem
    return ""


def holds_back(device: Device) -> str:
    """Why `device` must not be granted while enforcement is on, "" when it may be: gated,
    or the CPU pseudo-device (a host without GPUs has nothing to gate)."""
    return "" if device.vendor == "cpu" else gate_problem(device)


def ungated(devices: Iterable[Device]) -> dict[str, str]:
    """uuid -> why, for the devices that must not be granted while enforcement is on."""
    found = {d.uuid: holds_back(d) for d in devices}
    return {uuid: f"not gated ({why}): never granted while enforcement is on"
            for uuid, why in found.items() if why}

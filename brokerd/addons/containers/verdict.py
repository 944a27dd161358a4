"""Whether a container that has just started (or runs when the broker looks) may run on: the
rule the broker applies to what its engines report (follower.py), as at a lease's end.

A container is stopped when
- it carries `org.vaccel.lease=L` and L is not a live lease: yesterday's container started
  again (`docker start`, `docker restart`, a restart policy after an engine restart) has its
  old lease's devices and variables baked in, and that lease is over;
- it was given a device node (or the folder above one, or a device request naming it) of a
  device that is leased now, and the lease holding it is not the one it carries.
A container a live lease was let start (`vaccel run -- docker start NAME`: the broker checked
it is that lease's user's and made with its devices) counts as that lease's.

A label the container's image carries too is not the container's own: an image committed
from a leased container (`docker commit`) bakes the lease's labels in, and a plain container
of that image was never made for that lease. Such a container counts as carrying no label.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence

from brokerd.addons.containers.info import ContainerInfo
from brokerd.addons.containers.membership import LEASE_LABEL
from brokerd.devices.model import Device
from brokerd.leasing.model import Lease


def own_lease_label(labels: Mapping[str, str], image_labels: Mapping[str, str]) -> str:
    """The lease the container was made for: its lease label, unless its image gave it."""
    lease_id = labels.get(LEASE_LABEL, "")
    return "" if lease_id and image_labels.get(LEASE_LABEL) == lease_id else lease_id


def why_stop(info: ContainerInfo, image_labels: Mapping[str, str], active: Mapping[str, Lease],
             ended: Mapping[str, Lease], devices: Sequence[Device], let_start: Mapping[str, str]) -> str:
    """Why the container must not run, in words ("" = it may). `let_start`: container id ->
    the live lease it was let start under (`vaccel run -- docker start`), whatever its label."""
    lease_id = let_start.get(info.id, "")
    if lease_id not in active:
        lease_id = own_lease_label(info.labels, image_labels)
    if lease_id and lease_id not in active:
        old = ended.get(lease_id)
        how = f" ({old.state}: {old.end_reason})" if old is not None and old.end_reason else ""
        return f"it carries the label of lease {lease_id}, which has ended{how}"
    for device in held_devices(info, devices):
        holders = [lease for lease in active.values() if device.uuid in lease.devices]
        if holders and all(lease.id != lease_id for lease in holders):
            lease = holders[0]
            return (f"it holds {device.label} ({device.uuid}), leased to {lease.holder.user} (lease {lease.id}), "
                    "without a live lease of its own")
    return ""


def held_devices(info: ContainerInfo, devices: Sequence[Device]) -> list[Device]:
    """The broker's devices the container was given: a node of theirs (by its device number,
    so a symlink or another name for it counts), a folder above one, or a request naming it."""
    given_nodes, given_dirs = _given(info.device_paths)
    found = []
    for device in devices:
        nodes = [(path, _char_device(path)) for path in device.device_nodes]
        named = "*" in info.device_ids or any(i in (device.uuid, str(device.index)) for i in info.device_ids)
        if (named or any(rdev is not None and rdev in given_nodes for _, rdev in nodes)
                or any(_under(path, given_dirs) for path, _ in nodes)):
            found.append(device)
    return found


def _given(paths: Iterable[str]) -> tuple[set[int], list[str]]:
    """The device numbers of the character nodes among `paths`, and the folders among them
    (resolved: a bind mount of /dev, or of a symlink to it, gives every node under it)."""
    nodes: set[int] = set()
    folders = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            nodes.add(st.st_rdev)
        elif stat.S_ISDIR(st.st_mode) and os.path.realpath(path) != "/":
            # Not "/": a root bind gives no node the devices cgroup does not allow anyway.
            folders.append(os.path.realpath(path))
    return nodes, folders


def _char_device(path: str) -> int | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_rdev if stat.S_ISCHR(st.st_mode) else None


def _under(path: str, folders: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real.startswith(folder.rstrip("/") + "/") for folder in folders)

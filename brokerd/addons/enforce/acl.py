"""A device node's named-user POSIX ACL entries, read and set.

Through pylibacl (import name posix1e), the maintained binding of libacl: the ACL is read
and written in-process as one getxattr/setxattr pair, with libacl's own mask rule, so the
event loop never waits on a `setfacl` subprocess and no text output is parsed. The file
is named by path, never opened: opening a GPU's node would open the device.

Only named-user entries are touched, and on a gated node they belong to the broker: the
owner, group and other entries (the mode the admin set) and any named-group entries stay
as they are. The mask is recomputed on every change (libacl's acl_calc_mask), so it grants
no more than the entries do; once no named entry remains, the mask goes too and the node
is left with its plain mode.
"""

from __future__ import annotations

from typing import Any


class AclError(Exception):
    """An ACL could not be read or set; the message names the node."""


def _posix1e() -> Any:
    try:
        import posix1e
    except ImportError as exc:  # config.py refuses mode "acl" without it; this is the backstop
        raise AclError(f"pylibacl is not installed: {exc}") from exc
    return posix1e


def _read(path: str) -> Any:
    posix1e = _posix1e()
    try:
        return posix1e.ACL(file=path)
    except OSError as exc:
        raise AclError(f"cannot read the ACL of {path}: {exc.strerror}") from exc


def users(path: str) -> set[int]:
    """The uids with a named entry on `path`."""
    posix1e = _posix1e()
    return {entry.qualifier for entry in _read(path) if entry.tag_type == posix1e.ACL_USER}


def set_users(path: str, wanted: set[int]) -> tuple[set[int], set[int]]:
    """Make the named-user entries of `path` exactly `wanted`, each read-write. Returns
    (added, removed); writes nothing when nothing changes."""
    posix1e = _posix1e()
    acl = _read(path)
    named = [entry for entry in acl if entry.tag_type == posix1e.ACL_USER]
    have = {entry.qualifier for entry in named}
    stale = [e for e in named if e.qualifier not in wanted or not (e.permset.read and e.permset.write)]
    added = wanted - {e.qualifier for e in named if e not in stale}
    if not stale and not added:
        return set(), set()
    for entry in stale:
        acl.delete_entry(entry)
    for uid in sorted(added):
        entry = acl.append()
        entry.tag_type = posix1e.ACL_USER
        entry.qualifier = uid
        entry.permset.clear()
        entry.permset.add(posix1e.ACL_READ)
        entry.permset.add(posix1e.ACL_WRITE)
    masks = [entry for entry in acl if entry.tag_type == posix1e.ACL_MASK]
    if wanted or any(entry.tag_type == posix1e.ACL_GROUP for entry in acl):
        acl.calc_mask()
    else:
        for mask in masks:  # a minimal ACL again: the group bits go back to the owning group's
            acl.delete_entry(mask)
    try:
        acl.applyto(path)
    except OSError as exc:
        raise AclError(f"cannot set the ACL of {path}: {exc.strerror}") from exc
    return added, have - wanted

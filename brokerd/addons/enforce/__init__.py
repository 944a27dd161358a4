"""Leases enforced by the kernel (`[enforce] mode = "acl"`): a device's nodes open only
for its lease holder.

The admin keeps the per-device nodes closed to other users (mode 0660 root:root, see
docs/enforcement.md); on each grant the broker adds a POSIX ACL entry for the holder's uid
on exactly the leased devices' nodes, and removes it when the lease ends, then stops what
the old holder still has open there. The shared control nodes are never touched.

- nodes.py    which nodes gate a device, and whether they can (the fail-closed rule)
- acl.py      a node's named-user ACL entries, read and set (pylibacl)
- openers.py  which processes hold a node open (/proc/*/fd and /proc/*/maps)
- gate.py     the lease hook that ties them to the lease table

Nothing here is imported unless the mode is "acl" (nodes.py excepted: it has no
dependencies), so the daemon needs pylibacl only then.
"""

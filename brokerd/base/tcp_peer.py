"""Who is at the other end of a loopback TCP connection, as the kernel knows it.

The dashboard and the metrics endpoint listen on loopback without a login, so every local
user arrives from 127.0.0.1 (or from any other of 127/8's sixteen million addresses):
an address says nothing about who is asking, and a per-address budget is no budget. The
kernel does know: the client's end of the connection is a socket on this host, owned by
the user who made it. One sock_diag request (NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, an
exact lookup of that socket by its four addresses and ports, as `ss` does) answers with
its uid. Nothing the client sends can change that answer: it is identd, asked of the
kernel instead of a daemon.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2 up to its socket id
_ID = struct.Struct("!HH16s16s")  # inet_diag_sockid: ports and addresses, in network order
_ID_TAIL = struct.Struct("=III")  # ... the interface and the cookie (none: an exact lookup)
# inet_diag_msg: 4 one-byte fields, the 48-byte socket id, then expires, rqueue, wqueue, uid, inode.
_UID_AT = _HEADER.size + 4 + 48 + 12
TIMEOUT_S = 1.0


def peer_uid(local: tuple[str, int], peer: tuple[str, int]) -> int | None:
    """The uid that owns the client's socket of a TCP connection this host accepted on
    `local` from `peer` (both as getsockname/getpeername give them), or None when the
    peer is not on this host or the kernel does not say."""
    try:
        here, there = ipaddress.ip_address(local[0]), ipaddress.ip_address(peer[0])
    except ValueError:
        return None
    if here.version != there.version:
        return None
    family = socket.AF_INET if there.version == 4 else socket.AF_INET6
    # The client's socket: its source is our peer, its destination is us.
    sock_id = _ID.pack(peer[1], local[1], there.packed.ljust(16, b"\0"), here.packed.ljust(16, b"\0"))
    body = (_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sock_id
            + _ID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    message = _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as diag:
            diag.settimeout(TIMEOUT_S)
            diag.send(message)
            reply = diag.recv(8192)
    except OSError:
        return None
    if len(reply) < _HEADER.size:
        return None
    kind = _HEADER.unpack_from(reply)[1]
    if kind == NLMSG_ERROR or len(reply) < _UID_AT + 4:
        return None  # ENOENT: not a socket of this host (a remote peer, or it has gone)
    return struct.unpack_from("=I", reply, _UID_AT)[0]


def uid_of_connection(sock: socket.socket) -> int | None:
    """`peer_uid` for an accepted socket."""
    with contextlib.suppress(OSError):
        local, peer = sock.getsockname(), sock.getpeername()
        return peer_uid(local[:2], peer[:2])
    return None


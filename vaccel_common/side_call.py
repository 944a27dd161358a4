"""Unary calls over the identity socket: the short way in for short-lived clients.

A `vaccel run -- true` or a `vaccel status` makes one or two unary calls. Over gRPC such a
process first pays for importing grpc: 85-110 ms on a 2-core machine, more than all the
rest of the process. The identity socket is plain bytes already, and its connection is
the kernel's own word on who the caller is, so it also carries these few calls:

    daemon -> client   the token line, as on every connection (vaccel_common/auth.py)
    client -> daemon   b"CALL <Method> <length>\\n", then <length> bytes: the request message
    daemon -> client   b"<code> <length>\\n", then <length> bytes: the reply message when
                       code is 0, else the error's details in UTF-8 (codes are gRPC's)

The daemon runs the very servicer method that gRPC runs, with the same decoding,
validation, token check and per-user bounds, and the token it has just minted for this
connection, so a refusal (a code other than 0) is the one gRPC would give, word for
word, and the client raises it as gRPC's. A client that hears UNIMPLEMENTED, or no
answer at all (a daemon that predates this closes after the token line; a connection
past the daemon's bounds is not read), makes the same call over gRPC.
"""

from __future__ import annotations

# Unary calls a short-lived client makes; each is answered at once.
METHODS = frozenset({"TryAcquire", "Release", "Status"})
# A bigger request (a large contract file) takes the gRPC path: this bounds what one
# waiting connection can make the daemon hold.
MAX_REQUEST_BYTES = 64 << 10
MAX_HEADER_BYTES = 64
UNIMPLEMENTED = 12  # gRPC's code: "not served here", the client asks over gRPC
_CALL = b"CALL"


def request_header(method: str, length: int) -> bytes:
    return b"%s %s %d\n" % (_CALL, method.encode(), length)


def parse_request_header(line: bytes) -> tuple[str, int] | None:
    """(method, length) of a request header, or None for anything else."""
    parts = line.rstrip(b"\n").split(b" ")
    if len(parts) != 3 or parts[0] != _CALL or not parts[2].isdigit():
        return None
    length = int(parts[2])
    if length > MAX_REQUEST_BYTES:
        return None
    try:
        return parts[1].decode("ascii"), length
    except UnicodeDecodeError:
        return None


def reply_header(code: int, length: int) -> bytes:
    return b"%d %d\n" % (code, length)


def parse_reply_header(line: bytes) -> tuple[int, int] | None:
    """(code, length) of a reply header, or None for anything else."""
    parts = line.rstrip(b"\n").split(b" ")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1])

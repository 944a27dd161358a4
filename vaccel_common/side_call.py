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

Views: a few methods answer with what the CLI prints instead of a message, so that a
`vaccel status` needs neither protobuf nor the renderer (vaccel/entry.py). A view runs
the servicer method it names in VIEWS (same token, same privacy rules, same bounds) and
renders its reply with the CLI's own code (vaccel_common/status_text.py, status_json.py;
brokerd/edge/status_views.py). A view's request is that method's request message; its
reply is UTF-8 text whose first line lists the clocks to show in the viewer's time zone:
"<offset> <unix time>" pairs, space-separated (`marked_text`, `local_text`).
"""

from __future__ import annotations

import time

# Views: the rendered reply of the method each names.
VIEWS = {"StatusText": "Status", "StatusJson": "Status"}
# Unary calls a short-lived client makes; each is answered at once.
METHODS = frozenset({"TryAcquire", "Release", "Status", *VIEWS})
CLOCK_WIDTH = 5  # a marked clock is "HH:MM"
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


def marked_text(text: str, clocks: list[tuple[int, float]]) -> bytes:
    """A view's reply: `text` with the (offset, unix time) of each HH:MM in it."""
    return " ".join(f"{offset} {ts!r}" for offset, ts in clocks).encode() + b"\n" + text.encode()


def local_text(payload: bytes) -> str:
    """A view's reply as this process shows it: each marked HH:MM rewritten in its own time
    zone (the broker wrote its own). Raises ValueError for a reply that is not a view's."""
    head, _, body = payload.partition(b"\n")
    text = body.decode()
    numbers = head.split()
    if len(numbers) % 2:
        raise ValueError("a view's clocks come in pairs")
    for i in range(0, len(numbers), 2):
        offset, ts = int(numbers[i]), float(numbers[i + 1])
        if not 0 <= offset <= len(text) - CLOCK_WIDTH or text[offset + 2] != ":":
            raise ValueError("a view's clock is not where it says")
        clock = time.localtime(ts)
        text = f"{text[:offset]}{clock.tm_hour:02d}:{clock.tm_min:02d}{text[offset + CLOCK_WIDTH:]}"
    return text

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

Views: a few methods answer with what the CLI prints or uses instead of a message, so
that a `vaccel status` or a plain `vaccel run` needs neither protobuf nor the CLI's
renderers (vaccel/entry.py, vaccel/run/quick_run.py). A view runs the servicer method it
names in VIEWS (same token, same checks, same bounds) and renders its reply with the
CLI's own code (brokerd/edge/views.py). A view's request is that method's request
message (the two a plain `vaccel run` sends are written here: `acquire_request`,
`release_request`). The replies:
- StatusText, StatusJson: UTF-8 text whose first line lists the clocks to show in the
  viewer's time zone, "<offset> <unix time>" pairs, space-separated (`marked_text`,
  `local_text`);
- RunNow (TryAcquire): `packed` fields: b"wait" (nothing was granted, nothing queued), or
  b"granted", the lease id, the grant's stderr lines (NUL-separated), the AcquireUpdate itself (for the
  full runner, vaccel/run/runner.py, when the command outlives the quick path), the
  variables to set ("K=V" NUL-separated), those to remove (NUL-separated), and the
  heartbeat interval in seconds.
"""

from __future__ import annotations

import time

# Views: the rendered reply of the method each names.
VIEWS = {"StatusText": "Status", "StatusJson": "Status", "RunNow": "TryAcquire"}
# Unary calls a short-lived client makes; each is answered at once (AttachContainer once the
# broker has confirmed the container with its engine: `vaccel run -- docker run` names its
# container this way, and a short container's run then never imports grpc).
METHODS = frozenset({"TryAcquire", "Release", "Status", "AttachContainer", *VIEWS})
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


def packed(fields: list[bytes]) -> bytes:
    """Fields as "<length>\\n<bytes>" each, for a view's reply."""
    return b"".join(b"%d\n%s" % (len(field), field) for field in fields)


def unpacked(payload: bytes) -> list[bytes]:
    """The fields of `packed`; ValueError for anything else."""
    fields, at = [], 0
    while at < len(payload):
        end = payload.index(b"\n", at, at + 12)
        length = int(payload[at:end])
        at = end + 1 + length
        if length < 0 or at > len(payload):
            raise ValueError("a view's field runs past its end")
        fields.append(payload[end + 1:at])
    return fields


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _string(field: int, text: str) -> bytes:
    data = text.encode()
    return _varint(field << 3 | 2) + _varint(len(data)) + data if data else b""


def acquire_request(gpus: int, command: str, request_key: str) -> bytes:
    """The AcquireRequest a plain `vaccel run --gpus N -- CMD` sends (vaccel/session/lease_session.py
    LeaseRequest.build: wait forever, no contract), serialized without protobuf:
    gpus = 1, wait_forever = 4, command = 10, request_key = 11 (proto/vaccel/v1/broker.proto;
    tests/test_quick_run.py checks the bytes against protobuf's)."""
    return _varint(1 << 3) + _varint(gpus) + _varint(4 << 3) + b"\x01" + _string(10, command[:200]) + \
        _string(11, request_key)


def release_request(lease_id: str) -> bytes:
    """ReleaseRequest(lease_id = 1), serialized without protobuf."""
    return _string(1, lease_id)

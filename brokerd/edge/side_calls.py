"""The daemon's half of unary calls over the identity socket (vaccel_common/side_call.py):
read one request after the token line, run the servicer's own method on it, write the
reply.

What a caller can make this do is bounded like the gRPC socket: a request must arrive
whole within READ_TIMEOUT_S and be at most 64 KiB, a reply not read within WRITE_TIMEOUT_S
is dropped, and at most PER_USER connections of one user (MAX_OPEN of everyone's) wait
for a request at once. A connection past those bounds gets its token line only, so its
client takes the gRPC path, which has bounds of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

import grpc

from brokerd.edge.views import RENDERERS
from vaccel_common.auth import TOKEN_METADATA_KEY
from vaccel_common.side_call import (
    MAX_HEADER_BYTES,
    METHODS,
    UNIMPLEMENTED,
    VIEWS,
    parse_request_header,
    reply_header,
)

log = logging.getLogger("vaccel.brokerd")

READ_TIMEOUT_S = 5.0  # as gRPC's handshake timeout (brokerd/edge/rpc_limits.py)
WRITE_TIMEOUT_S = 5.0
PER_USER = 16
MAX_OPEN = 256  # with 64 KiB each: at most 16 MiB held for requests, 1 MiB per user


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _SideContext:
    """What the servicer's unary methods use of a gRPC context: the caller's token, and
    abort() (which, as in gRPC, always raises)."""

    def __init__(self, token: str) -> None:
        self._metadata = ((TOKEN_METADATA_KEY, token),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class SideCalls:
    """Serves METHODS with the guarded handlers the gRPC server has (brokerd/edge/rpc_limits.py)."""

    def __init__(self, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        # A view (brokerd/edge/views.py) is the method it renders, guarded alike.
        self._handlers = {name: handlers[VIEWS.get(name, name)] for name in METHODS}
        self._open: Counter[int] = Counter()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, uid: int, token: str) -> None:
        """Answer the one call the client may send after its token line (most send none)."""
        if self._open[uid] >= PER_USER or self._open.total() >= MAX_OPEN:
            return
        self._open[uid] += 1
        try:
            request = await asyncio.wait_for(_read_request(reader), READ_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return  # too slow, cut short or not a request: the client has its gRPC path
        finally:
            self._open[uid] -= 1
            if not self._open[uid]:
                del self._open[uid]
        if request is None:
            return
        code, payload = await self._dispatch(*request, token)
        writer.write(reply_header(code, len(payload)) + payload)
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)

    async def _dispatch(self, method: str, raw: bytes, token: str) -> tuple[int, bytes]:
        handler = self._handlers.get(method)
        if handler is None:
            return UNIMPLEMENTED, f"{method} is not served here; use gRPC".encode()
        try:
            reply: Any = await handler.unary_unary(raw, _SideContext(token))
            render = RENDERERS.get(method, handler.response_serializer)
            return 0, render(reply)
        except _Aborted as aborted:
            return aborted.code.value[0], aborted.details.encode()
        except Exception:  # as gRPC would: the client hears INTERNAL-ish UNKNOWN, the log has why
            log.exception("%s over the identity socket failed", method)
            return grpc.StatusCode.UNKNOWN.value[0], b"internal error"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, bytes] | None:
    """(method, request bytes), or None at once when the client closes without asking."""
    line = await reader.readline()
    if not line:
        return None
    if len(line) > MAX_HEADER_BYTES or not line.endswith(b"\n"):
        raise ValueError("not a request header")
    header = parse_request_header(line)
    if header is None:
        raise ValueError("not a request header")
    method, length = header
    return method, await reader.readexactly(length)

"""What a client can make the gRPC layer do, bounded: how many connections, how long an
idle one or one that never finishes its handshake stays, how many open files the daemon
may use, and what an undecodable message gets (INVALID_ARGUMENT, one short line, no
traceback), for every method of the service at once.
"""

from __future__ import annotations

import inspect
import logging
import resource
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from vaccel_common.v1 import broker_pb2_grpc

log = logging.getLogger("vaccel.brokerd")

SERVICE = "vaccel.v1.Broker"
OPEN_FILES = 65536  # matches LimitNOFILE= in systemd/vaccel-brokerd.service
MAX_CONNECTIONS = 16384  # below OPEN_FILES: the daemon's own files never run out first
# Calls that have arrived but that the event loop has not taken in yet. gRPC's defaults
# cancel new ones at random past 1,000 and every one past 3,000: when a lab's users start
# at once (40 users queueing 50 requests each, bench.scale), waiting requests ended
# CANCELLED before the broker saw them. Now one per connection the daemon allows: a
# flood's backlog stays bounded by the connections' bound.
MAX_PENDING_CALLS = MAX_CONNECTIONS
# And gRPC cancels a call still not taken in after 30 s: 9,000 requests queueing at once
# took the loop 34 s on the 2-core test box (bench.scale, 10,000 waiting), and the last
# 2,600 ended CANCELLED. A waiter has no deadline and may wait for the loop; a unary
# call's client gives up at its own deadline (30 s in vaccel's), which frees it first.
MAX_UNTAKEN_S = 600

# A connection costs one file descriptor until it is closed. A holder's client sends a
# heartbeat at least every 5 s and a waiter has its Acquire stream open, so neither is
# ever idle for 30 s; an idle one is closed (the client reconnects by itself), and one
# that never completes the HTTP/2 handshake is closed after 5 s.
CONNECTION_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
    ("grpc.max_connection_idle_ms", 30_000),
    ("grpc.server_handshake_timeout_ms", 5_000),
    ("grpc.max_concurrent_streams", 256),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ("grpc.server_max_unrequested_time_in_server", MAX_UNTAKEN_S),
]


def raise_open_files(limit: int = OPEN_FILES) -> int:
    """Raise the soft RLIMIT_NOFILE towards `limit` (at most the hard limit); the soft
    default of 1024 is what a thousand idle connections used to exhaust."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    return soft


class _Capture:
    """Stands in for a server to collect the generated method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


def guarded_handlers(servicer: Any, add_to_server: Callable[[Any, Any], None] | None = None,
                     max_request_bytes: int | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """The servicer's method handlers as the generated add_<Service>Servicer_to_server
    makes them (the Broker's by default), except that each method receives the raw bytes
    and decodes them itself: gRPC's own decoding failure ends as UNKNOWN with a traceback
    in the log, for what is the client's mistake. A request longer than
    `max_request_bytes` (the token-free services') is refused before it is decoded."""
    capture = _Capture()
    (add_to_server or broker_pb2_grpc.add_BrokerServicer_to_server)(servicer, capture)
    return {name: _guarded(name, handler, max_request_bytes) for name, handler in capture.handlers.items()}


def add_guarded_servicer(handlers: dict[str, grpc.RpcMethodHandler], server: grpc.aio.Server,
                         service: str = SERVICE) -> None:
    """Serve `handlers` (guarded_handlers) as `service` on `server`."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


async def _decode(name: str, decode: Callable[[bytes], Any], raw: bytes, context: grpc.aio.ServicerContext,
                  limit: int | None = None) -> Any:
    if limit is not None and len(raw) > limit:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{name}: the request is {len(raw)} bytes; this method takes at most {limit}")
    try:
        return decode(raw)
    except Exception as exc:  # any failure to decode a client's bytes is that client's mistake
        reason = type(exc).__name__
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{name}: the request message cannot be decoded ({reason}); text fields must "
                            "be UTF-8; use a client built from vaccel's proto")


def _guarded(name: str, handler: grpc.RpcMethodHandler, limit: int | None) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary(await _decode(name, decode, raw, context, limit), context)

        return grpc.unary_unary_rpc_method_handler(call, response_serializer=handler.response_serializer)
    if handler.stream_stream is not None:  # server reflection (brokerd/edge/standard_services.py)
        return _guarded_bidi(name, handler, limit)
    assert handler.unary_stream is not None, f"{name}: no client-streaming method is served"
    streaming = handler.unary_stream
    if inspect.iscoroutinefunction(streaming):  # writes with context.write (grpc.health's Watch)

        async def written(raw: bytes, context: grpc.aio.ServicerContext) -> None:
            await streaming(await _decode(name, decode, raw, context, limit), context)

        return grpc.unary_stream_rpc_method_handler(written, response_serializer=handler.response_serializer)

    serialize = handler.response_serializer or (lambda message: message)

    async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        updates = streaming(await _decode(name, decode, raw, context, limit), context)
        try:
            async for update in updates:
                # gRPC keeps the last message of a stream until the next: a waiter's is
                # kept as its bytes, not as the message (whose arena is ~6x larger).
                data = serialize(update)
                del update
                yield data
        finally:
            await updates.aclose()

    return grpc.unary_stream_rpc_method_handler(stream)


def _guarded_bidi(name: str, handler: grpc.RpcMethodHandler, limit: int | None) -> grpc.RpcMethodHandler:
    decode, bidi = handler.request_deserializer, handler.stream_stream

    async def both(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def requests() -> AsyncIterator[Any]:
            async for raw in raws:
                yield await _decode(name, decode, raw, context, limit)

        async for reply in bidi(requests(), context):
            yield reply

    return grpc.stream_stream_rpc_method_handler(both, response_serializer=handler.response_serializer)

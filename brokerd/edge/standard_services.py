"""The two standard gRPC services the daemon serves beside vaccel.v1.Broker, for generic
tools and clients in other languages (docs/api.md):

- grpc.health.v1.Health: Check and Watch answer SERVING for "" (the server), for
  vaccel.v1.Broker and for the two standard services while the daemon serves, NOT_SERVING
  once it is stopping; any other name is NOT_FOUND (Check) or one SERVICE_UNKNOWN that
  ends the stream (Watch: the daemon's services never change while it runs);
- grpc.reflection.v1alpha.ServerReflection: the services and broker.proto itself, so a
  client can discover and call the API without the generated code (grpcurl, Postman,
  a reflection-driven client).

Both are reads that change nothing and tell nothing about anyone's leases, so they need
no identity token; which is why what a caller can make them hold is bounded here (issue
43): a request is at most REQUEST_BYTES (a service name or a symbol, never a megabyte),
the health servicer keeps no state per name asked about (grpc_health's own kept a
condition per watched name, 4 MB per 1 MB name, and the memory stayed with the process),
and at most STREAMS Watch and reflection streams are open at once, everyone's together
(gRPC does not tell the server a Unix socket peer's uid, so this pool is the peer's
bound): one past that is RESOURCE_EXHAUSTED at once. A connection with no stream open is
closed after 30 s idle (brokerd/edge/rpc_limits.py). brokerd/edge/rpc_limits.py guards
their methods as it guards the Broker's (an undecodable request: INVALID_ARGUMENT, one
line, no traceback).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from brokerd.edge.rpc_limits import SERVICE, add_guarded_servicer, guarded_handlers

HEALTH_SERVICE = "grpc.health.v1.Health"
SERVED = ("", SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME)
REQUEST_BYTES = 1024  # the longest name or symbol in broker.proto is under 100 bytes
STREAMS = 64  # token-free streams open at once, everyone's together

_Status = health_pb2.HealthCheckResponse


class _Streams:
    """How many token-free streams are open; one past STREAMS is refused, not queued."""

    def __init__(self, limit: int = STREAMS) -> None:
        self.limit, self.open = limit, 0

    async def enter(self, context: grpc.aio.ServicerContext) -> None:
        if self.open >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.open} health and reflection streams are open already; "
                                "close one or use Check")
        self.open += 1

    def leave(self) -> None:
        self.open -= 1


class Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1.Health for the daemon's own fixed set of services: one flag and one
    event, whatever the callers ask about."""

    def __init__(self, streams: _Streams) -> None:
        self._streams = streams
        self._stopping = asyncio.Event()

    def _status(self, service: str) -> int:
        if service not in SERVED:
            return _Status.SERVICE_UNKNOWN
        return _Status.NOT_SERVING if self._stopping.is_set() else _Status.SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        status = self._status(request.service)
        if status == _Status.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such service here")
        return _Status(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        status = self._status(request.service)
        if status == _Status.SERVICE_UNKNOWN:
            await context.write(_Status(status=status))
            return  # it never becomes known while this daemon runs: nothing to wait for
        await self._streams.enter(context)
        try:
            await context.write(_Status(status=status))
            if status == _Status.SERVING:
                await self._stopping.wait()
                await context.write(_Status(status=_Status.NOT_SERVING))
        finally:
            self._streams.leave()

    async def enter_graceful_shutdown(self) -> None:
        """Every watcher hears NOT_SERVING; Check answers it from now on."""
        self._stopping.set()
        await asyncio.sleep(0)  # let the watchers write it before the server stops


class _Reflection(reflection.aio.ReflectionServicer):
    def __init__(self, names: tuple[str, ...], streams: _Streams) -> None:
        super().__init__(names)
        self._streams = streams

    async def ServerReflectionInfo(self, request_iterator: Any, context: grpc.aio.ServicerContext,
                                   ) -> AsyncIterator[Any]:
        await self._streams.enter(context)
        try:
            async for reply in super().ServerReflectionInfo(request_iterator, context):
                yield reply
        finally:
            self._streams.leave()


async def add_standard_services(server: grpc.aio.Server) -> Health:
    """Serve health and reflection on `server` (before it starts), each method guarded
    as the Broker's are and its requests at most REQUEST_BYTES; returns the health
    servicer, whose enter_graceful_shutdown() tells watchers the daemon is stopping."""
    streams = _Streams()
    checker = Health(streams)
    # The daemon's messages are in protobuf's default pool (vaccel_common.v1 puts them
    # there), which is where reflection looks them up.
    reflector = _Reflection((SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), streams)
    for servicer, add_to_server, name in (
            (checker, health_pb2_grpc.add_HealthServicer_to_server, HEALTH_SERVICE),
            (reflector, reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.SERVICE_NAME)):
        add_guarded_servicer(guarded_handlers(servicer, add_to_server, max_request_bytes=REQUEST_BYTES),
                             server, name)
    return checker

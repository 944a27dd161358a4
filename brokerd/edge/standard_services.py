"""The two standard gRPC services the daemon serves beside vaccel.v1.Broker, for generic
tools and clients in other languages (docs/api.md):

- grpc.health.v1.Health: Check and Watch answer SERVING for "" (the server) and for
  vaccel.v1.Broker while the daemon serves, NOT_SERVING once it is stopping;
- grpc.reflection.v1alpha.ServerReflection: the services and broker.proto itself, so a
  client can discover and call the API without the generated code (grpcurl, Postman,
  a reflection-driven client).

Both are reads that change nothing and tell nothing about anyone's leases, so they need
no identity token. brokerd/edge/rpc_limits.py guards their methods as it guards the Broker's
(an undecodable request: INVALID_ARGUMENT, one line, no traceback) and bounds their
connections and streams with every other.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from brokerd.edge.rpc_limits import SERVICE, add_guarded_servicer, guarded_handlers

HEALTH_SERVICE = health.SERVICE_NAME  # grpc.health.v1.Health


async def add_standard_services(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """Serve health and reflection on `server` (before it starts), each method guarded
    as the Broker's are; returns the health servicer, whose enter_graceful_shutdown()
    tells watchers the daemon is stopping."""
    checker = health.aio.HealthServicer()
    await checker.set("", health_pb2.HealthCheckResponse.SERVING)
    await checker.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    # The daemon's messages are in protobuf's default pool (vaccel_common.v1 puts them
    # there), which is where reflection looks them up.
    reflector = reflection.aio.ReflectionServicer((SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME))
    for servicer, add_to_server, name in (
            (checker, health_pb2_grpc.add_HealthServicer_to_server, HEALTH_SERVICE),
            (reflector, reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.SERVICE_NAME)):
        add_guarded_servicer(guarded_handlers(servicer, add_to_server), server, name)
    return checker

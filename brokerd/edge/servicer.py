"""gRPC servicer: checks the caller's token, validates the message, makes one call into
the core (brokerd/core/service.py), and turns its plain result into a message and a
domain error into a precise status code. No broker logic and no permission lives here:
both are the core's (brokerd/core/permissions.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from brokerd.base.process import Identity
from brokerd.contract import Requirement
from brokerd.contract.convert import check_line_to_proto
from brokerd.contract.spec import ContractError
from brokerd.core.service import BrokerService
from brokerd.core.views import DeviceView
from brokerd.core.waiting import QueuedUpdate
from brokerd.edge.identity import TokenAuthority, TokenError
from brokerd.edge.messages import held_pb, lease_pb, report_pb, status_reply, view_pb
from brokerd.edge.status_cache import StatusCache
from brokerd.edge.validation import (
    acquire_problem,
    attach_problem,
    check_problem,
    release_problem,
    report_problem,
)
from brokerd.edge.views import remember_config
from brokerd.edge.work_guard import WorkGuard
from brokerd.leasing.errors import Busy, LeaseError, Unsatisfiable
from brokerd.leasing.model import Lease
from vaccel_common.auth import TOKEN_METADATA_KEY
from vaccel_common.v1 import broker_pb2 as pb
from vaccel_common.v1 import broker_pb2_grpc

log = logging.getLogger("vaccel.brokerd")

HELD_MAX_AGE_S = 1.0  # a queue line's held devices say their time left to within this

_CODES = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "internal": grpc.StatusCode.INTERNAL,
    "unavailable": grpc.StatusCode.UNAVAILABLE,  # for now: ask again (a full disk)
}


class BrokerServicer(broker_pb2_grpc.BrokerServicer):
    def __init__(self, service: BrokerService, authority: TokenAuthority) -> None:
        self.service = service
        self.authority = authority
        self.guard = WorkGuard()  # contract parsing and evaluation: off the loop, per-user bounded
        self._held_cache: tuple[tuple[DeviceView, ...], float, list[pb.Device]] = ((), 0.0, [])
        self.status_cache = StatusCache()  # one reply for every poller until the state changes

    # -- helpers -----------------------------------------------------------------------

    async def _identity(self, context: grpc.aio.ServicerContext) -> Identity:
        token = next((v for k, v in context.invocation_metadata() or () if k == TOKEN_METADATA_KEY), None)
        try:
            return self.authority.verify(token)
        except TokenError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise AssertionError("context.abort() always raises") from exc

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
        if isinstance(exc, LeaseError):
            await context.abort(_CODES.get(exc.kind, grpc.StatusCode.FAILED_PRECONDITION), str(exc))
        if isinstance(exc, ContractError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise exc

    async def _refuse_invalid(self, context: grpc.aio.ServicerContext, problem: str) -> None:
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

    def lease_pb(self, lease: Lease) -> pb.Lease:
        service = self.service
        return lease_pb(lease, ttl_s=service.ttl_s, device=service.device, job_id=service.outside_job(lease.id))

    def _held_pb(self, held: tuple[DeviceView, ...]) -> list[pb.Device]:
        """The held devices of a queue update as messages, built once per announcement (all
        its waiters get the same tuple) and shared by the newcomers after it while the views
        stay equal: building 64 devices for each of 500 waiters on every grant was most of
        a grant's time on a large host."""
        cached, built_at, messages = self._held_cache
        now = time.monotonic()
        # Equal views (a newcomer's own first line: its tuple is new, its devices and
        # leases are not) share the messages too, for as long as their time left is right.
        if cached is not held and (cached != held or now - built_at >= HELD_MAX_AGE_S):
            messages = [held_pb(view) for view in held]
            self._held_cache = (held, now, messages)
        return messages

    async def _asked(self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext,
                     ) -> tuple[Identity, Requirement, dict[str, object]]:
        """Who asks, for what, and the service's keyword arguments: what Acquire and
        TryAcquire share."""
        identity = await self._identity(context)
        await self._refuse_invalid(context, acquire_problem(request))
        try:
            requirement: Requirement = await self.guard.requirement(
                identity.uid, request, self.service.snapshot.devices)
        except (ContractError, LeaseError) as exc:
            await self._fail(context, exc)
        remember_config(request.accelerator_config_yaml, requirement.config)  # for a RunNow grant's view
        # Everything the evaluation depends on, so equal requests share one evaluation.
        cache_key = (request.gpus, request.min_memory_mib, request.runtime_spec_yaml,
                     request.accelerator_config_yaml, request.client.SerializeToString(deterministic=True))
        asked: dict[str, object] = dict(
            command=request.command[:200], accelerator_config_yaml=request.accelerator_config_yaml,
            cache_key=cache_key, key=request.request_key[:64], time_limit_s=request.time_limit_s,
            devices=tuple(request.devices), reservation=request.reservation, memory_mib=request.memory_mib)
        return identity, requirement, asked

    # -- RPCs --------------------------------------------------------------------------

    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AcquireUpdate]:
        identity, requirement, asked = await self._asked(request, context)
        wait = request.wait_forever or request.max_wait_seconds > 0
        max_wait = None if request.wait_forever else request.max_wait_seconds
        updates = self.service.acquire(identity, requirement, wait=wait, max_wait_s=max_wait,
                                       spec=request.SerializeToString(), **asked)  # type: ignore[arg-type]
        told_held = False
        try:
            async for update in updates:
                if isinstance(update, QueuedUpdate):
                    # The held devices go in the first update only: the message names the
                    # holders after that, and 64 devices in every update to 500 waiters at
                    # every grant was most of a large host's grant latency.
                    line = pb.AcquireUpdate()  # built in place: a pb.Queued passed in would be a second copy
                    queued = line.queued
                    queued.position, queued.total, queued.message = update.position, update.total, update.message
                    queued.request_id = update.request_id
                    if not told_held and update.held:
                        queued.held.extend(self._held_pb(update.held))
                        told_held = True
                    yield line
                    # Not kept while it waits (nor by the guard: brokerd/edge/rpc_limits.py):
                    # a first line with 64 held devices is ~40 KB as a message, 6 KB as bytes.
                    del line, queued
                else:
                    yield pb.AcquireUpdate(granted=self.lease_pb(update))
        except (LeaseError, ContractError) as exc:
            await self._fail(context, exc)
        finally:
            await updates.aclose()

    async def TryAcquire(self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext) -> pb.AcquireUpdate:
        """Granted now, or Queued(position=0) when it would wait (queued nowhere: the client
        waits with Acquire). A request that may not wait hears Busy as on the stream."""
        identity, requirement, asked = await self._asked(request, context)
        may_wait = request.wait_forever or request.max_wait_seconds > 0
        try:
            lease = await self.service.acquire_now(identity, requirement, may_wait=may_wait,
                                                   **asked)  # type: ignore[arg-type]
        except Busy as exc:
            if may_wait:
                return pb.AcquireUpdate(queued=pb.Queued(message=str(exc)))
            await self._fail(context, exc)
        except (LeaseError, ContractError) as exc:
            await self._fail(context, exc)
        return pb.AcquireUpdate(granted=self.lease_pb(lease))

    async def Heartbeat(self, request: pb.LeaseRef, context: grpc.aio.ServicerContext) -> pb.HeartbeatReply:
        identity = await self._identity(context)
        try:
            lease = await self.service.heartbeat(identity, request.lease_id)
        except LeaseError as exc:
            await self._fail(context, exc)
        return pb.HeartbeatReply(ttl_s=self.service.ttl_s, expires_at=lease.expires_at, notice=lease.notice)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.Lease:
        identity = await self._identity(context)
        try:
            problem = release_problem(request)
            if problem:
                raise Unsatisfiable(problem)
            lease = await self.service.release(identity, request.lease_id, request.reason[:500], request.grace_s)
        except LeaseError as exc:
            await self._fail(context, exc)
        return self.lease_pb(lease)

    async def Join(self, request: pb.LeaseRef, context: grpc.aio.ServicerContext) -> pb.Lease:
        identity = await self._identity(context)
        try:
            lease = await self.service.join(identity, request.lease_id)
        except LeaseError as exc:
            await self._fail(context, exc)
        return self.lease_pb(lease)

    async def AttachContainer(self, request: pb.AttachContainerRequest, context: grpc.aio.ServicerContext
                              ) -> pb.Lease:
        identity = await self._identity(context)
        await self._refuse_invalid(context, attach_problem(request))
        try:
            lease = await self.service.attach_container(
                identity, request.lease_id, request.container_id, request.init_pid, held=request.held,
                warn_signal=request.warn_signal, shown=(request.name, request.image), starting=request.starting)
        except LeaseError as exc:
            await self._fail(context, exc)
        return self.lease_pb(lease)

    async def GetLease(self, request: pb.LeaseRef, context: grpc.aio.ServicerContext) -> pb.Lease:
        identity = await self._identity(context)
        try:
            lease = self.service.get(identity, request.lease_id)
        except LeaseError as exc:
            await self._fail(context, exc)
        return self.lease_pb(lease)

    async def ListLeases(
        self, request: pb.ListLeasesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLeasesReply:
        identity = await self._identity(context)
        try:
            leases = self.service.leases(identity, everyone=request.all, include_ended=request.include_ended)
        except LeaseError as exc:
            await self._fail(context, exc)
        return pb.ListLeasesReply(leases=[self.lease_pb(lease) for lease in leases])

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        identity = await self._identity(context)
        try:
            self.service.may_see_status(identity)
            return self.status_cache.reply(self.service, identity, lambda: status_reply(self.service, identity))
        except LeaseError as exc:
            await self._fail(context, exc)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.Device:
        identity = await self._identity(context)
        try:
            view = await self.service.drain(identity, request.device, request.reason[:500], request.undo)
        except LeaseError as exc:
            await self._fail(context, exc)
        return view_pb(view, with_drain_reason=True)

    async def Check(self, request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> pb.CheckReply:
        identity = await self._identity(context)
        await self._refuse_invalid(context, check_problem(request))
        try:
            requirement = await self.guard.requirement(
                identity.uid, request, self.service.snapshot.devices, check=True)
            check = self.service.check(identity, requirement)
        except (ContractError, LeaseError) as exc:
            await self._fail(context, exc)
        evaluation = check.evaluation
        reply = pb.CheckReply(satisfiable=evaluation.satisfiable, summary=evaluation.reason)
        reply.host_checks.extend(check_line_to_proto(line) for line in evaluation.host_checks)
        for view in check.devices:
            uuid = view.device.uuid
            reply.devices.append(pb.DeviceCheck(
                device=view_pb(view), eligible=uuid in evaluation.eligible,
                checks=[check_line_to_proto(line) for line in evaluation.per_device.get(uuid, ())],
            ))
        reply.suggestions.extend(evaluation.suggestions)
        return reply

    async def Report(self, request: pb.ReportRequest, context: grpc.aio.ServicerContext) -> pb.ReportReply:
        identity = await self._identity(context)
        await self._refuse_invalid(context, report_problem(request))
        if not self.service.keeps_accounting:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this broker keeps no accounting")
        reply = None
        try:  # the pages as one reply, as this call always answered (ReportPages for any size)
            async for page in self.service.report(identity, request.since, request.until, request.by or "user"):
                if reply is None:
                    reply = report_pb(page)
                else:
                    reply.rows.extend(report_pb(page).rows)
        except LeaseError as exc:
            await self._fail(context, exc)
        return reply

    async def ReportPages(self, request: pb.ReportRequest, context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[pb.ReportReply]:
        identity = await self._identity(context)
        await self._refuse_invalid(context, report_problem(request))
        if not self.service.keeps_accounting:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this broker keeps no accounting")
        try:
            async for page in self.service.report(identity, request.since, request.until, request.by or "user"):
                yield report_pb(page)
        except LeaseError as exc:
            await self._fail(context, exc)

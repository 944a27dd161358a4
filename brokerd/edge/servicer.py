"""gRPC servicer: checks the caller's token, validates the message, calls BrokerService,
turns its plain results into messages and domain errors into precise status codes. No
broker logic and no permission lives here: both are the service's (brokerd/core/permissions.py).
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from brokerd import __version__
from brokerd.addons.slurm.status import add_slurm_status
from brokerd.base.process import Holder, Identity
from brokerd.contract import Requirement
from brokerd.contract.convert import check_line_to_proto, requirement_from_request
from brokerd.contract.spec import ContractError
from brokerd.core.queueing import Rebuilt
from brokerd.core.service import BrokerService
from brokerd.core.views import DeviceView
from brokerd.core.waiting import QueuedUpdate
from brokerd.devices.model import Device
from brokerd.devices.nodes import gate_problem
from brokerd.edge.identity import TokenAuthority, TokenError
from brokerd.edge.status_cache import StatusCache
from brokerd.edge.work_guard import WorkGuard
from brokerd.leasing.errors import Busy, LeaseError, Unsatisfiable
from brokerd.leasing.model import Lease, heartbeat_interval
from brokerd.state.report import BY as REPORT_BY
from brokerd.state.report import Report, ReportRow
from vaccel_common.auth import TOKEN_METADATA_KEY
from vaccel_common.v1 import broker_pb2 as pb
from vaccel_common.v1 import broker_pb2_grpc

log = logging.getLogger("vaccel.brokerd")

MAX_GPUS = 1024
MAX_MEMORY_MIB = 1 << 40  # 1 EiB: anything above is a typo, not a GPU
MAX_WAIT_S = 366 * 86400
MAX_TIME_LIMIT_S = 366 * 86400  # the policy's time_max refuses far less; this catches typos early
HELD_MAX_AGE_S = 1.0  # a queue line's held devices say their time left to within this
MAX_TEXT = 256 * 1024  # contract files and config: plenty for YAML a human writes

_CODES = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "internal": grpc.StatusCode.INTERNAL,
}


def _fill_holder(msg: pb.Holder, h: Holder) -> None:
    """Set a message's holder in place (a Holder built and then copied in is two)."""
    msg.user, msg.uid, msg.pid, msg.command = h.user, h.uid, h.pid, h.command


def device_pb(device: Device, state: str = "", lease: Lease | None = None, drain_reason: str = "",
              *, into: Any = None) -> pb.Device:
    """The device as a message; with `into` (a repeated Device field), added to it in place."""
    msg = (pb.Device if into is None else into.add)(
        index=device.index, uuid=device.uuid, vendor=device.vendor, name=device.name,
        memory_mib=device.memory_mib, pci_bus_id=device.pci_bus_id, arch=device.arch,
        driver_version=device.driver_version, memory_bandwidth_gbps=device.memory_bandwidth_gbps,
        healthy=device.healthy, health_reason=device.health_reason, simulated=device.simulated,
        numa_node=device.numa_node, backend=device.backend, state=state,
        memory_used_mib=device.memory_used_mib, interconnect_group=device.interconnect_group,
        runtime_version=device.runtime_version, compute_capability=device.compute_capability,
        visible_id=device.visible, drain_reason=drain_reason, device_nodes=device.device_nodes,
    )
    if lease is not None:
        _add_lease(msg, lease)
    return msg


def _add_lease(msg: pb.Device, lease: Lease) -> None:
    msg.lease_id = lease.id
    _fill_holder(msg.holder, lease.holder)
    if lease.reservation:
        msg.holder.pid = 0  # held by the user: the command that booked it has gone
    msg.since = lease.granted_at
    if lease.expires_at and lease.active:
        msg.time_left_s = max(0.0, lease.expires_at - time.time())


def held_pb(view: DeviceView) -> pb.Device:
    """A held device in a waiter's queue line: who holds what, since when, for how long.
    Not the whole device (Status has that): every waiter's first line carries one per held
    device, and gRPC keeps a stream's last message until its next one, so 500 waiters on a
    64-device host kept ~100 KB each of full devices."""
    msg = pb.Device(index=view.device.index, uuid=view.device.uuid, name=view.device.name, state=view.state)
    if view.lease is not None:
        _add_lease(msg, view.lease)
    return msg


def view_pb(view: DeviceView, *, with_drain_reason: bool = False, into: Any = None) -> pb.Device:
    return device_pb(view.device, view.state, view.lease, view.drain_reason if with_drain_reason else "",
                     into=into)


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

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        if isinstance(exc, LeaseError):
            await context.abort(_CODES.get(exc.kind, grpc.StatusCode.FAILED_PRECONDITION), str(exc))
        if isinstance(exc, ContractError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise exc

    def lease_pb(self, lease: Lease) -> pb.Lease:
        ttl_s = self.service.ttl_s
        msg = pb.Lease(
            id=lease.id, backend=lease.backend, granted_at=lease.granted_at,
            expires_at=lease.expires_at, heartbeat_interval_s=heartbeat_interval(ttl_s),
            ttl_s=ttl_s, state=lease.state, end_reason=lease.end_reason,
            allocator_config=lease.terms.allocator_config, memory_cap_mib=lease.terms.memory_cap_mib,
            member_pids=sorted(member.pid for member in lease.members), simulated=lease.simulated,
            accelerator_config_yaml=lease.terms.accelerator_config_yaml, ended_at=lease.ended_at,
            reservation=lease.reservation, requested_at=lease.requested_at, notice=lease.notice,
            time_limit_s=lease.time_limit_s,
        )
        if self.service.slurm is not None:  # delegate mode: the Slurm job behind it
            msg.slurm_job_id = self.service.slurm.job_id(lease.id)
        _fill_holder(msg.holder, lease.holder)
        for uuid in lease.devices:
            device = self.service.device(uuid)
            if device is not None:
                device_pb(device, "leased" if lease.active else "", lease, into=msg.devices)
            else:
                msg.devices.append(pb.Device(uuid=uuid, state="missing"))
        msg.warnings.extend(check_line_to_proto(w) for w in lease.warnings)
        return msg

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

    # -- RPCs --------------------------------------------------------------------------

    async def _asked(self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext,
                     ) -> tuple[Identity, Requirement, dict[str, object]]:
        """Who asks, for what, and the service's keyword arguments: what Acquire and
        TryAcquire share."""
        identity = await self._identity(context)
        problem = _validate_acquire(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            requirement: Requirement = await self.guard.requirement(
                identity.uid, request, self.service.snapshot.devices)
        except (ContractError, LeaseError) as exc:
            await self._fail(context, exc)
        # Everything the evaluation depends on, so equal requests share one evaluation.
        cache_key = (request.gpus, request.min_memory_mib, request.runtime_spec_yaml,
                     request.accelerator_config_yaml, request.client.SerializeToString(deterministic=True))
        asked: dict[str, object] = dict(
            command=request.command[:200], accelerator_config_yaml=request.accelerator_config_yaml,
            cache_key=cache_key, key=request.request_key[:64], time_limit_s=request.time_limit_s,
            devices=tuple(request.devices), reservation=request.reservation)
        return identity, requirement, asked

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
            if not 0 <= request.grace_s <= MAX_WAIT_S:
                raise Unsatisfiable(f"grace must be between 0 and {MAX_WAIT_S:.0f} seconds, got {request.grace_s}")
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
            return self.status_cache.reply(self.service, lambda: status_reply(self.service, identity))
        except LeaseError as exc:
            await self._fail(context, exc)
            raise

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.Device:
        identity = await self._identity(context)
        try:
            view = await self.service.drain(identity, request.device, request.reason[:500], request.undo)
        except LeaseError as exc:
            await self._fail(context, exc)
        return view_pb(view, with_drain_reason=True)

    async def Check(self, request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> pb.CheckReply:
        identity = await self._identity(context)
        if len(request.runtime_spec_yaml) > MAX_TEXT or len(request.accelerator_config_yaml) > MAX_TEXT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "contract file larger than 256 KiB")
        try:
            requirement = await self.guard.requirement(
                identity.uid, request, self.service.snapshot.devices, check=True)
        except (ContractError, LeaseError) as exc:
            await self._fail(context, exc)
        try:
            check = self.service.check(identity, requirement)
        except LeaseError as exc:
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
        problem = _validate_report(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if getattr(self.service, "accounting", None) is None:  # brokerd/daemon/addons.py sets it
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this broker keeps no accounting")
        try:
            report = await self.service.report(identity, request.since, request.until, request.by or "user")
        except LeaseError as exc:
            await self._fail(context, exc)
        return report_pb(report)


def report_pb(report: Report) -> pb.ReportReply:
    def row(r: ReportRow) -> pb.ReportRow:
        return pb.ReportRow(key=r.key, device_hours=r.device_hours, leases=r.leases, wait_p50_s=r.wait_p50_s,
                            wait_p90_s=r.wait_p90_s, wait_max_s=r.wait_max_s,
                            idle_device_hours=r.idle_device_hours, end_reasons=r.end_reasons)

    return pb.ReportReply(since=report.since, until=report.until, by=report.by, rows=[row(r) for r in report.rows],
                          total=row(report.total), rows_hidden=report.rows_hidden)


def _validate_report(request: pb.ReportRequest) -> str:
    if request.by not in ("", *REPORT_BY):
        return f"by must be one of {', '.join(REPORT_BY)}, got {request.by[:40]!r}"
    if not all(math.isfinite(t) and 0 <= t < 1e11 for t in (request.since, request.until)):
        return "since and until must be Unix times (0: the default)"
    if request.since and request.until and request.since >= request.until:
        return "since must come before until"
    return ""


def status_reply(service: BrokerService, identity: Identity) -> pb.StatusReply:
    """What `vaccel status` shows `identity`, as a message: the Status RPC's reply, and the
    dashboard's (brokerd/addons/web), which asks as an anonymous local user."""
    status = service.status(identity)
    reply = pb.StatusReply(hostname=socket.gethostname(), version=__version__, simulated=status.simulated)
    # Messages are added in place: a message built and then appended is built, then
    # copied; with 500 waiting that was half of a Status build, made at every change.
    for view in status.devices:
        view_pb(view, with_drain_reason=True, into=reply.devices)
    reply.enforcement = service.config.enforce_mode
    if reply.enforcement == "acl":  # the same rule that holds an ungated device back (enforce/nodes.py)
        for msg, view in zip(reply.devices, status.devices, strict=True):
            msg.gate_reason = gate_problem(view.device)
            msg.gated = not msg.gate_reason
    index = {view.device.uuid: view.device.index for view in status.devices}
    for position, queued in enumerate(status.queue, start=1):
        entry = reply.queue.add(
            request_id=queued.id,
            gpus=queued.requirement.gpus, min_memory_mib=queued.requirement.min_memory_mib,
            since=queued.since, position=position, reason=queued.reason,
            time_limit_s=queued.ask.time_limit_s,
            devices=[f"gpu{index[u]}" for u in queued.ask.only if u in index],
        )
        _fill_holder(entry.requester, queued.holder)
    for use in status.usage:
        reply.usage.append(pb.UserUsage(
            user=use.user, uid=use.uid, policy=use.policy, devices_held=use.devices_held,
            max_devices=use.max_devices, waiting=use.waiting, max_waiting=use.max_waiting,
            device_hours=use.device_hours, max_device_hours=use.max_device_hours, window_s=use.window_s,
            fair_usage=use.fair_usage,
        ))
    for proc in status.unleased_processes:
        reply.unleased_processes.append(pb.GpuProcess(
            pid=proc.pid, uid=max(proc.uid, 0), user=proc.user, command=proc.command,
            used_memory_mib=proc.used_memory_mib, device_uuid=proc.device_uuid,
        ))
    for verdict in status.probes:
        reply.probes.append(pb.ProbeVerdict(vendor=verdict.vendor, available=verdict.available,
                                            reason=verdict.reason))
    add_slurm_status(reply, service)  # the mode; in delegate mode Slurm's batch jobs and queue
    return reply


def rebuild_request(spec: bytes) -> Rebuilt:
    """A queued request recorded as it arrived (`spec`), as the service takes it again
    after a restart: its requirement, its accelerator config and what else it asked."""
    request = pb.AcquireRequest.FromString(spec)
    requirement = requirement_from_request(
        request.gpus, request.min_memory_mib, request.runtime_spec_yaml,
        request.runtime_spec_name or "runtime-spec.yaml", request.accelerator_config_yaml,
        request.accelerator_config_name or "accelerator-config.yaml", request.client,
    )
    return Rebuilt(requirement, request.accelerator_config_yaml, request.time_limit_s, tuple(request.devices),
                   request.reservation)


def _validate_acquire(request: pb.AcquireRequest) -> str:
    if request.gpus < 1:
        return "gpus must be at least 1"
    if request.gpus > MAX_GPUS:
        return f"gpus={request.gpus} is absurd: at most {MAX_GPUS}"
    if request.min_memory_mib < 0:
        return "min_memory must not be negative"
    if request.min_memory_mib > MAX_MEMORY_MIB:
        return f"min_memory={request.min_memory_mib} MiB is absurd"
    wait = request.max_wait_seconds
    if math.isnan(wait) or wait < 0 or wait > MAX_WAIT_S:
        return f"wait must be between 0 and {MAX_WAIT_S} seconds (or forever), got {wait}"
    if len(request.runtime_spec_yaml) > MAX_TEXT or len(request.accelerator_config_yaml) > MAX_TEXT:
        return "contract file larger than 256 KiB"
    limit = request.time_limit_s
    if math.isnan(limit) or limit < 0 or limit > MAX_TIME_LIMIT_S:
        return (f"a time limit must be more than 0 and at most {MAX_TIME_LIMIT_S / 86400:.0f} days, "
                f"got {limit:g} seconds")
    if len(request.devices) > MAX_GPUS or any(len(d) > 128 for d in request.devices):
        return "too many or too long device names"
    return ""


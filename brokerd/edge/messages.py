"""The core's plain results as messages, and a recorded request back as the core takes it.

Messages are built in place where they go into a reply (`into=`, `.add`): a message built
and then appended is built, then copied; with 500 waiting that was half of a Status build,
made at every change of the queue.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from brokerd import __version__
from brokerd.base.clock import wall
from brokerd.base.process import Holder, Identity
from brokerd.contract.convert import check_line_to_proto, requirement_from_request
from brokerd.core.queueing import Rebuilt
from brokerd.core.service import BrokerService
from brokerd.core.views import DeviceView, OutsideStatus
from brokerd.devices.model import UTILISATION_KEY, Device
from brokerd.devices.nodes import gate_problem
from brokerd.leasing.model import ContainerHold, Lease, heartbeat_interval
from brokerd.state.report import Report, ReportRow
from vaccel_common.v1 import broker_pb2 as pb


def fill_holder(msg: pb.Holder, h: Holder, container: ContainerHold | None = None) -> None:
    """Set a message's holder in place (a Holder built and copied in is two), with the
    container its lease is applied to."""
    msg.user, msg.uid, msg.pid, msg.command = h.user, h.uid, h.pid, h.command
    if container is not None:
        shown = msg.container
        shown.id, shown.name, shown.image = container.id, container.name, container.image
        shown.engine = container.engine


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
        utilization=float(device.extra.get(UTILISATION_KEY, -1)),  # -1: the probe does not measure it
        label=device.label, mig_index=device.mig_index, parent_uuid=device.parent_uuid,
        mig_profile=device.mig_profile,
    )
    if lease is not None:
        _add_lease(msg, lease)
    return msg


def _add_lease(msg: pb.Device, lease: Lease) -> None:
    msg.lease_id = lease.id
    fill_holder(msg.holder, lease.holder, lease.container)
    if lease.reservation:
        msg.holder.pid = 0  # held by the user: the command that booked it has gone
    msg.since = lease.granted_at
    msg.borrowed = lease.borrowed
    if lease.expires_at and lease.active:
        msg.time_left_s = max(0.0, lease.expires_at - wall())


def held_pb(view: DeviceView) -> pb.Device:
    """A held device in a waiter's queue line: who holds what, since when, for how long.
    Not the whole device (Status has that): every waiter's first line carries one per held
    device, and gRPC keeps a stream's last message until its next one, so 500 waiters on a
    64-device host kept ~100 KB each of full devices."""
    msg = pb.Device(index=view.device.index, uuid=view.device.uuid, name=view.device.name, state=view.state,
                    label=view.device.label, sharing=view.sharing)
    if view.lease is not None:
        _add_lease(msg, view.lease)
    _add_shares(msg, view)
    return msg


def view_pb(view: DeviceView, *, with_drain_reason: bool = False, into: Any = None) -> pb.Device:
    msg = device_pb(view.device, view.state, view.lease, view.drain_reason if with_drain_reason else "",
                    into=into)
    msg.sharing = view.sharing
    _add_shares(msg, view)
    return msg


def _add_shares(msg: pb.Device, view: DeviceView) -> None:
    for share in view.shares:
        lease = share.lease
        msg.shares.add(lease_id=lease.id, user=lease.holder.user, uid=lease.holder.uid, memory_mib=lease.share_mib,
                       used_mib=share.used_mib, since=lease.granted_at)


def lease_pb(lease: Lease, *, ttl_s: float, device: Callable[[str], Device | None], job_id: int = 0) -> pb.Lease:
    """The lease as a message; `device` finds each of its devices, `job_id` is the outside
    allocator's allocation behind it (0: none)."""
    msg = pb.Lease(
        id=lease.id, backend=lease.backend, granted_at=lease.granted_at,
        expires_at=lease.expires_at, heartbeat_interval_s=heartbeat_interval(ttl_s),
        ttl_s=ttl_s, state=lease.state, end_reason=lease.end_reason,
        allocator_config=lease.terms.allocator_config, memory_cap_mib=lease.terms.memory_cap_mib,
        member_pids=sorted(member.pid for member in lease.members), simulated=lease.simulated,
        accelerator_config_yaml=lease.terms.accelerator_config_yaml, ended_at=lease.ended_at,
        reservation=lease.reservation, requested_at=lease.requested_at, notice=lease.notice,
        time_limit_s=lease.time_limit_s, slurm_job_id=job_id, share_mib=lease.share_mib, borrowed=lease.borrowed,
    )
    fill_holder(msg.holder, lease.holder, lease.container)
    for uuid in lease.devices:
        found = device(uuid)
        if found is not None:
            state = ("shared" if lease.share_mib else "leased") if lease.active else ""
            device_pb(found, state, lease, into=msg.devices)
        else:
            msg.devices.append(pb.Device(uuid=uuid, state="missing"))
    msg.warnings.extend(check_line_to_proto(w) for w in lease.warnings)
    return msg


def report_pb(report: Report) -> pb.ReportReply:
    def row(r: ReportRow) -> pb.ReportRow:
        used = None if r.lease is None else pb.UsedLease(  # by lease
            user=r.lease.user, requested_at=r.lease.granted_at - r.lease.wait_s, granted_at=r.lease.granted_at,
            ended_at=r.lease.ended_at, devices=len(r.lease.devices), time_limit_s=r.lease.time_limit_s,
            reservation=r.lease.reservation, state=r.lease.state)
        return pb.ReportRow(key=r.key, device_hours=r.device_hours, leases=r.leases, wait_p50_s=r.wait_p50_s,
                            wait_p90_s=r.wait_p90_s, wait_max_s=r.wait_max_s,
                            idle_device_hours=r.idle_device_hours, end_reasons=r.end_reasons, lease=used,
                            idle_measured=r.idle_measured)

    return pb.ReportReply(since=report.since, until=report.until, by=report.by, rows=[row(r) for r in report.rows],
                          total=row(report.total), rows_hidden=report.rows_hidden)


def status_reply(service: BrokerService, identity: Identity) -> pb.StatusReply:
    """What `vaccel status` shows `identity`, as a message: the Status RPC's reply, and the
    dashboard's (brokerd/addons/web), which asks as an anonymous local user."""
    status = service.status(identity)
    reply = pb.StatusReply(hostname=socket.gethostname(), version=__version__, simulated=status.simulated)
    for view in status.devices:
        view_pb(view, with_drain_reason=True, into=reply.devices)
    reply.enforcement = service.config.enforce_mode
    if reply.enforcement == "acl":  # the same rule that holds an ungated device back (devices/nodes.py)
        for msg, view in zip(reply.devices, status.devices, strict=True):
            msg.gate_reason = gate_problem(view.device)
            msg.gated = not msg.gate_reason
    label = {view.device.uuid: view.device.label for view in status.devices}
    for position, queued in enumerate(status.queue, start=1):
        entry = reply.queue.add(
            request_id=queued.id,
            gpus=queued.requirement.gpus, min_memory_mib=queued.requirement.min_memory_mib,
            since=queued.since, position=position, reason=queued.reason,
            time_limit_s=queued.ask.time_limit_s, memory_mib=queued.ask.memory_mib,
            devices=[label[u] for u in queued.ask.only if u in label],
        )
        fill_holder(entry.requester, queued.holder)
    for use in status.usage:
        reply.usage.append(pb.UserUsage(
            user=use.user, uid=use.uid, policy=use.policy, devices_held=use.devices_held,
            max_devices=use.max_devices, waiting=use.waiting, max_waiting=use.max_waiting,
            device_hours=use.device_hours, max_device_hours=use.max_device_hours, window_s=use.window_s,
            fair_usage=use.fair_usage,
        ))
    busy = {msg.uuid: msg for msg in reply.devices if msg.state == "busy"}
    for proc in status.unleased_processes:
        if proc.device_uuid in busy and not busy[proc.device_uuid].HasField("busy_by"):
            busy[proc.device_uuid].busy_by.CopyFrom(pb.BusyBy(
                user=proc.user or str(proc.uid), pid=proc.pid, command=proc.command,
                container=service.holds.container_of(proc.pid)))
        reply.unleased_processes.append(pb.GpuProcess(
            pid=proc.pid, uid=max(proc.uid, 0), user=proc.user, command=proc.command,
            used_memory_mib=proc.used_memory_mib, device_uuid=proc.device_uuid,
        ))
    for uuid, msg in busy.items():  # held back by an add-on (the enforce gate) that names the process
        held = service.inventory.held_by(uuid) if not msg.HasField("busy_by") else None
        if held is not None:
            msg.busy_by.CopyFrom(pb.BusyBy(user=held.user, pid=held.pid, command=held.command,
                                           container=service.holds.container_of(held.pid)))
    for verdict in status.probes:
        reply.probes.append(pb.ProbeVerdict(vendor=verdict.vendor, available=verdict.available,
                                            reason=verdict.reason))
    for stop in service.holds.stopped():
        reply.stopped_containers.append(pb.ContainerStop(
            engine=stop.engine, id=stop.id, name=stop.name, image=stop.image, reason=stop.reason, at=stop.at,
            lease_id=stop.lease_id, user=stop.user))
    if status.outside is not None:
        add_outside(reply, status.outside)
    else:
        # An allocator is plugged in from the start or not at all: a reload to "delegate" is
        # not in force until a restart, and the reply must not claim it is.
        reply.slurm_mode = "submit" if service.config.slurm_mode == "submit" else "off"
    return reply


def add_outside(reply: pb.StatusReply, outside: OutsideStatus) -> None:
    """What the outside allocator holds (devices shown as leased to its allocations) and
    who waits with it, after vaccel's own queue."""
    reply.slurm_mode = outside.mode
    holds = {hold.device_uuid: hold for hold in outside.holds}
    for msg in reply.devices:
        hold = holds.get(msg.uuid)
        if hold is None or msg.lease_id:
            continue
        msg.state = "leased"
        msg.lease_id = hold.lease_id
        msg.holder.CopyFrom(pb.Holder(user=hold.user, uid=max(hold.uid, 0), command=hold.label))
        msg.since = hold.since
    for place, wait in enumerate(outside.waiting, start=len(reply.queue) + 1):
        entry = reply.queue.add(request_id=wait.request_id, gpus=wait.gpus, since=wait.since, position=place,
                                reason=wait.reason, slurm_job_id=wait.job_id, time_limit_s=wait.time_limit_s)
        if wait.requester is not None:
            fill_holder(entry.requester, wait.requester)
        else:
            entry.requester.CopyFrom(pb.Holder(user=wait.user, uid=max(wait.uid, 0), command=wait.label))


def rebuild_request(spec: bytes) -> Rebuilt:
    """A queued request recorded as it arrived (`spec`), as the core takes it again after a
    restart: its requirement, its accelerator config and what else it asked."""
    request = pb.AcquireRequest.FromString(spec)
    requirement = requirement_from_request(
        request.gpus, request.min_memory_mib, request.runtime_spec_yaml,
        request.runtime_spec_name or "runtime-spec.yaml", request.accelerator_config_yaml,
        request.accelerator_config_name or "accelerator-config.yaml", request.client,
    )
    return Rebuilt(requirement, request.accelerator_config_yaml, request.time_limit_s, tuple(request.devices),
                   request.reservation, request.memory_mib)

"""`vaccel status` as text: the devices table (a GPU in MIG mode as a line of its own with
its instances under it, each memory share under its device with its user, budget and
use), the queue with each waiter's reason, the users held back by a limit, and GPU
processes without a lease. (`--json` is the shared shape in vaccel_common/status_json.py.)"""

from __future__ import annotations

import time

from vaccel.cli_common import since, table
from vaccel_common.units import format_duration, format_mib
from vaccel_common.v1 import broker_pb2 as pb


def render_status(reply: pb.StatusReply) -> str:
    out = [f"host {reply.hostname}{' (simulated devices)' if reply.simulated else ''}"]
    if reply.enforcement == "acl":
        gated = sum(d.gated for d in reply.devices)
        out.append(f"enforcement: acl, {gated} of {len(reply.devices)} devices gated "
                   "(their nodes open only for the lease holder)")
    if reply.slurm_mode and reply.slurm_mode != "off":
        out.append(f"slurm: {reply.slurm_mode}" + (" (Slurm allocates these GPUs; vaccel asks it)"
                                                   if reply.slurm_mode == "delegate" else ""))
    rows: list[list[str]] = []
    gpus_shown: set[str] = set()
    for d in reply.devices:
        if d.parent_uuid and d.parent_uuid not in gpus_shown:  # the GPU itself, once, over its instances
            gpus_shown.add(d.parent_uuid)
            count = sum(1 for other in reply.devices if other.parent_uuid == d.parent_uuid)
            rows.append([f"gpu{d.index}", d.name.rsplit(" MIG ", 1)[0], "", d.arch,
                         f"MIG mode, {count} instance{'s' if count != 1 else ''}", "", "", ""])
        holder = ""
        if d.lease_id.startswith("slurm-"):  # a Slurm job vaccel did not make: "slurm job 42 (alice)"
            holder = d.holder.command
        elif d.lease_id:
            holder = f"{d.holder.user} ({holder_detail(d.holder)})"
            if d.time_left_s:
                holder += f", {format_duration(d.time_left_s)} left"
        state = d.state if d.healthy else f"{d.state}: {d.health_reason}"
        if d.drain_reason:
            state = f"{state} (drained: {d.drain_reason})" if d.state != "drained" else f"drained: {d.drain_reason}"
        if reply.enforcement == "acl" and not d.gated:
            state = f"{state} (NOT GATED: {d.gate_reason})"
        if d.sharing == "memory" and not d.lease_id:
            free = d.memory_mib - sum(s.memory_mib for s in d.shares)
            state = f"{state}, {format_mib(free)} of {format_mib(d.memory_mib)} free for shares"
        label = d.label or f"gpu{d.index}"
        name = f"  {d.mig_profile} instance" if d.parent_uuid else d.name
        rows.append([f"  {label}" if d.parent_uuid else label, name, format_mib(d.memory_mib), d.arch, state, holder,
                     since(d.since) if d.lease_id else "", d.lease_id])
        for s in d.shares:
            use = f"uses {format_mib(s.used_mib)}" + (" OVER ITS SHARE" if s.used_mib > s.memory_mib else "")
            rows.append(["", f"  share of {format_mib(s.memory_mib)}", "", "", use, s.user, since(s.since),
                         s.lease_id])
    out.append(table(rows, ["GPU", "NAME", "MEMORY", "ARCH", "STATE", "HOLDER", "SINCE", "LEASE"]))
    if reply.queue:
        out.append("")
        out.append(f"queue ({len(reply.queue)} waiting):")
        for q in reply.queue:
            mem = f", >= {format_mib(q.min_memory_mib)} each" if q.min_memory_mib else ""
            named = f" ({', '.join(q.devices)})" if q.devices else ""
            waited = max(0.0, time.time() - q.since)
            plural = "s" if q.gpus > 1 else ""
            wants = f"a {format_mib(q.memory_mib)} share" if q.memory_mib else f"{q.gpus} GPU{plural}"
            out.append(f"  {q.position}. {q.requester.user} (pid {q.requester.pid}) wants {wants}"
                       f"{named}{mem}, waiting {format_duration(waited)}  {q.requester.command}")
            if q.reason:
                out.append(f"     waiting: {q.reason}")
    else:
        out.append("\nqueue: empty")
    limited = [u for u in reply.usage if u.max_devices or u.max_device_hours]
    if limited:
        out.append("")
        out.append("limits:")
        for u in limited:
            parts = []
            if u.max_devices:
                parts.append(f"{u.devices_held}/{u.max_devices} devices")
            if u.max_device_hours:
                parts.append(f"{u.device_hours:.1f}/{u.max_device_hours:g} device-hours in "
                             f"{format_duration(u.window_s)}")
            out.append(f"  {u.user} ({u.policy}): {', '.join(parts)}")
    if reply.unleased_processes:
        index = {d.uuid: d.label or f"gpu{d.index}" for d in reply.devices}
        out.append("")
        for p in reply.unleased_processes:
            out.append(f"{index.get(p.device_uuid, 'gpu?')}: IN USE WITHOUT LEASE by {p.user or p.uid}: "
                       f"pid {p.pid} {p.command}, {format_mib(p.used_memory_mib)}")
    return "\n".join(out)


def holder_detail(holder: pb.Holder) -> str:
    """What holds the lease besides its user: "container zhang-pytorch", "pid 4242", "reserved"."""
    if holder.HasField("container"):
        return f"container {holder.container.name or holder.container.id[:12]}"
    return f"pid {holder.pid}" if holder.pid else "reserved"

"""`vaccel status` as text: the devices table (a GPU in MIG mode as a line of its own with
its instances under it, each memory share under its device with its user, budget and
use), the queue with each waiter's reason, the users held back by a limit, and GPU
processes without a lease. (`--json` is the shared shape in vaccel_common/status_json.py.)

Shared so that the full CLI and the broker render it alike: the broker answers a plain
`vaccel status` ready-made (vaccel/entry.py, brokerd/edge/views.py). One thing in
the text is the viewer's, not the broker's: the clock time a lease began (HH:MM in the
viewer's time zone). The broker renders it in its own zone and says where each one is
(`clock_marks`); the client rewrites those five characters in its own
(vaccel_common/side_call.py local_text): always the same width, so no column moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from vaccel_common.text import printable
from vaccel_common.units import format_duration, format_mib

if TYPE_CHECKING:
    from vaccel_common.v1 import broker_pb2 as pb

COLUMNS = ["GPU", "NAME", "MEMORY", "ARCH", "STATE", "HOLDER", "SINCE", "LEASE"]
# The waiting requests listed; the rest are counted (issue 46: a thousand waiting made every
# user's `vaccel status` 100 KB). `vaccel status --all` and `--json` list every one.
QUEUE_SHOWN = 10
_SINCE_COLUMN = COLUMNS.index("SINCE")


def since(ts: float, clock: Callable[[float], time.struct_time] = time.localtime) -> str:
    """`16:12 (5m03s ago)`; never a negative age (a time to come is shown as now)."""
    if not ts:
        return "-"
    age = max(0.0, time.time() - ts)
    return f"{time.strftime('%H:%M', clock(ts))} ({format_duration(age)} ago)"


def table_lines(rows: list[list[str]], header: list[str]) -> tuple[list[str], list[int]]:
    """The table's lines, and where each column starts in a line."""
    rows = [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]
    starts = [sum(widths[:i]) + 2 * i for i in range(len(header))]
    return lines, starts


def table(rows: list[list[str]], header: list[str]) -> str:
    return "\n".join(table_lines(rows, header)[0])


def render_status(reply: pb.StatusReply, *, every: bool = False) -> str:
    """The text the full CLI prints, in this process's time zone; `every`: the whole queue."""
    return "\n".join(_status_lines(reply, every)[0])


def clock_marks(reply: pb.StatusReply) -> tuple[str, list[tuple[int, float]]]:
    """The text, and for each HH:MM in it: (its offset in the text, the time it shows)."""
    lines, marks = _status_lines(reply)
    line_starts = [0]
    for line in lines:
        line_starts.append(line_starts[-1] + len(line) + 1)
    return "\n".join(lines), [(line_starts[line] + column, ts) for line, column, ts in marks]


def _status_lines(reply: pb.StatusReply, every: bool = False) -> tuple[list[str], list[tuple[int, int, float]]]:
    """The text's lines, each safe for a terminal (vaccel_common/text.py), and the
    (line, column, time) of each lease's start clock."""
    out = [f"host {reply.hostname}{' (simulated devices)' if reply.simulated else ''}"]
    if reply.enforcement == "acl":
        gated = sum(d.gated for d in reply.devices)
        out.append(f"enforcement: acl, {gated} of {len(reply.devices)} devices gated "
                   "(their nodes open only for the lease holder)")
    if reply.slurm_mode and reply.slurm_mode != "off":
        out.append(f"slurm: {reply.slurm_mode}" + (" (Slurm allocates these GPUs; vaccel asks it)"
                                                   if reply.slurm_mode == "delegate" else ""))
    rows: list[list[str]] = []
    row_since: list[float] = []  # per row: the time its SINCE column shows (0: none)
    gpus_shown: set[str] = set()
    for d in reply.devices:
        if d.parent_uuid and d.parent_uuid not in gpus_shown:  # the GPU itself, once, over its instances
            gpus_shown.add(d.parent_uuid)
            count = sum(1 for other in reply.devices if other.parent_uuid == d.parent_uuid)
            rows.append([f"gpu{d.index}", d.name.rsplit(" MIG ", 1)[0], "", d.arch,
                         f"MIG mode, {count} instance{'s' if count != 1 else ''}", "", "", ""])
            row_since.append(0.0)
        holder = ""
        if d.lease_id.startswith("slurm-"):  # a Slurm job vaccel did not make: "slurm job 42 (alice)"
            holder = d.holder.command
        elif d.lease_id:
            holder = f"{d.holder.user} ({holder_detail(d.holder)})"
            if d.time_left_s:
                holder += f", {format_duration(d.time_left_s)} left"
        elif d.HasField("busy_by"):  # used without a lease: whose process, as a holder is named
            b = d.busy_by
            holder = f"{b.user} (pid {b.pid}{f', container {b.container}' if b.container else ''}, no lease)"
        state = d.state if d.healthy else f"{d.state}: {d.health_reason}"
        if d.borrowed:  # lent while idle over its user's limits: it ends with notice when needed
            state = f"{state} (borrowed)"
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
        row_since.append(d.since if d.lease_id else 0.0)
        for s in d.shares:
            use = f"uses {format_mib(s.used_mib)}" + (" OVER ITS SHARE" if s.used_mib > s.memory_mib else "")
            rows.append(["", f"  share of {format_mib(s.memory_mib)}", "", "", use, s.user, since(s.since),
                         s.lease_id])
            row_since.append(s.since)
    lines, starts = table_lines(rows, COLUMNS)
    first_row = sum(part.count("\n") + 1 for part in out) + 1  # the line after the table's header
    marks = [(first_row + i, starts[_SINCE_COLUMN], ts) for i, ts in enumerate(row_since) if ts]
    out.extend(lines)
    if reply.queue:
        out.append("")
        out.append(f"queue ({len(reply.queue)} waiting):")
        for q in reply.queue if every else reply.queue[:QUEUE_SHOWN]:
            mem = f", >= {format_mib(q.min_memory_mib)} each" if q.min_memory_mib else ""
            named = f" ({', '.join(q.devices)})" if q.devices else ""
            waited = max(0.0, time.time() - q.since)
            plural = "s" if q.gpus > 1 else ""
            wants = f"a {format_mib(q.memory_mib)} share" if q.memory_mib else f"{q.gpus} GPU{plural}"
            out.append(f"  {q.position}. {q.requester.user} (pid {q.requester.pid}) wants {wants}"
                       f"{named}{mem}, waiting {format_duration(waited)}  {q.requester.command}")
            if q.reason:
                out.append(f"     waiting: {q.reason}")
        if not every and len(reply.queue) > QUEUE_SHOWN:
            out.append(f"  ... and {len(reply.queue) - QUEUE_SHOWN} more waiting (vaccel status --all)")
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
    if reply.stopped_containers:
        out.append("")
        out.append("containers stopped for starting outside a live lease:")
        for c in reply.stopped_containers:
            name = c.name or c.id[:12]
            out.append(f"  {name} ({c.engine}, {format_duration(max(0.0, time.time() - c.at))} ago): {c.reason}")
            out.append(f"     `vaccel run -- {c.engine} start -a {name}` runs it again under a new lease")
    # As the CLI shows every text (vaccel/cli/common.py shown()): line by line, nothing unprintable.
    return [printable(line) for part in out for line in part.split("\n")], marks


def holder_detail(holder: pb.Holder) -> str:
    """What holds the lease besides its user: "container zhang-pytorch", "pid 4242", "reserved"."""
    if holder.HasField("container"):
        return f"container {holder.container.name or holder.container.id[:12]}"
    return f"pid {holder.pid}" if holder.pid else "reserved"

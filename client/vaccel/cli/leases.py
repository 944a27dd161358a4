"""`vaccel leases`, `vaccel release` and `vaccel drain`: one's leases and waiting requests,
giving a lease back, taking a device out of the pool. (Their parsers are in full.py, which
builds only the parser of the command it runs; this module is imported when one runs.)

- `leases` shows what Slurm's squeue would: the leases with their time left, a reservation
  as `(reserved)` (its `vaccel reserve` is long gone), a lease ending after a release with
  grace as `ending`, and one's requests still waiting in the queue.
- `release` is idempotent: a lease that has already ended is said to have, with exit 0.
- `drain` says what it replaced, and `--undo` on a device that was not drained says so.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from vaccel.cli.common import EXIT_REFUSED, EXIT_USAGE, CliError, connection, rpc, shown, to_dict
from vaccel_common.status_text import since, table
from vaccel_common.units import format_duration, parse_duration
from vaccel_common.v1 import broker_pb2 as pb


def lease_json(lease: pb.Lease) -> dict[str, Any]:
    item = to_dict(lease)
    item["devices"] = [d.uuid for d in lease.devices]
    return item


def state_text(lease: pb.Lease) -> str:
    """active; ending, with the notice that says why and when (a release with grace, an idle
    reclaim); or how it ended, its reason once (`revoked by root: maintenance`, not
    `revoked (revoked by ...)`)."""
    if lease.state == "active":
        return f"ending: {lease.notice}" if lease.notice else "active"
    reason = lease.end_reason
    if not reason or reason.startswith(lease.state.replace("_", " ")):
        return reason or lease.state
    return f"{lease.state} ({reason})"


def time_left(lease: pb.Lease, now: float) -> str:
    if lease.state != "active" or not lease.expires_at:
        return "-"
    return format_duration(max(0.0, lease.expires_at - now))


def waiting_requests(conn: Any, everyone: bool) -> tuple[list[pb.QueueEntry], int]:
    """The caller's requests in the queue (everyone's with --all) and the queue's length,
    from the broker's status."""
    reply = rpc(conn, "Status", pb.StatusRequest())
    uid = os.getuid()
    return [q for q in reply.queue if everyone or q.requester.uid == uid], len(reply.queue)


def cmd_leases(args: argparse.Namespace) -> int:
    conn = connection(args)
    reply = rpc(conn, "ListLeases", pb.ListLeasesRequest(all=args.all, include_ended=args.ended))
    waiting, total = waiting_requests(conn, args.all)
    if args.json:
        print(json.dumps({"leases": [lease_json(lease) for lease in reply.leases],
                          "waiting": [to_dict(q) for q in waiting]}, indent=2))
        return 0
    now = time.time()
    if reply.leases:
        rows = [[lease.id, lease.holder.user, "(reserved)" if lease.reservation else str(lease.holder.pid),
                 ",".join(d.label or f"gpu{d.index}" for d in lease.devices), since(lease.granted_at),
                 time_left(lease, now), state_text(lease), lease.holder.command[:40]]
                for lease in reply.leases]
        print(shown(table(rows, ["LEASE", "USER", "PID", "DEVICES", "SINCE", "LEFT", "STATE", "COMMAND"])))
    elif not waiting:
        print("no leases" + ("" if args.all else " of yours (--all: everyone's, admins only)"))
    if waiting:
        print(("\n" if reply.leases else "") + "waiting:")
        for q in waiting:
            count = f"{q.gpus} GPU{'s' if q.gpus > 1 else ''}" + (f" ({', '.join(q.devices)})" if q.devices else "")
            who = f"{q.requester.user} " if args.all else ""
            print(shown(f"  {who}pid {q.requester.pid} wants {count}: position {q.position} of {total}, waiting "
                        f"{format_duration(now - q.since)}  {q.requester.command[:40]}"))
            if q.reason:
                print(shown(f"     {q.reason}"))
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    grace = 0.0
    if args.grace is not None:
        try:
            grace = parse_duration(args.grace)
        except ValueError as exc:
            raise CliError(f"--grace: {exc}", EXIT_USAGE) from None
    conn = connection(args)
    try:
        reply = rpc(conn, "Release", pb.ReleaseRequest(lease_id=args.lease_id, reason=args.reason or "",
                                                        grace_s=grace))
    except CliError as refusal:
        ended = _ended_lease(conn, args.lease_id) if refusal.code == EXIT_REFUSED else None
        if ended is None:
            raise
        # Releasing twice is not a mistake worth a failure: the lease is over, as asked.
        if args.json:
            print(json.dumps(lease_json(ended), indent=2))
        else:
            print(f"{ended.id} had already ended: {state_text(ended)}")
        return 0
    if args.json:
        print(json.dumps(lease_json(reply), indent=2))
    elif reply.state == "active":
        print(f"{reply.id}: ends at {time.strftime('%H:%M:%S', time.localtime(reply.expires_at))}; "
              f"its holder has been told: {shown(reply.notice)}")
    else:
        print(f"{reply.id}: {state_text(reply)}; {len(reply.devices)} device(s) back in the pool")
    return 0


def _ended_lease(conn: Any, lease_id: str) -> pb.Lease | None:
    """The lease, when the broker still knows it and it has ended; else None."""
    try:
        lease = rpc(conn, "GetLease", pb.LeaseRef(lease_id=lease_id))
    except CliError:
        return None
    return None if lease.state == "active" else lease


def cmd_drain(args: argparse.Namespace) -> int:
    conn = connection(args)
    before = {d.uuid: d for d in rpc(conn, "Status", pb.StatusRequest()).devices}
    reply = rpc(conn, "Drain", pb.DrainRequest(device=args.device, undo=args.undo, reason=args.reason or ""))
    if args.json:
        print(json.dumps(to_dict(reply), indent=2))
        return 0
    name = f"{reply.label or f'gpu{reply.index}'} ({reply.name})"
    was = before[reply.uuid].drain_reason if reply.uuid in before else ""
    if args.undo and not was:
        print(f"{name} was not drained: nothing to undo ({reply.state})")
    elif args.undo:
        print(f"{name} is back in the pool: {reply.state} (it was drained: {shown(was)})")
    else:
        running = f"; lease {reply.lease_id} of {reply.holder.user} runs to its end" if reply.lease_id else ""
        replaced = f"; replaces the earlier drain: {was}" if was else ""
        print(shown(f"{name} drained: {reply.drain_reason}; no new leases{running}{replaced}"))
    return 0

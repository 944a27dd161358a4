"""`vaccel report`: device-hours, leases, waits, idle time and end reasons over a period,
by user, group, device or day, as a table, JSON or CSV; or one row per lease (`--by lease`:
who, asked, granted, ended, devices, time limit, end state), the export a lab can replay
(bench/lab/convert.py).

Everyone sees the totals; other users' rows (by user or group) only root and the admin
group, unless the daemon's config shares them (`[accounting] per_user_report`).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from vaccel.cli.common import EXIT_USAGE, CliError, connection, rpc, shown
from vaccel_common.status_text import table
from vaccel_common.units import format_duration, parse_duration
from vaccel_common.v1 import broker_pb2 as pb

BY = ("user", "group", "device", "day", "lease")
FIELDS = ("key", "device_hours", "leases", "wait_p50_s", "wait_p90_s", "wait_max_s", "idle_device_hours")
LEASE_FIELDS = ("user", "requested_at", "granted_at", "ended_at", "devices", "time_limit_s", "reservation", "state")
TOTAL_KEY = "(total)"  # no user, group, device or day is spelt with parentheses


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "report", parents=[common], help="device-hours, leases, waits and idle time over a period",
        description="Usage over a period (default: the last 7 days): device-hours, leases, the wait in the "
                    "queue (p50, p90, max), idle device-hours where the probe measures utilisation, and how "
                    "the leases ended. Everyone sees the totals; other users' rows only root and the admin "
                    "group (unless the broker's config shares them).",
        epilog="examples: vaccel report --since 30d --by group;  vaccel report --from 2025-01-01 --to "
               "2025-01-31 --csv > january.csv  (--to DATE includes that day)")
    p.add_argument("--since", metavar="DURATION", help="the period that ends now, e.g. 24h, 7d, 30d")
    p.add_argument("--from", dest="start", metavar="DATE", help="start: 2025-01-31 or 2025-01-31T14:00 (local time)")
    p.add_argument("--to", dest="end", metavar="DATE", help="end, that day included when no time is given")
    p.add_argument("--by", choices=BY, default="user",
                   help="one row per user (default), group, device, day or lease")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="machine-readable output")
    shape.add_argument("--csv", action="store_true", help="one line per row, for a spreadsheet")
    p.set_defaults(func=cmd_report)


def _date(text: str, option: str, *, end: bool) -> float:
    from datetime import datetime, timedelta  # here, not at the top: every `vaccel run` imports this module

    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"{option}: {text!r} is not a date; write 2025-01-31 or 2025-01-31T14:00",
                       EXIT_USAGE) from None
    if end and len(text.strip()) == 10:  # a bare date: up to the end of that day
        moment += timedelta(days=1)
    return moment.timestamp()


def period(args: argparse.Namespace, now: float) -> tuple[float, float]:
    """(since, until) in Unix time from the options; 0 leaves the choice to the broker."""
    if args.since is not None and (args.start is not None or args.end is not None):
        raise CliError("give either --since or --from/--to, not both", EXIT_USAGE)
    if args.since is not None:
        try:
            span = parse_duration(args.since)
        except ValueError as exc:
            raise CliError(f"--since: {exc}", EXIT_USAGE) from None
        if span <= 0:
            raise CliError("--since: the period must be longer than 0", EXIT_USAGE)
        if span >= now:
            raise CliError(f"--since {args.since.strip()}: that reaches back before 1970; records are kept for "
                           "[accounting] keep (400d unless the broker's config says otherwise)", EXIT_USAGE)
        return now - span, now
    since = _date(args.start, "--from", end=False) if args.start is not None else 0.0
    until = _date(args.end, "--to", end=True) if args.end is not None else 0.0
    if since and since >= (until or now):
        raise CliError("--from must come before --to (and before now)", EXIT_USAGE)
    return since, until


def lease_json(used: pb.UsedLease) -> dict[str, Any]:
    return {name: getattr(used, name) for name in LEASE_FIELDS}


def row_json(row: pb.ReportRow) -> dict[str, Any]:
    item = {"key": row.key, "device_hours": row.device_hours, "leases": row.leases,
            "wait_p50_s": row.wait_p50_s, "wait_p90_s": row.wait_p90_s, "wait_max_s": row.wait_max_s,
            "idle_device_hours": row.idle_device_hours, "idle_measured": row.idle_measured,
            "end_reasons": dict(sorted(row.end_reasons.items()))}
    if row.HasField("lease"):
        item["lease"] = lease_json(row.lease)
    return item


def report_json(reply: pb.ReportReply) -> dict[str, Any]:
    """The DESIGN.md shape: since, until, rows, total (and by, rows_hidden)."""
    return {"since": reply.since, "until": reply.until, "by": reply.by,
            "rows": [row_json(r) for r in reply.rows], "total": row_json(reply.total),
            "rows_hidden": reply.rows_hidden}


def _ends(row: pb.ReportRow) -> str:
    return ", ".join(f"{state} {count}" for state, count in sorted(row.end_reasons.items()))


def render_csv(reply: pb.ReportReply, *, header: bool = True) -> str:
    import csv
    import io
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if reply.by == "lease":  # one line per lease, no total: a list to replay or sum
        if header:  # a page after the first goes on under the first one's
            writer.writerow(["key", *LEASE_FIELDS, "device_hours", "wait_s"])
        for row in reply.rows:
            used = lease_json(row.lease)
            writer.writerow([row.key, *(int(v) if isinstance(v, bool) else v for v in used.values()),
                             row.device_hours, row.wait_max_s])
        return out.getvalue()
    writer.writerow([*FIELDS, "end_reasons"])
    for row in [*reply.rows, reply.total]:
        key = TOTAL_KEY if row is reply.total else row.key
        item = row_json(row)
        writer.writerow([key, *(item[f] for f in FIELDS[1:]),
                         ";".join(f"{s}={n}" for s, n in sorted(row.end_reasons.items()))])
    return out.getvalue()


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _lease_table(reply: pb.ReportReply) -> list[list[str]]:
    return [[row.key, row.lease.user, _when(row.lease.granted_at),
             format_duration(row.lease.ended_at - row.lease.granted_at), str(row.lease.devices),
             format_duration(row.wait_max_s),
             format_duration(row.lease.time_limit_s) if row.lease.time_limit_s else "-", row.lease.state]
            for row in reply.rows]


def render_table(reply: pb.ReportReply, names: dict[str, str]) -> str:
    def cells(key: str, row: pb.ReportRow) -> list[str]:
        return [key, f"{row.device_hours:.2f}", str(row.leases), format_duration(row.wait_p50_s),
                format_duration(row.wait_p90_s), format_duration(row.wait_max_s),
                # "-": no probe measured idleness (simulated devices), not "nothing was idle"
                f"{row.idle_device_hours:.2f}" if row.idle_measured else "-", _ends(row)]

    head = (f"usage {_when(reply.since)} to {_when(reply.until)} "
            f"({format_duration(reply.until - reply.since)}), by {reply.by}")
    if reply.by == "lease":
        header = ["LEASE", "USER", "GRANTED", "HELD", "DEVICES", "WAITED", "TIME LIMIT", "ENDED AS"]
        out = [head, table(_lease_table(reply), header)]
    else:
        rows = [cells(names.get(r.key, r.key), r) for r in reply.rows]
        rows.append(cells("TOTAL", reply.total))
        header = [reply.by.upper(), "DEVICE-HOURS", "LEASES", "WAIT P50", "WAIT P90", "WAIT MAX", "IDLE DEV-H", "ENDS"]
        out = [head, table(rows, header)]
    if reply.rows_hidden:
        out.append("(other users' rows are shown to root and the admin group only; the total counts everyone)")
    return "\n".join(out)


def _device_names(args: argparse.Namespace) -> dict[str, str]:
    """uuid -> "gpu0 (uuid)" for the devices the broker has now, for a readable table."""
    try:
        status = rpc(connection(args), "Status", pb.StatusRequest())
    except CliError:
        return {}
    return {d.uuid: f"{d.label or f'gpu{d.index}'} ({d.uuid})" for d in status.devices}


def cmd_report(args: argparse.Namespace) -> int:
    from vaccel.cli import report_pages

    since, until = period(args, time.time())
    conn, request = connection(args), pb.ReportRequest(since=since, until=until, by=args.by)
    if args.csv and args.by == "lease":  # of any size: written page by page as it comes
        for n, page in enumerate(report_pages.pages(conn, request)):
            print(render_csv(page, header=n == 0), end="", flush=True)
        return 0
    reply = report_pages.whole(conn, request)
    if args.json:
        print(json.dumps(report_json(reply), indent=2))
    elif args.csv:
        print(render_csv(reply), end="")
    else:
        names = _device_names(args) if args.by == "device" else {}
        print(shown(render_table(reply, names)))
    return 0

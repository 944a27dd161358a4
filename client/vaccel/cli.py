"""`vaccel`: the user's command line for the host's GPU broker.

Every listing command takes --json. A user's mistake is one line on stderr and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from vaccel.connection import BrokerConnection, BrokerUnavailable
from vaccel.lease_types import LeaseError
from vaccel_common.text import printable
from vaccel_common.units import format_duration, format_mib, parse_duration, parse_size_mib
from vaccel_common.v1 import broker_pb2 as pb

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: the broker cannot be reached
EXIT_TEMPFAIL = 75  # sysexits EX_TEMPFAIL: busy with --no-wait, or --wait ran out

DESCRIPTION = """\
Share this host's GPUs without fighting over them: exclusive leases from vaccel-brokerd.

  vaccel status                       who holds which GPU, who waits, unleased GPU users
  vaccel run --gpus 2 -- python train.py
                                      run a command on 2 leased GPUs; waits in line if busy
  vaccel run --no-wait -- ./job.sh    fail at once instead of waiting
  vaccel leases [--all]               your leases (--all: everyone's; admins)
  vaccel release LEASE_ID             give a lease back (admins: revoke anyone's)
  vaccel drain gpu2 --reason "fan"    admins: stop granting a device (--undo: back in the pool)
  vaccel check runtime-spec.yaml      can this host and this Python run that contract?

exit status: run exits with the command's status; 1 refused, 2 bad usage or file,
69 broker unreachable, 75 busy (--no-wait) or waited too long (--wait).
"""


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.code = code


def _connection(args: argparse.Namespace) -> BrokerConnection:
    return BrokerConnection(args.socket)


def _rpc(conn: BrokerConnection, method: str, request: Any) -> Any:
    try:
        return conn.call(method, request, retry_unavailable_s=2.0)
    except BrokerUnavailable as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None
    except grpc.RpcError as exc:
        code = EXIT_USAGE if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else EXIT_REFUSED
        raise CliError(exc.details() or exc.code().name, code) from None


def _ints(value: Any) -> Any:
    """protobuf's JSON mapping writes int64 as strings; scripts want numbers."""
    if isinstance(value, dict):
        return {k: int(v) if k in _INT64_FIELDS and isinstance(v, str) else _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


_INT64_FIELDS = {"memory_mib", "memory_used_mib", "min_memory_mib", "used_memory_mib", "memory_cap_mib"}


def _to_dict(msg: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict  # ~20 ms of imports: only for --json

    return _ints(MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))


def _since(ts: float) -> str:
    if not ts:
        return "-"
    age = time.time() - ts
    return f"{time.strftime('%H:%M', time.localtime(ts))} ({format_duration(age)} ago)"


def _shown(text: str) -> str:
    """Text for a terminal: commands and names come from other users' processes exactly
    as they set them (--json keeps them so); here nothing unprintable gets through."""
    return "\n".join(printable(line) for line in text.split("\n"))


def _table(rows: list[list[str]], header: list[str]) -> str:
    rows = [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]
    return "\n".join(lines)


# -- status ----------------------------------------------------------------------------


def status_json(reply: pb.StatusReply) -> dict[str, Any]:
    """The DESIGN.md shape: devices with state and holder, the queue, unleased processes."""
    devices = []
    for d in reply.devices:
        item = _to_dict(d)
        item["holder"] = ({"user": d.holder.user, "uid": d.holder.uid, "pid": d.holder.pid,
                           "command": d.holder.command} if d.lease_id else None)
        item["lease_id"] = d.lease_id or None
        item["since"] = d.since or None
        devices.append(item)
    return {
        "hostname": reply.hostname,
        "version": reply.version,
        "simulated": reply.simulated,
        "devices": devices,
        "queue": [_to_dict(q) for q in reply.queue],
        "unleased_processes": [_to_dict(p) for p in reply.unleased_processes],
        "probes": [_to_dict(p) for p in reply.probes],
    }


def render_status(reply: pb.StatusReply) -> str:
    out = [f"host {reply.hostname}{' (simulated devices)' if reply.simulated else ''}"]
    rows = []
    for d in reply.devices:
        holder = f"{d.holder.user} (pid {d.holder.pid})" if d.lease_id else ""
        state = d.state if d.healthy else f"{d.state}: {d.health_reason}"
        if d.drain_reason:
            state = f"{state} (drained: {d.drain_reason})" if d.state != "drained" else f"drained: {d.drain_reason}"
        rows.append([f"gpu{d.index}", d.name, format_mib(d.memory_mib), d.arch, state, holder,
                     _since(d.since) if d.lease_id else "", d.lease_id])
    out.append(_table(rows, ["GPU", "NAME", "MEMORY", "ARCH", "STATE", "HOLDER", "SINCE", "LEASE"]))
    if reply.queue:
        out.append("")
        out.append(f"queue ({len(reply.queue)} waiting):")
        for q in reply.queue:
            mem = f", >= {format_mib(q.min_memory_mib)} each" if q.min_memory_mib else ""
            out.append(f"  {q.position}. {q.requester.user} (pid {q.requester.pid}) wants {q.gpus} "
                       f"GPU{'s' if q.gpus > 1 else ''}{mem}, waiting {format_duration(time.time() - q.since)}"
                       f"  {q.requester.command}")
    else:
        out.append("\nqueue: empty")
    if reply.unleased_processes:
        index = {d.uuid: d.index for d in reply.devices}
        out.append("")
        for p in reply.unleased_processes:
            out.append(f"gpu{index.get(p.device_uuid, '?')}: IN USE WITHOUT LEASE by {p.user or p.uid}: "
                       f"pid {p.pid} {p.command}, {format_mib(p.used_memory_mib)}")
    return "\n".join(out)


def cmd_status(args: argparse.Namespace) -> int:
    reply = _rpc(_connection(args), "Status", pb.StatusRequest())
    print(json.dumps(status_json(reply), indent=2) if args.json else _shown(render_status(reply)))
    return 0


# -- leases / release ------------------------------------------------------------------


def lease_json(lease: pb.Lease) -> dict[str, Any]:
    item = _to_dict(lease)
    item["devices"] = [d.uuid for d in lease.devices]
    return item


def cmd_leases(args: argparse.Namespace) -> int:
    request = pb.ListLeasesRequest(all=args.all, include_ended=args.ended)
    reply = _rpc(_connection(args), "ListLeases", request)
    if args.json:
        print(json.dumps({"leases": [lease_json(lease) for lease in reply.leases]}, indent=2))
        return 0
    if not reply.leases:
        print("no leases" + ("" if args.all else " of yours (--all: everyone's, admins only)"))
        return 0
    rows = [[lease.id, lease.holder.user, str(lease.holder.pid),
             ",".join(f"gpu{d.index}" for d in lease.devices), lease.backend, _since(lease.granted_at),
             lease.state + (f" ({lease.end_reason})" if lease.end_reason else ""), lease.holder.command[:40]]
            for lease in reply.leases]
    print(_shown(_table(rows, ["LEASE", "USER", "PID", "DEVICES", "BACKEND", "SINCE", "STATE", "COMMAND"])))
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    reply = _rpc(_connection(args), "Release", pb.ReleaseRequest(lease_id=args.lease_id, reason=args.reason or ""))
    if args.json:
        print(json.dumps(lease_json(reply), indent=2))
    else:
        print(f"{reply.id}: {reply.state} ({reply.end_reason}); "
              f"{len(reply.devices)} device(s) back in the pool")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    request = pb.DrainRequest(device=args.device, undo=args.undo, reason=args.reason or "")
    reply = _rpc(_connection(args), "Drain", request)
    if args.json:
        print(json.dumps(_to_dict(reply), indent=2))
    elif args.undo:
        print(f"gpu{reply.index} ({reply.name}) is back in the pool: {reply.state}")
    else:
        running = f"; lease {reply.lease_id} of {reply.holder.user} runs to its end" if reply.lease_id else ""
        print(f"gpu{reply.index} ({reply.name}) drained: no new leases{running}")
    return 0


# -- check -----------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from vaccel.check_report import check_exit_code, render_check
    from vaccel.contract_files import ContractFileError, load_contract_files
    from vaccel.facts import gather_facts

    try:
        files = load_contract_files(args.spec, args.config, Path.cwd())
    except ContractFileError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    request = pb.CheckRequest(
        runtime_spec_yaml=files.spec_text, runtime_spec_name=files.spec_name,
        accelerator_config_yaml=files.config_text, accelerator_config_name=files.config_name,
        gpus=args.gpus, min_memory_mib=_size(args.min_memory),
    )
    request.client.CopyFrom(gather_facts(files.packages))
    reply = _rpc(_connection(args), "Check", request)
    print(json.dumps(_to_dict(reply), indent=2) if args.json else render_check(reply))
    return check_exit_code(reply)


def _size(text: str | None) -> int:
    if text is None:
        return 0
    if text.strip().replace(".", "", 1).isdigit():
        # A bare number would be bytes: `--min-memory 20` almost always means 20 GiB.
        raise CliError(f"--min-memory {text.strip()}: give a unit, e.g. {text.strip()}GiB or {text.strip()}MiB",
                       EXIT_USAGE)
    try:
        return parse_size_mib(text)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


# -- run -------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from vaccel.runner import Interrupted, run_under_lease

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise CliError("nothing to run: vaccel run [options] -- COMMAND [ARGS...]", EXIT_USAGE)
    if args.no_wait and args.wait is not None:
        raise CliError("--wait and --no-wait contradict each other", EXIT_USAGE)
    if args.gpus < 1:
        raise CliError(f"--gpus must be at least 1, got {args.gpus}", EXIT_USAGE)
    wait: bool | float = not args.no_wait
    if args.wait is not None:
        try:
            wait = parse_duration(args.wait)
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    from vaccel.contract_files import ContractFileError

    try:
        return run_under_lease(
            command, gpus=args.gpus, min_memory_mib=_size(args.min_memory), contract=args.contract,
            config=args.config, wait=wait, socket=args.socket, quiet=args.quiet,
        )
    except Interrupted as exc:
        raise CliError(str(exc), exc.exit_code) from None
    except ContractFileError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except LeaseError as exc:
        code = {"resource_exhausted": EXIT_TEMPFAIL, "deadline_exceeded": EXIT_TEMPFAIL,
                "unavailable": EXIT_UNAVAILABLE, "invalid_argument": EXIT_USAGE}.get(exc.code, EXIT_REFUSED)
        raise CliError(str(exc), code) from None


# -- parser ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    socket_help = "the broker's socket (default: $VACCEL_SOCKET, then the standard places)"
    # Accepted before or after the command; SUPPRESS keeps a subcommand from resetting a
    # --socket given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", default=argparse.SUPPRESS, help=socket_help)
    parser = argparse.ArgumentParser(prog="vaccel", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", default=None, help=socket_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("status", parents=[common], help="devices, holders, queue, unleased GPU processes",
                       description="Show every device with its state (free, leased, busy, unhealthy), who "
                                   "holds it since when, the wait queue, and GPU processes that hold no lease.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("run", parents=[common], help="run a command on leased devices",
                       description="Lease devices, run COMMAND with them visible (and only them), release "
                                   "when it ends. Waits in line when all devices are taken. The exit status "
                                   "is COMMAND's; signals are forwarded; if vaccel run dies, COMMAND dies.",
                       epilog="example: vaccel run --gpus 2 --min-memory 20GiB -- torchrun "
                              "--nproc_per_node 2 train.py")
    p.add_argument("--gpus", type=int, default=1, help="how many devices, all at once (default 1)")
    p.add_argument("--min-memory", metavar="SIZE", help="memory each device must have, with a unit: 20GiB, 512MiB")
    p.add_argument("--contract", metavar="FILE", help="runtime-spec.yaml (default: ./runtime-spec.yaml if present)")
    p.add_argument("--config", metavar="FILE",
                   help="accelerator-config.yaml (default: ./accelerator-config.yaml if present)")
    p.add_argument("--wait", metavar="DURATION", help="give up after waiting this long, e.g. 30m, 2h")
    p.add_argument("--no-wait", action="store_true", help="fail at once if the devices are busy")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("leases", parents=[common], help="list leases",
                       description="List your active leases; --all lists everyone's (root and the admin group).")
    p.add_argument("--all", action="store_true", help="every user's leases (admins)")
    p.add_argument("--ended", action="store_true", help="include recently ended leases")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_leases)

    p = sub.add_parser("release", parents=[common], help="give a lease back",
                       description="End a lease: your own, or anyone's if you are root or in the admin group.")
    p.add_argument("lease_id", metavar="LEASE_ID")
    p.add_argument("--reason", help="recorded and shown to the holder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("drain", parents=[common], help="take a device out of the pool (admins)",
                       description="Stop granting a device (maintenance, a flaky card); a lease it carries "
                                   "runs to its end. --undo puts it back. Root and the admin group only.")
    p.add_argument("device", metavar="DEVICE", help="index (0 or gpu0) or uuid, as `vaccel status` shows")
    p.add_argument("--undo", action="store_true", help="put the device back into the pool")
    p.add_argument("--reason", help="shown in `vaccel status`")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("check", parents=[common], help="check a runtime contract against this host",
                       description="One line per check, for the devices of this host and this Python "
                                   "environment. Exit 0 when satisfiable, 1 when not, 2 on a bad file.")
    p.add_argument("spec", nargs="?", metavar="runtime-spec.yaml",
                   help="the contract (default: ./runtime-spec.yaml if present)")
    p.add_argument("--config", metavar="FILE", help="accelerator-config.yaml")
    p.add_argument("--gpus", type=int, default=1, help="how many devices the job needs (default 1)")
    p.add_argument("--min-memory", metavar="SIZE", help="memory each device must have, with a unit: 20GiB, 512MiB")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)
    # Commands that live in their own modules (imported here, not at the top: they use
    # this module's helpers, and `vaccel run` should not pay for their imports twice).
    from vaccel import cli_extra

    cli_extra.register_all(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; from the command line (argv None) the process then ends at once."""
    code = _main(argv)
    if argv is None:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process as soon as the output is out. Everything that matters is done (the
    lease is released, the channel closed); the interpreter's orderly teardown with gRPC
    loaded would add ~30 ms to every `vaccel run` and `vaccel status` for nothing."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `vaccel status | head`: the reader left, which is fine
        pass
    except (OSError, ValueError):
        code = code or EXIT_REFUSED
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as exc:
        print(f"vaccel: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `vaccel status | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""`vaccel`: the user's command line for the host's GPU broker.

Every listing command takes --json. A user's mistake is one line on stderr and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vaccel.cli.common import (
    EXIT_REFUSED,
    EXIT_USAGE,
    CliError,
    as_text,
    connection,
    devices_arg,
    refused,
    rpc,
    signal_number,
    size_arg,
    time_arg,
    wait_arg,
)
from vaccel.cli.parser import Parser, RawDescriptionHelpFormatter
from vaccel.session.lease import LeaseError
from vaccel_common import status_json as status_shape
from vaccel_common.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    from vaccel.containers.engine_command import ContainerRun

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

exit status: run exits with the command's status (124 when the lease's time limit stopped
it); 1 refused, 2 bad usage or file, 69 broker unreachable, 75 busy (--no-wait), waited
too long (--wait) or too many of your requests waiting (max_waiting), 127 command not found.
"""


# -- status ----------------------------------------------------------------------------


def status_json(reply: pb.StatusReply) -> dict[str, Any]:
    """The DESIGN.md shape, built in vaccel_common so the dashboard's /api/status is the same."""
    return status_shape.status_json(reply)  # "enforcement" too: it is part of the shared shape


def cmd_status(args: argparse.Namespace) -> int:
    reply = rpc(connection(args), "Status", pb.StatusRequest())
    if args.json:
        print(json.dumps(status_json(reply), indent=2))
        return 0
    from vaccel_common.status_text import render_status

    print(render_status(reply, every=args.all))  # already safe for a terminal, line by line (shown())
    return 0


# -- run -------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from vaccel.run.runner import Interrupted, run_under_lease

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise CliError("nothing to run: vaccel run [options] -- COMMAND [ARGS...]", EXIT_USAGE)
    wait = wait_arg(args)
    gpus, devices = devices_arg(args)
    args.time = time_arg(args.time)  # seconds from here on (vaccel/slurm/submit.py reads it too)
    if args.lease and (devices or args.time or args.gpus is not None or args.memory):
        raise CliError("--lease runs inside an existing lease: --gpus, --memory, --device and --time belong to "
                       "the lease (vaccel reserve), not to the run", EXIT_USAGE)
    warn_signal = signal_number(args.signal)
    container = _container_run(command)
    if container is not None:  # what a container's lease may be asked with (and `docker start`'s devices)
        from vaccel.containers.start import lease_options

        gpus, devices = lease_options(container, args, gpus, devices)
    if not args.lease:  # a login node in [slurm] mode = "submit": Slurm runs it (vaccel/slurm/submit.py)
        from vaccel.slurm.submit import run_from_cli

        submitted = run_from_cli(args, command, gpus, devices, wait)
        if submitted is not None:
            return submitted
    from vaccel.contract.files import ContractFileError
    from vaccel.run.command_path import CommandNotFound, find_command

    try:
        find_command(command[0])  # a typo is said now, not after the wait and the grant
        return run_under_lease(
            command, gpus=gpus, min_memory_mib=size_arg(args.min_memory), contract=args.contract,
            config=args.config, wait=wait, socket=args.socket, quiet=args.quiet, time_limit=args.time,
            devices=devices, lease_id=args.lease or "", warn_signal=warn_signal, container=container,
            count_given=args.gpus is not None or bool(devices),
            memory_mib=size_arg(args.memory, "--memory"),
        )
    except CommandNotFound as exc:
        raise CliError(str(exc), exc.exit_code) from None
    except Interrupted as exc:
        raise CliError(str(exc), exc.exit_code) from None
    except ContractFileError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except LeaseError as exc:
        raise refused(exc) from None


# vaccel.containers.engine_command.ENGINE_PROGRAMS's names (tests/test_containers_client.py checks): known
# here so that a plain `vaccel run` does not import the container machinery to learn it is not a container run.
_ENGINE_PROGRAMS, _COMPOSE = ("docker", "podman", "podman-remote"), ("docker-compose", "podman-compose")


def _container_run(command: list[str]) -> ContainerRun | None:
    """The command read as a container engine's run (vaccel/containers/engine_command.py), None for any other
    command; a run that would defeat the lease is refused here, before anything starts."""
    if os.path.basename(command[0]) not in (*_ENGINE_PROGRAMS, *_COMPOSE):
        return None
    from vaccel.containers import rules as container_rules
    from vaccel.containers.engine_command import ContainerRefused, recognise

    try:
        run = recognise(command)
        if run is not None:
            container_rules.check(run)
        else:  # `docker start NAME`, `docker restart NAME`: the way back to a container (container_start.py)
            from vaccel.containers.start import recognise_start

            return recognise_start(command)  # type: ignore[return-value]
    except ContainerRefused as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    return run


# -- parser ----------------------------------------------------------------------------

RUN_EPILOG = """\
which devices: of the free ones that meet the request, all of one model when the host has
enough free (a mix only when it has not), close together (one NVLink group, else one
NUMA node); a one-device request gets the smallest free device that fits, so big ones
stay free for the jobs that need them (--device or --min-memory choose otherwise). A
lease's devices are in index order: the job's device 0 is its lowest-numbered one.

inside a lease (vaccel shell, or a command of vaccel run): vaccel run joins that lease
instead of asking for more; --gpus N takes its N lowest devices, --device picks them; a
request for more than the lease holds is refused at once.

exit status: the command's (128+N if signal N killed it); 124 when the lease's time limit
stopped it; 127 command not found (said before anything is leased); 1 refused, 2 bad
usage, 69 no broker, 75 busy (--no-wait) or --wait ran out.

example: vaccel run --gpus 2 --min-memory 20GiB -- torchrun --nproc_per_node 2 train.py
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `command` one of this module's commands, only that
    command's: building all of them costs every `vaccel run` ~8 ms."""
    socket_help = "the broker's socket (default: $VACCEL_SOCKET, then the standard places)"
    # Accepted before or after the command; SUPPRESS keeps a subcommand from resetting a
    # --socket given before it.
    common = Parser(add_help=False)
    common.add_argument("--socket", default=argparse.SUPPRESS, help=socket_help)
    parser = Parser(prog="vaccel", description=DESCRIPTION, formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("--socket", default=None, help=socket_help)
    parser.add_argument("--version", action="version", version=_version(), help="the client's version and where it is "
                        "installed")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if command in _COMMANDS:
        _COMMANDS[command](sub, common)
        return parser
    for add in _COMMANDS.values():
        add(sub, common)
    # Commands that live in their own modules (imported here, not at the top: they use
    # this module's helpers, and `vaccel run` should not pay for their imports twice).
    from vaccel.cli import commands as cli_extra

    cli_extra.register_all(sub, common)
    return parser


def _version() -> str:
    from vaccel import __file__ as package_file
    from vaccel import __version__

    return f"vaccel {__version__} ({os.path.dirname(package_file)})"


def _later(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A command implemented in `module`, imported only when that command runs."""
    def run(args: argparse.Namespace) -> int:
        import importlib

        func: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
        return func(args)

    return run


def _command_named(argv: list[str]) -> str | None:
    """The command word of `argv` (after a leading --socket), None before any other option."""
    words = iter(argv)
    for word in words:
        if word == "--socket":
            next(words, None)
        elif not word.startswith("--socket="):
            return None if word.startswith("-") else word
    return None


def _add_status(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common], help="devices, holders, queue, unleased GPU processes",
                       description="Show every device with its state (free, leased, busy, unhealthy), who "
                                   "holds it since when, the wait queue, and GPU processes that hold no lease.")
    p.add_argument("--json", action="store_true", help="machine-readable output (the whole queue)")
    p.add_argument("--all", action="store_true", help="every waiting request (else the first 10 and a count)")
    p.set_defaults(func=cmd_status)


def _add_run(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="run a command on leased devices",
                       description="Lease devices, run COMMAND with them visible (and only them), release "
                                   "when it ends. Waits in line when all devices are taken. The exit status "
                                   "is COMMAND's; signals are forwarded; if vaccel run dies, COMMAND dies.",
                       epilog=RUN_EPILOG, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None,
                   help="how many devices, all at once (default 1, or as many as --device names; inside a "
                        "lease: all of it)")
    p.add_argument("--min-memory", metavar="SIZE", help="memory each device must have, with a unit: 20GiB, 512MiB")
    p.add_argument("--memory", metavar="SIZE", help="a share of this much memory of one shared GPU instead of "
                   "a whole one, e.g. 20GiB (docs/sharing.md)")
    p.add_argument("--time", metavar="DURATION",
                   help="the lease's time limit: 90m, 2h, 1d12h, or as Slurm writes it (01:30:00, 1-12:00:00); a "
                        "bare number is refused (Slurm reads 90 as minutes). Default: the broker's policy. A short "
                        "limit can start sooner: it may use devices kept for a bigger job that starts after it ends")
    p.add_argument("--device", action="append", metavar="DEV",
                   help="only this device: gpu1 (as `vaccel status` shows) or its uuid; repeat for more")
    p.add_argument("--lease", metavar="LEASE_ID", help="run inside your existing lease (vaccel reserve); inside "
                                                       "one (vaccel shell) that lease is joined without this")
    p.add_argument("--signal", default="USR1", metavar="SIG",
                   help="sent to COMMAND before its lease ends (time limit, revoke with grace) so it can "
                        "checkpoint; SIGTERM follows at the end, SIGKILL after a grace (default USR1; none)")
    p.add_argument("--contract", metavar="FILE", help="runtime-spec.yaml (default: ./runtime-spec.yaml if present)")
    p.add_argument("--config", metavar="FILE",
                   help="accelerator-config.yaml (default: ./accelerator-config.yaml if present)")
    p.add_argument("--wait", metavar="DURATION", help="give up after waiting this long, e.g. 30m, 2h")
    p.add_argument("--no-wait", action="store_true", help="fail at once if the devices are busy")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="on stderr only the grant (no queue lines, no contract files, no release line)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    p.set_defaults(func=cmd_run)


def _add_leases(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("leases", parents=[common], help="list leases",
                       description="List your active leases; --all lists everyone's (root and the admin group).")
    p.add_argument("--all", action="store_true", help="every user's leases (admins)")
    p.add_argument("--ended", action="store_true", help="include recently ended leases")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_later("vaccel.cli.leases", "cmd_leases"))


def _add_release(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("release", parents=[common], help="give a lease back",
                       description="End a lease: your own, or anyone's if you are root or in the admin group.")
    p.add_argument("lease_id", metavar="LEASE_ID")
    p.add_argument("--reason", help="recorded and shown to the holder")
    p.add_argument("--grace", metavar="DURATION",
                   help="tell the holder now and end the lease after this long (e.g. 10m), so the job "
                        "can checkpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_later("vaccel.cli.leases", "cmd_release"))


def _add_drain(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("drain", parents=[common], help="take a device out of the pool (admins)",
                       description="Stop granting a device (maintenance, a flaky card); a lease it carries "
                                   "runs to its end. --undo puts it back. Root and the admin group only.")
    p.add_argument("device", metavar="DEVICE", help="index (0 or gpu0) or uuid, as `vaccel status` shows")
    p.add_argument("--undo", action="store_true", help="put the device back into the pool")
    p.add_argument("--reason", help="shown in `vaccel status`")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_later("vaccel.cli.leases", "cmd_drain"))


def _add_check(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("check", parents=[common], help="check a runtime contract against this host",
                       description="One line per check, for the devices of this host and the job's Python "
                                   "(--python). Exit 0 when satisfiable, 1 when not, 2 on a bad file.")
    p.add_argument("spec", nargs="?", metavar="runtime-spec.yaml",
                   help="the contract (default: ./runtime-spec.yaml if present)")
    p.add_argument("--config", metavar="FILE", help="accelerator-config.yaml")
    p.add_argument("--gpus", type=int, default=1, help="how many devices the job needs (default 1)")
    p.add_argument("--min-memory", metavar="SIZE", help="memory each device must have, with a unit: 20GiB, 512MiB")
    p.add_argument("--python", metavar="PATH", help="the Python the job runs, whose torch and packages the "
                   "contract is checked against (default: the first python3 on PATH)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_later("vaccel.cli.check", "cmd_check"))


_COMMANDS: dict[str, Callable[[argparse._SubParsersAction, argparse.ArgumentParser], None]] = {
    "status": _add_status,
    "run": _add_run,
    "leases": _add_leases,
    "release": _add_release,
    "drain": _add_drain,
    "check": _add_check,
}


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
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_named(words))
    args, extra = parser.parse_known_args(words)
    if extra:  # said by the command's own parser, which knows the option meant
        command_parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command_parser.choices[args.command].unrecognized(extra)
    args = as_text(args)
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

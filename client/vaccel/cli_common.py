"""What every `vaccel` command shares: exit statuses, the one-line error, the broker call,
and how text, tables, sizes, durations, devices and signals are read and shown."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from vaccel.connection import BrokerConnection, BrokerUnavailable
from vaccel.grpc_lazy import grpc
from vaccel.lease_types import LeaseError
from vaccel_common import status_json as status_shape
from vaccel_common.text import argv_text, printable
from vaccel_common.units import parse_duration, parse_size_mib, parse_time_limit

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: the broker cannot be reached
EXIT_TEMPFAIL = 75  # sysexits EX_TEMPFAIL: busy with --no-wait, --wait ran out, max_waiting reached
# `vaccel run`: the lease reached its time limit and the command was stopped; timeout(1)'s
# status, so a script tells "ran out of time" from a crash (Slurm's TIMEOUT) as it would there.
EXIT_TIME_LIMIT = 124

LONGEST_S = 366 * 86400.0  # past this a duration typed on the command line is a typo
MOST_GPUS = 65536  # past this a device count is a typo (and would not fit the request's field)
MOST_MIB = 1 << 30  # 1 PiB: past this a device's memory is a typo


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.code = code


def connection(args: argparse.Namespace) -> BrokerConnection:
    return BrokerConnection(args.socket)


def rpc(conn: BrokerConnection, method: str, request: Any) -> Any:
    try:
        return conn.call(method, request, retry_unavailable_s=2.0)
    except BrokerUnavailable as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None
    except grpc.RpcError as exc:
        code = EXIT_USAGE if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else EXIT_REFUSED
        raise CliError(exc.details() or exc.code().name, code) from None


def to_dict(msg: Any) -> dict[str, Any]:
    return status_shape.message_dict(msg)


def shown(text: str) -> str:
    """Text for a terminal: commands and names come from other users' processes exactly
    as they set them (--json keeps them so); here nothing unprintable gets through."""
    return "\n".join(printable(line) for line in text.split("\n"))


def size_arg(text: str | None, option: str = "--min-memory") -> int:
    if text is None:
        return 0
    if text.strip().replace(".", "", 1).isdigit():
        # A bare number would be bytes: `--min-memory 20` almost always means 20 GiB.
        raise CliError(f"{option} {text.strip()}: give a unit, e.g. {text.strip()}GiB or {text.strip()}MiB",
                       EXIT_USAGE)
    try:
        mib = parse_size_mib(text)
    except ValueError as exc:
        raise CliError(f"{option}: {exc}", EXIT_USAGE) from None
    if mib > MOST_MIB:
        raise CliError(f"{option} {text.strip()}: more memory than any device has", EXIT_USAGE)
    return mib


# -- what `run` and `reserve` share: how many devices, how long to wait, how a refusal exits --


def devices_arg(args: argparse.Namespace) -> tuple[int, tuple[str, ...]]:
    """(gpus, devices) from --gpus and --device: --gpus defaults to as many as named. Names
    are read as `vaccel status` shows them, in any case (GPU1 = gpu1); one named twice is
    refused (the broker also sees through a uuid and gpuN naming the same device)."""
    devices = tuple(device_name(name) for name in args.device or ())
    twice = sorted({name for name in devices if devices.count(name) > 1})
    if twice:
        raise CliError(f"--device {twice[0]} is named twice: name each device once", EXIT_USAGE)
    gpus = args.gpus if args.gpus is not None else max(1, len(devices))
    gpus_arg(gpus)
    if getattr(args, "memory", None) and gpus != 1:
        raise CliError(f"--memory asks for a share of one GPU, --gpus {gpus} for whole GPUs: give one of them "
                       "(see docs/sharing.md)", EXIT_USAGE)
    if devices and gpus > len(devices):
        raise CliError(f"--gpus {gpus} but only {len(devices)} --device named: name at least as many", EXIT_USAGE)
    return gpus, devices


def gpus_arg(gpus: int) -> int:
    """A --gpus count, checked where every command that takes one can say it the same way."""
    if gpus < 1:
        raise CliError(f"--gpus must be at least 1, got {gpus}", EXIT_USAGE)
    if gpus > MOST_GPUS:
        raise CliError(f"--gpus {gpus}: more devices than any host has (`vaccel status` lists this one's)",
                       EXIT_USAGE)
    return gpus


def device_name(text: str) -> str:
    """`gpu1`, `GPU1` and ` gpu1 ` are the same name; a uuid is passed on as typed (the broker
    compares uuids without regard to case)."""
    name = text.strip()
    return name.lower() if name.lower().startswith("gpu") and name[3:].isdigit() else name


def time_arg(text: str | None, option: str = "--time") -> float | None:
    """Seconds of a time limit: 90m, 2h, 1d12h, or as Slurm writes it (01:30:00, 1-12:00:00).
    A bare number is refused, not guessed: Slurm reads `--time 90` as minutes, and every other
    duration here as seconds."""
    if text is None:
        return None
    value = text.strip()
    if value.replace(".", "", 1).isdigit():
        raise CliError(f"{option} {value}: give a unit: {value}m for minutes (what Slurm means by a bare number), "
                       f"{value}s for seconds, or Slurm's HH:MM:SS", EXIT_USAGE)
    if value.startswith("-"):
        raise CliError(f"{option} {value}: a time limit must be longer than 0", EXIT_USAGE)
    try:
        seconds = parse_time_limit(value)
    except ValueError as exc:
        raise CliError(f"{option}: {exc}", EXIT_USAGE) from None
    if not seconds > 0:
        raise CliError(f"{option} {value}: a time limit must be longer than 0", EXIT_USAGE)
    if seconds > LONGEST_S:
        raise CliError(f"{option} {value}: longer than any lease may be (at most 366d; the broker's policy may "
                       "allow less: `vaccel status` shows it)", EXIT_USAGE)
    return seconds


def wait_arg(args: argparse.Namespace) -> bool | float:
    """--wait DURATION / --no-wait: True waits for as long as it takes."""
    if args.no_wait and args.wait is not None:
        raise CliError("--wait and --no-wait contradict each other", EXIT_USAGE)
    if args.wait is None:
        return not args.no_wait
    try:
        seconds = parse_duration(args.wait)
    except ValueError as exc:
        raise CliError(f"--wait: {exc}", EXIT_USAGE) from None
    if seconds > LONGEST_S:
        raise CliError(f"--wait {args.wait.strip()}: longer than a year; leave --wait out to wait for as long as "
                       "it takes", EXIT_USAGE)
    return seconds


def refused(exc: LeaseError) -> CliError:
    """A lease refusal as the CLI's error, with the exit status scripts rely on."""
    code = {"resource_exhausted": EXIT_TEMPFAIL, "deadline_exceeded": EXIT_TEMPFAIL,
            "unavailable": EXIT_UNAVAILABLE, "invalid_argument": EXIT_USAGE}.get(exc.code, EXIT_REFUSED)
    return CliError(str(exc), code)


def signal_number(name: str) -> int | None:
    """--signal USR1 / SIGUSR1 / 10 / none."""
    import signal

    if name.lower() == "none":
        return None
    try:
        return int(signal.Signals(int(name)) if name.isdigit() else signal.Signals[
            name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"])
    except (KeyError, ValueError):
        raise CliError(f"--signal {name!r} is not a signal name (USR1, SIGUSR2, TERM, none)", EXIT_USAGE) from None


def as_text(args: argparse.Namespace) -> argparse.Namespace:
    """Every option and operand as UTF-8 text (bytes that are not become `\\xNN`), except the
    command to run, which keeps its bytes for exec."""
    for name, value in vars(args).items():
        if name == "cmd":
            continue
        if isinstance(value, str):
            setattr(args, name, argv_text(value))
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            setattr(args, name, [argv_text(v) for v in value])
    return args


def queue_printer(quiet: bool) -> Callable[[str], None]:
    """`vaccel run` and `vaccel reserve` print each queue message once: the broker repeats
    it while nothing changes."""
    last = [""]

    def on_queue(message: str) -> None:
        if message != last[0] and not quiet:
            last[0] = message
            print(f"vaccel: {message}", file=sys.stderr, flush=True)

    return on_queue

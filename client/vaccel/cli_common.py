"""What every `vaccel` command shares: exit statuses, the one-line error, the broker call,
and how text, tables, sizes, durations, devices and signals are read and shown."""

from __future__ import annotations

import argparse
import time
from typing import Any

from vaccel.connection import BrokerConnection, BrokerUnavailable
from vaccel.grpc_lazy import grpc
from vaccel.lease_types import LeaseError
from vaccel_common import status_json as status_shape
from vaccel_common.text import printable
from vaccel_common.units import format_duration, parse_duration, parse_size_mib

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: the broker cannot be reached
EXIT_TEMPFAIL = 75  # sysexits EX_TEMPFAIL: busy with --no-wait, or --wait ran out


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


def since(ts: float) -> str:
    if not ts:
        return "-"
    age = time.time() - ts
    return f"{time.strftime('%H:%M', time.localtime(ts))} ({format_duration(age)} ago)"


def shown(text: str) -> str:
    """Text for a terminal: commands and names come from other users' processes exactly
    as they set them (--json keeps them so); here nothing unprintable gets through."""
    return "\n".join(printable(line) for line in text.split("\n"))


def table(rows: list[list[str]], header: list[str]) -> str:
    rows = [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]
    return "\n".join(lines)


def size_arg(text: str | None, option: str = "--min-memory") -> int:
    if text is None:
        return 0
    if text.strip().replace(".", "", 1).isdigit():
        # A bare number would be bytes: `--min-memory 20` almost always means 20 GiB.
        raise CliError(f"{option} {text.strip()}: give a unit, e.g. {text.strip()}GiB or {text.strip()}MiB",
                       EXIT_USAGE)
    try:
        return parse_size_mib(text)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


# -- what `run` and `reserve` share: how many devices, how long to wait, how a refusal exits --


def devices_arg(args: argparse.Namespace) -> tuple[int, tuple[str, ...]]:
    """(gpus, devices) from --gpus and --device: --gpus defaults to as many as named."""
    devices = tuple(args.device or ())
    gpus = args.gpus if args.gpus is not None else max(1, len(devices))
    if gpus < 1:
        raise CliError(f"--gpus must be at least 1, got {gpus}", EXIT_USAGE)
    if getattr(args, "memory", None) and gpus != 1:
        raise CliError(f"--memory asks for a share of one GPU, --gpus {gpus} for whole GPUs: give one of them "
                       "(see docs/sharing.md)", EXIT_USAGE)
    if devices and gpus > len(devices):
        raise CliError(f"--gpus {gpus} but only {len(devices)} --device named: name at least as many", EXIT_USAGE)
    return gpus, devices


def wait_arg(args: argparse.Namespace) -> bool | float:
    """--wait DURATION / --no-wait: True waits for as long as it takes."""
    if args.no_wait and args.wait is not None:
        raise CliError("--wait and --no-wait contradict each other", EXIT_USAGE)
    if args.wait is None:
        return not args.no_wait
    try:
        return parse_duration(args.wait)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


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

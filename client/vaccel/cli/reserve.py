"""`vaccel reserve`: book devices for a while, held by you rather than by a process.

The reservation outlives the command that made it (and a daemon restart, and a reboot:
the broker commits it to disk before it answers). Use it with `vaccel shell ID` or
`vaccel run --lease ID -- CMD`, or export the printed variables in your own shell. It
ends at its time limit (always set: the broker's default when --time is not given), on
`vaccel release ID`, or when an admin revokes it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "reserve", parents=[common], help="book devices for a while (a lease held by you, not a process)",
        description="Book devices until a time limit: the reservation outlives this command. Then run "
                    "commands on it with `vaccel run --lease ID -- CMD` or `vaccel shell ID`, and give it "
                    "back early with `vaccel release ID`. Waits in line when the devices are taken.",
        epilog="example: vaccel reserve --gpus 1 --time 4h   then   vaccel shell")
    p.add_argument("--gpus", type=int, default=None,
                   help="how many devices (default 1, or as many as --device names)")
    p.add_argument("--time", metavar="DURATION",
                   help="how long to keep them: 4h, 90m, or as Slurm writes it (04:00:00, 1-00:00); a bare "
                        "number is refused (default and ceiling: the broker's policy)")
    p.add_argument("--device", action="append", metavar="DEV",
                   help="only this device: gpu1 or its uuid; repeat for more")
    p.add_argument("--min-memory", metavar="SIZE", help="memory each device must have: 20GiB, 512MiB")
    p.add_argument("--memory", metavar="SIZE", help="a share of this much memory of one shared GPU, e.g. 20GiB")
    p.add_argument("--contract", metavar="FILE", help="runtime-spec.yaml the devices must satisfy")
    p.add_argument("--wait", metavar="DURATION", help="give up after waiting this long (default: wait)")
    p.add_argument("--no-wait", action="store_true", help="fail at once if the devices are busy")
    p.add_argument("--json", action="store_true",
                   help='print {"lease_id", "devices", "env", "expires_at"} instead of text')
    p.set_defaults(func=cmd_reserve)


def reservation_json(held: Any) -> dict[str, Any]:
    return {
        "lease_id": held.id,
        "devices": [{"index": d.index, "label": d.label, "uuid": d.uuid, "name": d.name} for d in held.devices],
        "share_mib": held.share_mib,
        "backend": held.backend,
        "env": dict(held.env),
        "expires_at": held.expires_at,
        "time_limit_s": held.time_limit_s,
        "simulated": held.simulated,
    }


def cmd_reserve(args: argparse.Namespace) -> int:
    from vaccel.cli.common import (
        EXIT_USAGE,
        CliError,
        devices_arg,
        queue_printer,
        refused,
        size_arg,
        time_arg,
        wait_arg,
    )
    from vaccel.contract.files import ContractFileError
    from vaccel.session.lease import LeaseError
    from vaccel.session.lease_session import LeaseRequest, LeaseSession
    from vaccel_common.units import format_duration

    gpus, devices = devices_arg(args)
    wait = wait_arg(args)
    try:
        request = LeaseRequest(gpus=gpus, min_memory_mib=size_arg(args.min_memory), wait=wait,
                               contract=args.contract, command="vaccel reserve", time=time_arg(args.time),
                               devices=devices, reservation=True, memory_mib=size_arg(args.memory, "--memory"),
                               argv=("python3",))  # the jobs to come run their own Python: as `vaccel check`
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    with LeaseSession(args.socket, on_queue=queue_printer(quiet=False),
                      on_contract=lambda line: print(f"vaccel: {line}", file=sys.stderr)) as session:
        try:
            held = session.acquire(request)
        except KeyboardInterrupt:
            raise CliError("interrupted while waiting; left the queue", 130) from None
        except ContractFileError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        except LeaseError as exc:
            raise refused(exc) from None
    if args.json:
        print(json.dumps(reservation_json(held), indent=2))
        return 0
    names = ", ".join(f"{d.label} {d.name}" for d in held.devices)
    if held.share_mib:
        names = f"a {held.share_mib} MiB share of {names}"
    until = time.strftime("%a %H:%M", time.localtime(held.expires_at)) if held.expires_at else "released"
    left = format_duration(held.expires_at - time.time()) if held.expires_at else ""
    print(f"reserved {held.id}: {names}{' (simulated)' if held.simulated else ''}, until {until}"
          f"{f' ({left} from now)' if left else ''}")
    print(f"  vaccel shell {held.id}                      a shell on it")
    print(f"  vaccel run --lease {held.id} -- CMD ...     a command on it")
    print(f"  vaccel release {held.id}                    give it back early")
    print("or in this shell:")
    for name, value in sorted(held.env.items()):
        print(f"  export {name}={shlex.quote(value)}")
    return 0

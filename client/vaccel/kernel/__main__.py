"""The vaccel kernel process, as a kernelspec starts it:

    python -m vaccel.kernel -f CONNECTION_FILE [--gpus N] [--on-busy wait|fail] [--max-wait D] [--socket PATH]

It takes the lease first and only then starts IPython's kernel in this same process, so:

- the lease's holder is the kernel process itself: when it exits for any reason (shut
  down, restarted, culled, killed with -9) the broker sees the pid end and frees the
  devices at once (it watches the holder through a pidfd); a restart is a new process,
  hence a new lease;
- the lease's environment is in place before any cell can start a device runtime;
- Jupyter's interrupt (SIGINT to the kernel) reaches IPython as it always does: lease()
  takes over SIGTERM only, to release on the way out.

While it waits it reports its queue place to the server's provisioner (report.py), which
fails the start with the broker's message when the lease is refused.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from vaccel.kernel.report import Reporter

EXIT_REFUSED = 75  # as `vaccel run --no-wait` when busy: sysexits EX_TEMPFAIL
EXIT_LOST = 1
_SAY_GRACE_S = 1.0  # for the kernel's I/O thread to send the last words before the process ends


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options; the rest goes to IPython's kernel as it came."""
    p = argparse.ArgumentParser(prog="python -m vaccel.kernel")
    p.add_argument("-f", dest="connection_file", required=True, help="the connection file Jupyter wrote")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--on-busy", choices=("wait", "fail"), default="wait",
                   help="no device free: wait in the queue, or fail the start with the queue's message")
    p.add_argument("--max-wait", metavar="DURATION", help="wait at most this long (e.g. 30s, 10m), then fail")
    p.add_argument("--socket", help="the broker's socket (default: $VACCEL_SOCKET, then the standard places)")
    return p.parse_known_args(argv)


def wait_for(args: argparse.Namespace) -> bool | str:
    """lease()'s `wait`: True waits for as long as it takes, False fails at once when busy."""
    if args.max_wait:
        return args.max_wait
    return args.on_busy == "wait"


def main(argv: list[str] | None = None) -> int:
    args, kernel_args = parse_args(sys.argv[1:] if argv is None else argv)
    # Jupyter interrupts a kernel before every shutdown and restart. Until IPython takes
    # SIGINT over (it too ignores it outside a running cell), one arriving while we wait or
    # import must not end the start half-way with a traceback; SIGTERM still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reporter = Reporter.from_env()
    if args.socket:  # so that `%vaccel` and `!vaccel status` in a cell find the same broker
        os.environ["VACCEL_SOCKET"] = args.socket
    from vaccel.contract_files import ContractFileError
    from vaccel.leasing import LeaseError, lease

    name = os.environ.get("JPY_SESSION_NAME", "")  # the notebook's path, where the server says it
    granted = False
    try:
        held_lease = lease(args.gpus, wait=wait_for(args), socket=args.socket, on_queue=reporter.queued,
                           on_lost=_stop_kernel, command=f"jupyter kernel {name}".strip())
        with held_lease as held:
            granted = True
            devices = ", ".join(f"{d.label} {d.name}" for d in held.devices)
            reporter.granted(f"lease {held.id}: {devices}" + (" (simulated)" if held.simulated else ""))
            _run_ipython_kernel(args.connection_file, kernel_args)
    except (LeaseError, ContractFileError, ValueError) as exc:
        if granted:  # the kernel's own failure, not a refusal: its traceback says more
            raise
        reporter.refused(str(exc))
        return EXIT_REFUSED
    return 0


def _run_ipython_kernel(connection_file: str, kernel_args: list[str]) -> None:
    """IPython's kernel in this process, with `%vaccel` loaded; returns when it shuts down."""
    from ipykernel.kernelapp import IPKernelApp

    app = IPKernelApp.instance()
    app.initialize(["-f", connection_file, *kernel_args])
    if app.shell is not None:
        app.shell.extension_manager.load_extension("vaccel.kernel.magic")
    app.start()


def _stop_kernel(held: Any, reason: str) -> None:
    """The lease ended behind the kernel's back (revoked, released from a terminal, its time
    limit): this process must not go on using devices that may be someone else's now.
    Runs on the heartbeat thread. A SIGTERM would not do: a running cell catches the
    SystemExit it raises. So: say why in the notebook (IPython's stderr goes to the cell
    that runs, or ran last), give its I/O thread a moment to send that, and end. There is
    nothing to release; Jupyter restarts the kernel, which asks for a new lease."""
    said = reason if held.id in reason else f"lease {held.id} ended: {reason}"
    try:
        print(f"vaccel: {said}; the kernel stops so that it no longer uses the lease's devices. "
              "Restart it for a new lease.", file=sys.stderr, flush=True)
        time.sleep(_SAY_GRACE_S)
    finally:
        os._exit(EXIT_LOST)


if __name__ == "__main__":
    sys.exit(main())

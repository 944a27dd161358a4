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
fails the start with the broker's message when the lease is refused; it gives up waiting
when the server that started it is gone. When the lease ends behind its back it tells the
provisioner, says why in the notebook and exits; Jupyter's automatic restart then gets a
kernel without a lease that says why in every cell (stopped.py), until the user restarts.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

from vaccel.kernel.report import Reporter
from vaccel.kernel.stopped import STOPPED_VAR, run_stopped_kernel

EXIT_REFUSED = 75  # as `vaccel run --no-wait` when busy: sysexits EX_TEMPFAIL
EXIT_LOST = 1
EXIT_ABANDONED = 69  # the server that started the kernel is gone: sysexits EX_UNAVAILABLE
_SAY_GRACE_S = 1.0  # for the kernel's I/O thread to send the last words before the process ends
_ORPHAN_POLL_S = 0.5


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
    put_own_commands_on_path()
    if args.socket:  # so that `%vaccel` and `!vaccel status` in a cell find the same broker
        os.environ["VACCEL_SOCKET"] = args.socket
    stopped = os.environ.pop(STOPPED_VAR, "")
    if stopped:  # Jupyter restarted us by itself after our lease ended: no new lease
        run_stopped_kernel(args.connection_file, kernel_args, stopped)
        return 0
    reporter = Reporter.from_env()
    from vaccel.contract.files import ContractFileError
    from vaccel.leasing import LeaseError, lease

    name = os.environ.get("JPY_SESSION_NAME", "")  # the notebook's path, where the server says it
    granted = threading.Event()
    _give_up_when_orphaned(granted)
    try:
        # No torch import before the lease (import_torch=False): the notebook may import it
        # later, and the kernel is ready 1-2 s sooner; a contract still gets torch's facts.
        held_lease = lease(args.gpus, wait=wait_for(args), socket=args.socket, on_queue=reporter.queued,
                           on_lost=functools.partial(_stop_kernel, reporter), import_torch=False,
                           command=f"jupyter kernel {name}".strip())
        with held_lease as held:
            granted.set()
            devices = ", ".join(f"{d.label} {d.name}" for d in held.devices)
            reporter.granted(f"lease {held.id}: {devices}" + (" (simulated)" if held.simulated else ""))
            _run_ipython_kernel(args.connection_file, kernel_args)
    except (LeaseError, ContractFileError, ValueError) as exc:
        if granted.is_set():  # the kernel's own failure, not a refusal: its traceback says more
            raise
        reporter.refused(str(exc))
        return EXIT_REFUSED
    return 0


def put_own_commands_on_path() -> None:
    """The `vaccel` command installed with this kernel's Python first on PATH, so that
    `!vaccel status` in a cell works (and is this vaccel) when the server was started from
    a venv that is not on PATH. Nothing changes where PATH already finds that one."""
    own_bin = os.path.dirname(sys.executable)
    own = os.path.join(own_bin, "vaccel")
    if not os.access(own, os.X_OK):
        return
    found = shutil.which("vaccel")
    if found is None or not os.path.samefile(found, own):
        rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
        os.environ["PATH"] = os.pathsep.join([own_bin, *rest])


def _give_up_when_orphaned(granted: threading.Event) -> None:
    """While the kernel waits for its lease: when the server that started it is gone (the
    kernel was re-parented), nobody will ever use this kernel, so it leaves the queue by
    exiting instead of taking a device when one frees. (Once granted, IPython's own parent
    poller does the same.)"""
    parent = os.getppid()

    def watch() -> None:
        while not granted.wait(_ORPHAN_POLL_S):
            if os.getppid() != parent:
                print("vaccel: the Jupyter server that started this kernel is gone; leaving the queue",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_ABANDONED)

    threading.Thread(target=watch, name="vaccel-kernel-orphan-watch", daemon=True).start()


def _run_ipython_kernel(connection_file: str, kernel_args: list[str]) -> None:
    """IPython's kernel in this process, with `%vaccel` loaded; returns when it shuts down."""
    from ipykernel.kernelapp import IPKernelApp

    app = IPKernelApp.instance()
    app.initialize(["-f", connection_file, *kernel_args])
    if app.shell is not None:
        app.shell.extension_manager.load_extension("vaccel.kernel.magic")
    app.start()


def _stop_kernel(reporter: Reporter, held: Any, reason: str) -> None:
    """The lease ended behind the kernel's back (revoked, released from a terminal, its time
    limit, idle reclaim): this process must not go on using devices that may be someone
    else's now. Runs on the heartbeat thread. A SIGTERM would not do: a running cell catches
    the SystemExit it raises. So: tell the provisioner (Jupyter's automatic restart must not
    lease again), say why in the notebook (IPython's stderr goes to the cell that runs, or
    ran last), give its I/O thread a moment to send that, and end. There is nothing to
    release."""
    said = reason if held.id in reason else f"lease {held.id} ended: {reason}"
    try:
        reporter.lost(said)
        print(f"vaccel: {said}; the kernel stops so that it no longer uses the lease's devices. "
              "Restart it for a new lease.", file=sys.stderr, flush=True)
        time.sleep(_SAY_GRACE_S)
    finally:
        os._exit(EXIT_LOST)


if __name__ == "__main__":
    sys.exit(main())

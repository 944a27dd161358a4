"""`vaccel run`: lease devices, run a command with them, release when it ends.

- The command's exit status becomes ours (128+N when a signal N killed it).
- Signals sent to `vaccel run` are forwarded; a Ctrl-C from the terminal already
  reaches the whole foreground process group, so it is not sent twice.
- If `vaccel run` dies, even by SIGKILL, the kernel kills the command (PR_SET_PDEATHSIG)
  and the broker ends the lease (it watches our pid). Processes the command left running
  in the background are not killed then; on real GPUs the broker sees them as GPU users
  without a lease and keeps their device out of the pool until they are gone.
- If the lease ends behind our back (revoked, expired), the command gets SIGTERM, then
  SIGKILL after a grace period: it must not keep computing on someone else's device.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from vaccel.connection import BrokerConnection, BrokerUnavailable
from vaccel.leasing import Heartbeat, Lease, LeaseError, consume_acquire, open_acquire
from vaccel_common.backends import DEVICE_ENV_VARS
from vaccel_common.v1 import broker_pb2 as pb

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_WAITED = {*FORWARDED, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent (the terminal's Ctrl-C)
LOST_GRACE_S = 10.0


# Resolved here, not in the child: loading symbols between fork and exec in a process
# with other threads (gRPC's) can deadlock on the loader's lock.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _child_setup(parent_pid: int) -> None:
    """Runs in the child between fork and exec: die with the parent, take signals again."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAITED)


def child_env(lease_obj: Lease, config_path: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DEVICE_ENV_VARS}
    env.update(lease_obj.env)
    if config_path is not None:
        env["VACCEL_ACCELERATOR_CONFIG"] = str(config_path)
    return env


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"vaccel: {message}", file=sys.stderr, flush=True)


def run_under_lease(
    command: list[str],
    *,
    gpus: int,
    min_memory_mib: int,
    contract: str | None,
    config: str | None,
    wait: bool | float,
    socket: str | None,
    quiet: bool = False,
) -> int:
    from vaccel.contract_files import load_contract_files
    from vaccel.facts import gather_facts

    # Block the signals we forward before any thread exists (gRPC starts some), so every
    # thread inherits the mask and only the main thread's sigtimedwait ever takes them.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    try:
        files = load_contract_files(contract, config, Path.cwd())
        request = pb.AcquireRequest(
            gpus=gpus, min_memory_mib=min_memory_mib,
            wait_forever=wait is True, max_wait_seconds=0.0 if isinstance(wait, bool) else float(wait),
            runtime_spec_yaml=files.spec_text, runtime_spec_name=files.spec_name,
            accelerator_config_yaml=files.config_text, accelerator_config_name=files.config_name,
            command=" ".join(command)[:200],
        )
        if files.spec_text or files.config_text:
            # Only a contract needs the interpreter's torch facts; importing torch costs seconds.
            request.client.CopyFrom(gather_facts(files.packages))
        connection = BrokerConnection(socket)
        try:
            granted = _acquire_interruptibly(connection, request, quiet)
            lease_obj = Lease(granted, joined=False, connection=connection)
            names = ", ".join(f"gpu{d.index} {d.name}" for d in lease_obj.devices)
            _say(quiet, f"lease {lease_obj.id}: {names}" + (" (simulated)" if lease_obj.simulated else ""))
            for warning in lease_obj.warnings:
                _say(quiet, f"warning: {warning}")
            try:
                env = child_env(lease_obj, files.config_path)
                return _supervise(command, lease_obj, connection, env)
            finally:
                _release(connection, lease_obj, quiet)
        finally:
            connection.close()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAITED)


class Interrupted(Exception):
    """A signal arrived while we waited in the queue; the request was withdrawn."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} while waiting; left the queue")
        self.exit_code = 128 + signum


def _acquire_interruptibly(connection: BrokerConnection, request: pb.AcquireRequest, quiet: bool) -> pb.Lease:
    """Wait for the grant on a worker thread while the main thread watches for signals."""
    last = [""]

    def on_queue(message: str) -> None:
        if message != last[0]:
            last[0] = message
            _say(quiet, message)

    call = open_acquire(connection, request)
    outcome: dict[str, object] = {}

    def consume() -> None:
        try:
            outcome["lease"] = consume_acquire(call, on_queue)
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc

    worker = threading.Thread(target=consume, name="vaccel-acquire", daemon=True)
    worker.start()
    while worker.is_alive():
        info = signal.sigtimedwait(FORWARDED, 0.2)
        if info is not None and info.si_signo in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            call.cancel()
            worker.join(5)
            raise Interrupted(info.si_signo)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    granted = outcome["lease"]
    if not isinstance(granted, pb.Lease):
        raise LeaseError("the broker ended the request without a grant", "internal")
    return granted


def _supervise(command: list[str], lease_obj: Lease, connection: BrokerConnection, env: dict[str, str]) -> int:
    """Run the command, forward signals, stop it if the lease ends; return its status."""
    parent = os.getpid()
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=lambda: _child_setup(parent))
    except OSError as exc:
        _say(False, f"cannot run {command[0]}: {exc.strerror}")
        return 127 if isinstance(exc, FileNotFoundError) else 126
    lost: list[str] = []
    heartbeat = Heartbeat(lease_obj, connection, lambda _lease, reason: lost.append(reason))
    heartbeat.start()
    stopped_at = 0.0
    try:
        while child.poll() is None:
            info = signal.sigtimedwait(_WAITED, 0.2)
            if info is not None and info.si_signo != signal.SIGCHLD:
                # Ctrl-C from the terminal already reached the child (same process group).
                from_terminal = info.si_signo == signal.SIGINT and info.si_code == _SI_KERNEL
                if not from_terminal:
                    child.send_signal(info.si_signo)
            if lost and not stopped_at:
                lease_obj.mark_lost(lost[0])
                _say(False, f"lease {lease_obj.id} ended: {lost[0]}; stopping the command")
                _signal_tree(child.pid, signal.SIGTERM)
                stopped_at = time.monotonic()
            elif stopped_at and time.monotonic() - stopped_at > LOST_GRACE_S:
                _signal_tree(child.pid, signal.SIGKILL)
    finally:
        heartbeat.stop()
    code = child.returncode
    return 128 - code if code < 0 else code


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children of children...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_tree(pid: int, sig: int) -> None:
    """Signal the command and everything it started: a shell wrapper must not leave its
    children computing on a device the lease no longer holds."""
    for target in [pid, *_descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


def _release(connection: BrokerConnection, lease_obj: Lease, quiet: bool) -> None:
    if lease_obj.ended:
        return
    try:
        connection.call("Release", pb.ReleaseRequest(lease_id=lease_obj.id), timeout=10, retry_unavailable_s=5)
        _say(quiet, f"lease {lease_obj.id} released")
    except grpc.RpcError as exc:
        if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
            _say(False, f"could not release lease {lease_obj.id} ({exc.details()}); the broker reclaims it "
                 "when we exit")
    except BrokerUnavailable as exc:
        _say(False, f"could not release lease {lease_obj.id} ({exc}); the broker reclaims it when we exit")

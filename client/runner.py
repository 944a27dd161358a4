"""`vaccel run`: lease devices, run a command with them, release when it ends.

- The command's exit status becomes ours (128+N when a signal N killed it).
- Signals sent to `vaccel run` are forwarded; a Ctrl-C from the terminal already
  reaches the whole foreground process group, so it is not sent twice.
- If `vaccel run` dies, even by SIGKILL, the kernel kills the command (PR_SET_PDEATHSIG)
  and the broker ends the lease (it watches our pid).
- If the lease ends behind our back (revoked, expired), the command gets SIGTERM, then
  SIGKILL after a grace period: it must not keep computing on someone else's device.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from vaccel.backends import DEVICE_ENV_VARS
from vaccel.connection import BrokerConnection, BrokerUnavailable
from vaccel.leasing import Lease, _Heartbeat, acquire_lease
from vaccel.v1 import broker_pb2 as pb

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_WAITED = {*FORWARDED, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent (the terminal's Ctrl-C)
LOST_GRACE_S = 10.0


def _child_setup(parent_pid: int) -> None:
    """Runs in the child between fork and exec: die with the parent, take signals again."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
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
    last = [""]

    def on_queue(message: str) -> None:
        if message != last[0]:
            last[0] = message
            _say(quiet, message)

    granted = acquire_lease(connection, request, on_queue)
    lease_obj = Lease(granted, joined=False, connection=connection)
    names = ", ".join(f"gpu{d.index} {d.name}" for d in lease_obj.devices)
    _say(quiet, f"lease {lease_obj.id}: {names}" + (" (simulated)" if lease_obj.simulated else ""))
    for warning in lease_obj.warnings:
        _say(quiet, f"warning: {warning}")
    try:
        return _supervise(command, lease_obj, connection, child_env(lease_obj, getattr(files, "config_path", None)), quiet)
    finally:
        _release(connection, lease_obj, quiet)
        connection.close()


def _supervise(command: list[str], lease_obj: Lease, connection: BrokerConnection,
               env: dict[str, str], quiet: bool) -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    try:
        parent = os.getpid()
        try:
            child = subprocess.Popen(command, env=env, preexec_fn=lambda: _child_setup(parent))
        except OSError as exc:
            _say(False, f"cannot run {command[0]}: {exc.strerror}")
            return 127 if isinstance(exc, FileNotFoundError) else 126
        lost: list[str] = []
        heartbeat = _Heartbeat(lease_obj, connection, lambda _lease, reason: lost.append(reason))
        heartbeat.start()
        killed_at = 0.0
        try:
            while True:
                info = signal.sigtimedwait(_WAITED, 0.2)
                if info is not None and info.si_signo != signal.SIGCHLD:
                    from_terminal = info.si_signo == signal.SIGINT and info.si_code == _SI_KERNEL
                    if not from_terminal:
                        child.send_signal(info.si_signo)
                if child.poll() is not None:
                    break
                if lost and not killed_at:
                    lease_obj._lost_reason = lost[0]
                    _say(False, f"lease {lease_obj.id} ended: {lost[0]}; stopping the command")
                    child.terminate()
                    killed_at = time.monotonic()
                elif killed_at and time.monotonic() - killed_at > LOST_GRACE_S:
                    child.kill()
        finally:
            heartbeat.stop()
        code = child.returncode
        return 128 - code if code < 0 else code
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAITED)


def _release(connection: BrokerConnection, lease_obj: Lease, quiet: bool) -> None:
    if lease_obj.ended:
        return
    try:
        connection.call("Release", pb.ReleaseRequest(lease_id=lease_obj.id), timeout=10, retry_unavailable_s=5)
        _say(quiet, f"lease {lease_obj.id} released")
    except (grpc.RpcError, BrokerUnavailable) as exc:
        _say(False, f"could not release lease {lease_obj.id} ({exc}); the broker reclaims it when we exit")

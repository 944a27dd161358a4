"""`vaccel run -- docker run ...` once the lease is granted: run the engine's command with the
lease applied (container_argv.py), and name the container to the broker so that the lease
follows it (the AttachContainer call; the broker confirms the container with its engine or the
kernel, never on our word).

- In the foreground, a thread waits for the id the engine writes to the --cidfile when it
  creates the container, and names it. From then on the container's exit ends the lease, and
  any end of the lease (release, revoke, time limit, idle reclaim, this process killed, even
  by SIGKILL) makes the broker stop the container. A container the broker cannot confirm (no
  engine configured for it) still runs, with a warning: it is then stopped only through its
  engine's client, which passes our signals on.
- With -d (`docker run -d`), the engine's client returns once the container runs; the broker
  then makes the container the lease's holder, and this process hands the lease over: it
  neither beats nor releases it. The lease ends when the container stops, at its time limit,
  or with `vaccel release LEASE`, which stops the container.
- Rootless podman has no engine the broker may ask: the container's init pid, which the
  user's own podman reports, is named instead, and the kernel confirms it is the init of a
  pid namespace of the user's own processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from vaccel.containers import argv as container_argv
from vaccel.containers.engine_command import ContainerRefused, ContainerRun
from vaccel.session.grpc_lazy import SideRefusal, grpc
from vaccel.session.lease import Lease, LeaseError
from vaccel_common.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    from vaccel.session.lease_session import LeaseSession

# Runs the engine's command under the lease and returns its exit status (runner._supervise).
Supervise = Callable[[list[str]], int]
CREATE_WAIT_S = 3600.0  # pulling a large image comes before the create: wait as long as the client runs
INIT_WAIT_S = 30.0
SETTLE_S = 2.0  # a container its engine's client reports ended within this is not warned about


def run_container(run: ContainerRun, session: LeaseSession, lease: Lease, socket: str, warn_signal: int | None,
                  supervise: Supervise) -> int:
    """Run the container on the lease and make the lease follow it; its exit status."""
    if run.detached and lease.joined:
        raise ContainerRefused(f"{run.engine} run -d with --lease: a detached container would hold your "
                               "reservation alone; run it in the foreground, or without --lease")
    with _private_folder() as folder:
        command, cidfile = container_argv.for_lease(run, lease, socket, folder)
        if run.detached:
            code = supervise(command)
            return code if code != 0 else _hand_over(run, session, lease, cidfile, warn_signal)
        if lease.joined:  # inside a reservation the user holds: the container's exit must not end it
            return supervise(command)
        namer = _Namer(run, session, lease, cidfile, warn_signal)
        namer.start()
        try:
            code = supervise(command)
        finally:
            namer.stop()
        # Detached from (Ctrl-P Ctrl-Q, read from stdin): the container runs on and holds the lease.
        if code == 0 and run.stdin_attached and _running(run, container_argv.read_id(cidfile)):
            return _hand_over(run, session, lease, cidfile, warn_signal, "detached: ")
        return code


@contextmanager
def _private_folder() -> Iterator[str]:
    folder = container_argv.private_folder()
    try:
        yield folder
    finally:
        container_argv.remove_folder(folder)


def _running(run: ContainerRun, container: str) -> bool:
    """Whether the container still runs, as its engine's client says (after the client returned)."""
    if not container:
        return False
    shown = subprocess.run([run.program, *run.global_words, "inspect", "--format", "{{.State.Running}}", container],
                           capture_output=True, text=True, timeout=30, check=False)
    return shown.stdout.strip() == "true"


def _hand_over(run: ContainerRun, session: LeaseSession, lease: Lease, cidfile: str, warn_signal: int | None,
               how: str = "") -> int:
    """A detached container runs: make it the lease's holder, or remove it and say why."""
    container = container_argv.read_id(cidfile)
    try:
        held = _attach(run, session, lease, container, warn_signal, held=True, wait_s=INIT_WAIT_S)
    except LeaseError as exc:
        if container:
            subprocess.run([run.program, *run.global_words, "rm", "--force", container], capture_output=True,
                           timeout=60, check=False)
        raise LeaseError(f"container {container[:12]} removed: {exc}") from None
    session.hand_over()
    shown = held.holder.container.name or container[:12]
    print(f"vaccel: {how}lease {lease.id} is held by container {shown} ({container[:12]}) until it stops, its time "
          f"limit, or `vaccel release {lease.id}`", file=sys.stderr, flush=True)
    return 0


class _Namer(threading.Thread):
    """Names the foreground container to the broker as soon as its engine has created it."""

    def __init__(self, run: ContainerRun, session: LeaseSession, lease: Lease, cidfile: str,
                 warn_signal: int | None) -> None:
        super().__init__(name=f"vaccel-container-{lease.id}", daemon=True)
        self.container_run, self.session, self.lease = run, session, lease
        self.cidfile, self.warn_signal = cidfile, warn_signal
        self._done = threading.Event()

    def run(self) -> None:
        container = container_argv.wait_for_id(self.cidfile, self._done, CREATE_WAIT_S)
        if not container:
            return
        try:
            _attach(self.container_run, self.session, self.lease, container, self.warn_signal, held=False,
                    stop=self._done)
        except LeaseError as exc:
            # A container that has exited already (a short command; not_found, or one --rm
            # removed, whose engine's client then ends at once) leaves nothing to follow.
            if exc.code != "not_found" and not self._done.wait(SETTLE_S):
                engine = self.container_run.engine
                print(f"vaccel: warning: {exc}; the container is stopped only through {engine} if vaccel run "
                      "is killed", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self._done.set()


def _attach(run: ContainerRun, session: LeaseSession, lease: Lease, container: str, warn_signal: int | None, *,
            held: bool, wait_s: float = INIT_WAIT_S, stop: threading.Event | None = None) -> pb.Lease:
    """AttachContainer; LeaseError saying why the broker did not apply the lease to it."""
    init_pid = 0
    if run.engine == "podman" and os.geteuid() != 0:  # rootless: no engine the broker may ask
        init_pid = _init_pid(run, container, wait_s, stop)
        if not init_pid:
            raise LeaseError(f"lease {lease.id} does not follow container {container[:12]}: podman did not report "
                             "its init's pid")
    names = run.values("--name")
    request = pb.AttachContainerRequest(lease_id=lease.id, container_id=container, init_pid=init_pid, held=held,
                                        warn_signal=warn_signal or 0, name=names[-1] if names else "",
                                        image=run.image)
    try:
        return session.connection.call("AttachContainer", request, timeout=60, retry_unavailable_s=5,
                                       plain_refusal=True)
    except SideRefusal as exc:  # a short container has often exited already: told so without importing grpc
        raise LeaseError(f"lease {lease.id} does not follow container {container[:12]}: {exc.details}",
                         exc.code) from None
    except grpc.RpcError as exc:
        raise LeaseError(f"lease {lease.id} does not follow container {container[:12]}: {exc.details()}",
                         exc.code().name.lower()) from None
    except Exception as exc:  # the broker out of reach (BrokerUnavailable)
        raise LeaseError(f"lease {lease.id} does not follow container {container[:12]}: {exc}") from None


def _init_pid(run: ContainerRun, container: str, wait_s: float, stop: threading.Event | None) -> int:
    """The container init's host pid, as the user's own engine reports it (0 until it starts)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        done = subprocess.run([run.program, *run.global_words, "inspect", "--format", "{{.State.Pid}}", container],
                              capture_output=True, text=True, timeout=30, check=False)
        pid = done.stdout.strip()
        if done.returncode == 0 and pid.isdigit() and int(pid) > 0:
            return int(pid)
        time.sleep(0.05)
    return 0

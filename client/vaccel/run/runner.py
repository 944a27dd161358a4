"""`vaccel run`: lease devices, run a command with them, release when it ends.

- The command's exit status becomes ours (128+N when a signal N killed it).
- Signals sent to `vaccel run` are forwarded; a Ctrl-C from the terminal already
  reaches the whole foreground process group, so it is not sent twice.
- Ctrl-Z and `fg` (SIGTSTP, SIGCONT) stop and resume the command with us: a SIGTSTP sent
  to `vaccel run` alone is passed on to the command before we stop ourselves, and a
  SIGCONT resumes a command that is still stopped.
- If `vaccel run` dies, even by SIGKILL, the kernel kills the command (PR_SET_PDEATHSIG)
  and the broker ends the lease (it watches our pid). Processes the command left running
  in the background are not killed then; on real GPUs the broker sees them as GPU users
  without a lease and keeps their device out of the pool until they are gone.
- If the lease ends behind our back (revoked, expired), the command gets SIGTERM, then
  SIGKILL after a grace period: it must not keep computing on someone else's device.
- Before a time limit (or an admin's revoke with grace) ends the lease, the processes of
  the command that handle the warning signal (SIGUSR1 unless --signal says otherwise) get
  it, so they can checkpoint; at the end itself SIGTERM, then SIGKILL after the grace.
- `--lease ID` runs the command inside an existing lease of the caller (a reservation):
  it joins it instead of asking for devices, and leaves it held afterwards. So does a
  `vaccel run` started inside a lease (VACCEL_LEASE_ID: `vaccel shell`) that asks for no
  more than the lease holds; one asking for more is refused at once (vaccel/session/inside.py).
- When the lease's time limit stops the command, the exit status is 124 (timeout(1)'s), so
  a script can tell it from the command's own failure, as Slurm's TIMEOUT state does.

The main thread never polls. It sleeps in `sigwaitinfo` on the signals it handles, all
blocked in every thread, and whatever it must react to arrives as one of them: a signal
for the command, the command's exit (SIGCHLD), and, sent by our own threads as a SIGCHLD
to this thread, the grant (or refusal), the loss of the lease, the end of its grace.
`sigwaitinfo` rather than `sigtimedwait`: with a timeout, Python 3.11 returns an
uninitialised siginfo when a stop (Ctrl-Z) interrupts the wait past its deadline.

The lease's life itself (request, queue, heartbeat, release) is LeaseSession's
(session.py); this module adds the signals, the child and its process tree.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from vaccel.run import process_tree
from vaccel.session.inside import part_asked
from vaccel.session.lease import Lease, LeaseEnding
from vaccel.session.lease_session import LeaseSession
from vaccel.session.outcome import EXIT_TIME_LIMIT, queue_printer
from vaccel.session.request import LeaseRequest, time_limit_s
from vaccel_common.backends import DEVICE_ENV_VARS
from vaccel_common.grant_text import grant_lines
from vaccel_common.text import argv_text
from vaccel_common.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    from vaccel.containers.engine_command import ContainerRun
    from vaccel.run.forked import Forked

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_LEAVE_QUEUE = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
_JOB_CONTROL = (signal.SIGTSTP, signal.SIGCONT)
_WAKE = signal.SIGCHLD  # what the kernel sends when the command ends, and our threads send to wake us
_WAITED = frozenset({*FORWARDED, *_JOB_CONTROL, _WAKE})
_PR_SET_PDEATHSIG = 1
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent (the terminal's Ctrl-C, Ctrl-Z)
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


def child_env(lease_obj: Lease, config_path: str | None) -> dict[str, str]:
    """Our environment with only the lease's devices visible (and its accelerator config)."""
    env = {k: v for k, v in os.environ.items() if k not in DEVICE_ENV_VARS}
    env.update(lease_obj.env)
    if config_path is not None:
        env["VACCEL_ACCELERATOR_CONFIG"] = str(config_path)
    return env


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"vaccel: {message}", file=sys.stderr, flush=True)


class _Waker:
    """Wakes the thread waiting in `next_signal` from any other thread: a SIGCHLD sent to
    that thread alone (blocked there, so it waits as pending until taken). A spurious
    SIGCHLD only makes the waiter look at its state once more."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._lock = threading.Lock()
        self._active = True

    def __call__(self, *_: object) -> None:
        with self._lock:
            if self._active:
                signal.pthread_kill(self._thread, _WAKE)

    def close(self) -> None:
        with self._lock:
            self._active = False


def next_signal() -> tuple[int, int]:
    """(signal number, si_code) of the next signal in _WAITED; blocks until there is one.
    A number outside the set (never seen with sigwaitinfo, but cheap to refuse) is
    dropped rather than acted on."""
    while True:
        info = signal.sigwaitinfo(_WAITED)
        if info.si_signo in _WAITED:
            return info.si_signo, info.si_code


def _drain_wakes() -> None:
    """Take pending SIGCHLD/SIGTSTP/SIGCONT before unblocking, so that neither a late wake
    nor a Ctrl-Z that came after the command ended acts on us then."""
    pending = signal.sigpending()
    for sig in (_WAKE, *_JOB_CONTROL):
        if sig in pending:
            signal.sigtimedwait([sig], 0)  # pending: returns at once (result not used)


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
    time_limit: str | None = None,
    devices: tuple[str, ...] = (),
    lease_id: str = "",
    warn_signal: int | None = signal.SIGUSR1,
    container: ContainerRun | None = None,
    count_given: bool = True,
    memory_mib: int = 0,
) -> int:
    """Lease (or join `lease_id`, or the lease this process runs inside), run `command` on
    the lease, release; return the command's exit status. Raises LeaseError,
    ContractFileError, Interrupted (a signal while queued), or ContainerRefused.
    `container`: the command read as a container engine's run (vaccel/containers/engine_command.py), to
    which the lease is applied. `count_given`: --gpus or --device said how many devices
    (else, inside a lease, the command gets all of it)."""
    # Block the signals we handle before any thread exists (gRPC starts some), so every
    # thread inherits the mask and only this thread's sigwaitinfo ever takes them.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    wake = _Waker()
    try:
        # Inside a Slurm job the job's allocation is the lease, inside a container given GPUs and
        # no broker the GPUs it was given: no broker is asked.
        from vaccel.containers import job as container_job
        from vaccel.slurm import job as slurm_job

        job = None if lease_id else (
            slurm_job.lease_for(gpus, contract=contract, config=config, socket=socket, in_process=False)
            or container_job.lease_for(gpus, contract=contract, config=config, socket=socket, in_process=False))
        if job is not None:
            source = "this container's GPUs" if job.id.startswith(container_job.PREFIX) else "Slurm job"
            if container is not None:
                from vaccel.containers.engine_command import ContainerRefused

                raise ContainerRefused(f"{container.engine} run inside a {source}: its GPUs are not given to "
                                       "containers by vaccel; run the engine without vaccel run")
            _announce(False, job, f" ({source})")
            return _supervise(command, slurm_job.NoSession(), job, child_env(job, None), wake)  # type: ignore[arg-type]
        request = LeaseRequest(gpus=gpus, min_memory_mib=min_memory_mib, wait=wait, contract=contract, config=config,
                               command=" ".join(map(argv_text, command)), time=time_limit, devices=devices,
                               memory_mib=memory_mib, argv=tuple(command))
        inside = "" if lease_id else os.environ.get("VACCEL_LEASE_ID", "")
        ending = _Ending(wake, warn_signal)
        with _session(socket, quiet, wake, ending) as session:
            if lease_id:
                lease_obj = session.join(lease_id, source="--lease")
            elif inside:
                lease_obj = session.join(inside, part=lambda held: part_asked(
                    held, gpus=gpus, whole=not count_given, devices=devices, min_memory_mib=min_memory_mib,
                    time_limit_s=time_limit_s(time_limit)))
            else:
                lease_obj = _acquire_interruptibly(session, request, wake)
            _announce(False, lease_obj, " (joined: this runs inside it)" if lease_obj.joined else "")
            try:
                if container is not None:
                    return _supervise_container(container, session, lease_obj, socket, wake, ending)
                return _supervise(command, session, lease_obj, child_env(lease_obj, session.config_path), wake,
                                  ending)
            finally:
                _give_back(session, lease_obj, quiet)
    finally:
        _stop_waking(wake)


def _session(socket: str | None, quiet: bool, wake: _Waker, ending: _Ending) -> LeaseSession:
    """The session as `vaccel run` keeps a lease: queue lines once each, a loss or the
    lease's coming end wakes the main thread, the contract files read said."""
    return LeaseSession(socket, on_queue=queue_printer(quiet), on_lost=wake, say=lambda m: _say(False, m),
                        on_ending=ending, on_contract=lambda line: _say(quiet, line))


def _give_back(session: LeaseSession, lease_obj: Lease, quiet: bool) -> None:
    if session.release():
        _say(quiet, f"lease {lease_obj.id} released")


def _stop_waking(wake: _Waker) -> None:
    """Undo what a run set up for its signals: the waker, pending wakes, the blocked mask."""
    wake.close()
    _drain_wakes()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAITED)


def _supervise_container(container: ContainerRun, session: LeaseSession, lease_obj: Lease, socket: str | None,
                         wake: _Waker, ending: _Ending) -> int:
    """Run a container engine's `run` with the lease applied to the container, which the lease
    then follows (vaccel/containers/hold.py; imported here: a plain `vaccel run` does not pay for it)."""
    from vaccel.containers.start import run_or_start as run_container  # `docker start NAME` too
    from vaccel_common.paths import client_socket

    # The engine's client catches every signal and passes it on to the container, whose command
    # may not handle the warning signal and would die of it: the broker sends it to the container's
    # processes that catch it, and here the coming end is only printed.
    warn_signal, ending.warn_signal = ending.warn_signal, None
    env = child_env(lease_obj, session.config_path)
    return run_container(container, session, lease_obj, client_socket(socket), warn_signal,
                         lambda command: _supervise(command, session, lease_obj, env, wake, ending))


def _announce(quiet: bool, lease_obj: Lease, source: str = "") -> None:
    for line in grant_lines(lease_obj.id, [(d.label, d.name) for d in lease_obj.devices], lease_obj.simulated,
                            lease_obj.warnings, source, lease_obj.share_mib):
        _say(quiet, line)


class _Ending:
    """The lease's coming end as the heartbeat thread heard of it (session.py calls this
    with a LeaseEnding); the main thread acts on it when woken."""

    def __init__(self, wake: _Waker, warn_signal: int | None) -> None:
        self.wake = wake
        self.warn_signal = warn_signal
        self.heard: LeaseEnding | None = None
        self.acted_on: LeaseEnding | None = None
        self.called_off = False  # the end heard of was called off (idle reclaim), said once
        self._timer: threading.Timer | None = None

    def __call__(self, notice: LeaseEnding) -> None:
        self.heard = notice
        self.called_off = False
        self.wake()
        if self._timer is not None:
            self._timer.cancel()
        # Wake again at the end itself, to stop the command on time.
        self._timer = threading.Timer(max(0.0, notice.ends_at - time.time()), self.wake)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class Interrupted(Exception):
    """A signal arrived while we waited in the queue; the request was withdrawn."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} while waiting; left the queue")
        self.exit_code = 128 + signum


def _stop_self() -> None:
    """Stop as SIGTSTP's default action would (the shell then sees the job stopped);
    returns once someone sends SIGCONT."""
    os.kill(os.getpid(), signal.SIGSTOP)


def _acquire_interruptibly(session: LeaseSession, request: LeaseRequest, wake: _Waker) -> Lease:
    """Wait for the grant on a worker thread while this thread waits for signals; the
    worker wakes us the moment the stream ends."""
    pending = session.acquire_in_background(request, on_done=wake)
    while not pending.wait(0):
        signo, _ = next_signal()
        if signo in _LEAVE_QUEUE:
            pending.cancel()
            raise Interrupted(signo)
        if signo == signal.SIGTSTP:
            _stop_self()
    return pending.result()


def _supervise(command: list[str], session: LeaseSession, lease_obj: Lease, env: dict[str, str],
               wake: _Waker, ending: _Ending | None = None) -> int:
    """Run the command, forward signals, stop it if the lease ends; return its status."""
    parent = os.getpid()
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=lambda: _child_setup(parent))
    except OSError as exc:
        _say(False, f"cannot run {command[0]}: {exc.strerror}")
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return _watch(child, session, lease_obj, wake, ending)


def continue_run(child: Forked, granted: bytes, *, socket: str | None, quiet: bool,
                 warn_signal: int | None = signal.SIGUSR1) -> int:
    """The rest of a `vaccel run` that vaccel/run/quick_run.py began and outlived its quick
    path: the lease granted (`granted`: the AcquireUpdate), its lines said, the command
    running as `child`, the signals of _WAITED blocked. From here as run_under_lease goes
    on: heartbeat, signals, the lease's end, release."""
    wake = _Waker()
    try:
        ending = _Ending(wake, warn_signal)
        with _session(socket, quiet, wake, ending) as session:
            lease_obj = session.adopt(pb.AcquireUpdate.FromString(granted).granted, joined=False)
            try:
                return _watch(child, session, lease_obj, wake, ending)
            finally:
                _give_back(session, lease_obj, quiet)
    finally:
        _stop_waking(wake)


def _watch(child: subprocess.Popen[bytes] | Forked, session: LeaseSession, lease_obj: Lease, wake: _Waker,
           ending: _Ending | None = None) -> int:
    """Keep the lease while the command runs: forward signals, stop it if the lease ends;
    return its status."""
    session.start_heartbeat()
    stopped_at = 0.0
    out_of_time = False  # the command was stopped because the lease's time was up
    grace: threading.Timer | None = None
    try:
        while child.poll() is None:
            heard = ending.heard if ending is not None else None
            if heard is not None and heard is not ending.acted_on and not stopped_at:
                ending.acted_on = heard
                _say(False, f"{heard}{process_tree.warn(child.pid, ending.warn_signal)}")
            # The heartbeat keeps expires_at current: an idle reclaim called off moves it back.
            over = heard is not None and bool(lease_obj.expires_at) and time.time() >= lease_obj.expires_at
            if heard is not None and lease_obj.expires_at > heard.ends_at + 1 and not ending.called_off:
                ending.called_off = True
                _say(False, f"lease {lease_obj.id}: {lease_obj.notice or 'the early end was called off'}; it now "
                            f"ends at {time.strftime('%a %H:%M', time.localtime(lease_obj.expires_at))}")
            if over and not lease_obj.lost_reason:
                # Its end is the broker's to record (time_limit, revoked): no release.
                lease_obj.mark_lost(lease_obj.notice or heard.reason)
            if lease_obj.lost_reason and not stopped_at:
                out_of_time = _out_of_time(lease_obj)
                _say(False, f"lease {lease_obj.id} ended: {lease_obj.lost_reason}; stopping the command"
                            + (f" (exit status {EXIT_TIME_LIMIT}: time limit)" if out_of_time else ""))
                process_tree.signal_tree(child.pid, signal.SIGTERM)
                stopped_at = time.monotonic()
                grace = threading.Timer(LOST_GRACE_S, wake)
                grace.daemon = True
                grace.start()
            elif stopped_at and time.monotonic() - stopped_at >= LOST_GRACE_S:
                process_tree.signal_tree(child.pid, signal.SIGKILL)
            signo, code = next_signal()
            if signo == _WAKE:
                continue
            # From the terminal (Ctrl-C, Ctrl-Z) it already reached the child: same process group.
            from_terminal = code == _SI_KERNEL and signo in (signal.SIGINT, signal.SIGTSTP)
            if signo == signal.SIGTSTP:
                if not from_terminal:
                    child.send_signal(signal.SIGTSTP)
                _stop_self()
            elif signo == signal.SIGCONT:
                if process_tree.is_stopped(child.pid):
                    child.send_signal(signal.SIGCONT)
            elif not from_terminal:
                child.send_signal(signo)
    finally:
        if grace is not None:
            grace.cancel()
        if ending is not None:
            ending.close()
    code = child.returncode
    if out_of_time:
        return EXIT_TIME_LIMIT
    return 128 - code if code < 0 else code


def _out_of_time(lease_obj: Lease) -> bool:
    """Whether a lease that ended behind our back reached its end (its time limit, or the
    broker's maximum duration) rather than being revoked (a notice says so) or lost."""
    return bool(lease_obj.expires_at) and not lease_obj.notice and time.time() >= lease_obj.expires_at - 1.0

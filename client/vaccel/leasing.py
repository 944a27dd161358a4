"""`vaccel.lease()`: an exclusive device lease as a context manager or decorator.

    with vaccel.lease(gpus=2, min_memory="20GiB") as l:
        print(l.id, l.backend, l.devices, l.env)
        train(l.accelerator)

The environment (visible devices, allocator settings) is applied before any device
runtime starts; a heartbeat thread keeps the lease alive; the lease is released on
normal exit, on exception, and on SIGTERM/SIGINT. If the lease ends behind our back
(revoked, expired, the broker forgot it) the main thread is told: LeaseLost is raised
in it (or the `on_lost` callback runs instead), and every later lease or accelerator
call raises LeaseLost too. A process started inside a lease (VACCEL_LEASE_ID in its
environment: torchrun ranks, `vaccel run` children) joins that lease instead of queueing.

The lease's life itself (request, queue, heartbeat, release) is LeaseSession's
(session.py); this module adds what only an in-process lease needs: the environment of
this process, forked children, SIGTERM, and LeaseLost in the thread that entered.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

from vaccel.session.lease import DeviceInfo, Lease, LeaseEnding, LeaseError, LeaseLost
from vaccel.session.lease_session import LeaseRequest, LeaseSession
from vaccel_common.backends import DEVICE_ENV_VARS
from vaccel_common.units import parse_size_mib

__all__ = ["DeviceInfo", "Lease", "LeaseError", "LeaseLost", "lease"]

# Leases entered in this process, by id. A forked child inherits this table, which is how
# lease() in a fork finds the parent's lease without talking to the broker.
_ENTERED: dict[str, tuple[int, Lease]] = {}


def _raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type))


def _print_queue(message: str) -> None:
    print(f"vaccel: {message}", file=sys.stderr, flush=True)


def _print_ending(ending: LeaseEnding) -> None:
    print(f"vaccel: {ending}; save your work (lease(on_ending=...) is called here)", file=sys.stderr, flush=True)


class lease:
    """Hold `gpus` devices exclusively for the duration of a `with` block or a call.

    Args:
        gpus: how many devices, all granted at once or not at all.
        min_memory: per-device memory, e.g. "20GiB" (int = bytes).
        contract: runtime-spec.yaml path (default: ./runtime-spec.yaml if present).
        config: accelerator-config.yaml path (default: ./accelerator-config.yaml if present).
        wait: True waits in the queue, False fails at once when busy, a number or "2h" gives up after that.
        socket: the broker's socket (default: VACCEL_SOCKET, then the standard places).
        on_lost: called (lease, reason) from the heartbeat thread when the lease ends behind
            our back; when None, LeaseLost is raised in the thread that entered the lease.
        on_queue: called with the queue message while waiting (default: print to stderr).
        time: the lease's time limit, e.g. "2h" (default: the broker's policy). A short
            limit can start sooner (backfill: docs/policy.md).
        devices: only these devices, e.g. ["gpu1"] or uuids (gpus defaults to their number).
        on_ending: called with a LeaseEnding (lease_id, ends_at, seconds_left, reason) from
            the heartbeat thread when the lease will end soon (its time limit is near, an
            admin revoked it with a grace, idle reclaim, a memory share over its budget):
            checkpoint there. Default: a line on stderr.
        memory: a memory share of one shared GPU instead of a whole one, e.g. "20GiB"
            (int = bytes; docs/sharing.md): the accelerator caps torch's allocator to it,
            and the broker ends a share that keeps using more.
        import_torch: False sends no torch facts when there is no contract instead of
            importing torch to gather them (its import costs 1-2 s before the request;
            without a contract the broker would only warn about them). With a contract
            torch is always inspected.
    """

    def __init__(
        self,
        gpus: int = 1,
        *,
        min_memory: str | int | None = None,
        contract: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | None = None,
        wait: bool | float | str = True,
        socket: str | os.PathLike[str] | None = None,
        on_lost: Callable[[Lease, str], None] | None = None,
        on_queue: Callable[[str], None] | None = _print_queue,
        command: str = "",
        time: float | str | None = None,
        devices: Sequence[str] | None = None,
        on_ending: Callable[[LeaseEnding], None] | None = None,
        memory: str | int | None = None,
        import_torch: bool = True,
    ) -> None:
        # Built (and checked) here so a bad argument fails at decoration time, not at the call.
        named = tuple(devices or ())
        if named and gpus == 1:
            gpus = len(named)
        self.request = LeaseRequest(
            gpus=gpus,
            min_memory_mib=parse_size_mib(min_memory) if min_memory is not None else 0,
            wait=wait, contract=contract, config=config,
            command=command or " ".join(sys.argv), in_process=True, time=time, devices=named,
            memory_mib=parse_size_mib(memory) if memory is not None else 0,
            import_torch=import_torch,
        )
        self.on_ending = on_ending or _print_ending
        self.socket = socket
        self.on_lost = on_lost
        self.on_queue = on_queue
        self._lease: Lease | None = None
        self._session: LeaseSession | None = None
        self._saved_env: dict[str, str | None] = {}
        self._saved_handlers: dict[int, Any] = {}
        self._owner_thread = 0

    # -- decorator ---------------------------------------------------------------------

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._copy():
                return fn(*args, **kwargs)

        return wrapper

    def _copy(self) -> lease:
        # Each call holds its own lease, so a decorated function may run in many threads.
        clone = object.__new__(lease)
        clone.__dict__.update(self.__dict__)
        clone._lease = clone._session = None
        clone._saved_env, clone._saved_handlers = {}, {}
        return clone

    # -- context manager ---------------------------------------------------------------

    def __enter__(self) -> Lease:
        from vaccel.accelerator.runtime_state import initialised_runtime

        running = initialised_runtime()
        if running:
            raise LeaseError(
                f"{running} was already initialised in this process before the lease, so it may "
                "be using the wrong device; create the lease before any device call "
                "(e.g. at the top of the script) or run the script with `vaccel run`"
            )
        # Inside a Slurm job the job's allocation is the lease, inside a container given GPUs and
        # no broker the GPUs it was given.
        from vaccel.containers import job as container_job
        from vaccel.slurm import job as slurm_job

        asked = dict(contract=self.request.contract, config=self.request.config, socket=self.socket, in_process=True)
        job = (slurm_job.lease_for(self.request.gpus, **asked)  # type: ignore[arg-type]
               or container_job.lease_for(self.request.gpus, **asked))  # type: ignore[arg-type]
        if job is not None:
            return self._enter_job(job)
        inherited = os.environ.get("VACCEL_LEASE_ID")
        parent = _ENTERED.get(inherited or "")
        if parent is not None and parent[0] != os.getpid():
            # A forked child of the holder (DataLoader worker, multiprocessing fork): it is
            # inside the parent's lease already, and the parent keeps heartbeating it.
            self._lease = parent[1].forked_view()
            return self._lease
        self._owner_thread = threading.get_ident()
        # The contract files read are said where the queue is (on stderr, unless on_queue=None silences both).
        session = LeaseSession(self.socket, on_queue=self.on_queue, on_lost=self._lost, on_ending=self.on_ending,
                               on_contract=_print_queue if self.on_queue is not None else None)
        try:
            held = session.join(inherited, self.request.gpus) if inherited else session.acquire(self.request)
        except BaseException:
            session.close()
            raise
        self._session, self._lease = session, held
        self._apply_env(held.env, session.config_path)
        session.start_heartbeat()
        self._install_signal_handlers()
        _ENTERED[held.id] = (os.getpid(), held)
        for warning in held.warnings:
            print(f"vaccel: warning: {warning}", file=sys.stderr)
        return held

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        session = self._session
        if session is None:  # a forked child's view (the parent owns the lease) or a Slurm job's
            if self._lease is not None and _ENTERED.get(self._lease.id, (0, None))[1] is self._lease:
                del _ENTERED[self._lease.id]
                self._restore_env()
            return
        if self._lease is not None and _ENTERED.get(self._lease.id, (0, None))[1] is self._lease:
            del _ENTERED[self._lease.id]
        self._restore_signal_handlers()
        try:
            session.release()
        finally:
            self._restore_env()
            session.close()
            self._session = None

    # -- internals ---------------------------------------------------------------------

    def _enter_job(self, job: Lease) -> Lease:
        """Slurm holds the job's devices: nothing to heartbeat, release or watch for here."""
        self._lease = job
        self._apply_env(job.env, None)
        _ENTERED[job.id] = (os.getpid(), job)
        for warning in job.warnings:
            print(f"vaccel: warning: {warning}", file=sys.stderr)
        return job

    def _lost(self, lost: Lease, reason: str) -> None:
        # Runs on the heartbeat thread; the session has already marked the lease lost.
        if self.on_lost is not None:
            self.on_lost(lost, reason)
            return
        message = f"lease {lost.id} ended: {reason}; stop using its devices"
        exc_type = type("LeaseLost", (LeaseLost,), {"__init__": lambda s: LeaseLost.__init__(s, message)})
        _raise_in_thread(self._owner_thread, exc_type)

    def _apply_env(self, env: dict[str, str], config_path: str | None) -> None:
        # Clear what another backend may have left so only this lease's devices are visible.
        for key in (*DEVICE_ENV_VARS, *env):
            if key not in self._saved_env:
                self._saved_env[key] = os.environ.get(key)
        for key in DEVICE_ENV_VARS:
            os.environ.pop(key, None)
        os.environ.update(env)
        if config_path is not None:
            self._saved_env.setdefault("VACCEL_ACCELERATOR_CONFIG", os.environ.get("VACCEL_ACCELERATOR_CONFIG"))
            os.environ["VACCEL_ACCELERATOR_CONFIG"] = str(config_path)

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

    def _install_signal_handlers(self) -> None:
        """SIGTERM becomes SystemExit so `with` blocks unwind and the lease is released.
        (SIGINT already raises KeyboardInterrupt.) Only from the main thread, only over the
        default handler: a handler the program installed itself is left alone."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._saved_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, _exit_on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        self._saved_handlers = {}


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)

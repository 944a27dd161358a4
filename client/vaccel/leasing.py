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
"""

from __future__ import annotations

import ctypes
import functools
import os
import random
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import grpc

from vaccel.connection import BrokerConnection, BrokerUnavailable
from vaccel_common.backends import DEVICE_ENV_VARS, lease_env
from vaccel_common.units import parse_duration, parse_size_mib
from vaccel_common.v1 import broker_pb2 as pb


class LeaseError(RuntimeError):
    """The broker refused or could not grant the lease; the message says why and what to do."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class LeaseLost(RuntimeError):
    """The lease ended while the process was still using it; stop using its devices."""


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    memory_mib: int
    vendor: str
    arch: str
    simulated: bool
    visible_id: str

    @classmethod
    def from_pb(cls, d: pb.Device) -> DeviceInfo:
        return cls(d.index, d.uuid, d.name, d.memory_mib, d.vendor, d.arch, d.simulated,
                   d.visible_id or d.uuid)


def error_from_rpc(exc: grpc.RpcError) -> LeaseError:
    return LeaseError(exc.details() or str(exc.code()), exc.code().name.lower())


class Lease:
    """A granted (or joined) lease. Attributes: id, backend, devices, env, accelerator."""

    def __init__(self, msg: pb.Lease, *, joined: bool, connection: BrokerConnection) -> None:
        self.id: str = msg.id
        self.backend: str = msg.backend
        self.devices: list[DeviceInfo] = [DeviceInfo.from_pb(d) for d in msg.devices]
        self.memory_cap_mib: int = msg.memory_cap_mib
        self.simulated: bool = msg.simulated
        self.joined = joined
        self.warnings = [f"{w.name}: {w.message}" for w in msg.warnings]
        self.heartbeat_interval_s: float = msg.heartbeat_interval_s or 5.0
        self.env: dict[str, str] = lease_env(
            lease_id=msg.id,
            backend_name=msg.backend,
            device_ids=[d.visible_id for d in self.devices],
            allocator_config=msg.allocator_config,
            memory_cap_mib=msg.memory_cap_mib,
            simulated=msg.simulated,
        )
        self._connection = connection
        self._lost_reason = ""
        self._released = False
        self._accelerator: Any = None

    @property
    def ended(self) -> bool:
        return bool(self._lost_reason) or self._released

    @property
    def end_reason(self) -> str:
        return self._lost_reason or ("released" if self._released else "")

    def forked_view(self) -> Lease:
        """This lease as seen from a forked child: joined, never released by the child."""
        view = object.__new__(Lease)
        view.__dict__.update(self.__dict__)
        view.joined = True
        view._accelerator = None
        return view

    def mark_lost(self, reason: str) -> None:
        """Record that the broker ended the lease; every later check() raises LeaseLost."""
        self._lost_reason = reason

    def check(self) -> None:
        """Raise LeaseLost when the lease is over: call it before touching the devices."""
        if self._lost_reason:
            raise LeaseLost(f"lease {self.id} ended: {self._lost_reason}; its devices may now "
                            "belong to someone else, stop using them")
        if self._released:
            raise LeaseLost(f"lease {self.id} was released")

    @property
    def accelerator(self) -> Any:
        """The vendor-agnostic torch accelerator for this lease (imports torch)."""
        self.check()
        if self._accelerator is None:
            from vaccel.accelerator import Accelerator

            self._accelerator = Accelerator(env={**os.environ, **self.env}, guard=self.check)
        return self._accelerator

    def __repr__(self) -> str:
        names = ", ".join(d.name for d in self.devices)
        return f"<Lease {self.id} {self.backend} [{names}]{' joined' if self.joined else ''}>"


# Leases entered in this process, by id. A forked child inherits this table, which is how
# lease() in a fork finds the parent's lease without talking to the broker.
_ENTERED: dict[str, tuple[int, Lease]] = {}


class Heartbeat(threading.Thread):
    """Keeps the lease alive; notices when it has ended and tells the main thread."""

    def __init__(self, lease_obj: Lease, connection: BrokerConnection,
                 on_lost: Callable[[Lease, str], None]) -> None:
        super().__init__(name=f"vaccel-heartbeat-{lease_obj.id}", daemon=True)
        self.lease = lease_obj
        self.connection = connection
        self.on_lost = on_lost
        self.stop_event = threading.Event()

    def run(self) -> None:
        interval = self.lease.heartbeat_interval_s
        request = pb.LeaseRef(lease_id=self.lease.id)
        while not self.stop_event.wait(interval * random.uniform(0.8, 1.0)):
            try:
                # A broker restart shows up as UNAVAILABLE for a moment: retry, don't panic.
                self.connection.call("Heartbeat", request, timeout=10, retry_unavailable_s=interval)
            except BrokerUnavailable:
                continue
            except grpc.RpcError as exc:
                code = exc.code()
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.PERMISSION_DENIED):
                    if not self.stop_event.is_set():
                        self.on_lost(self.lease, exc.details() or code.name)
                    return
            except Exception:
                continue

    def stop(self) -> None:
        self.stop_event.set()


def _raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type))


def _wait_fields(wait: bool | float | str) -> tuple[bool, float]:
    """(wait_forever, max_wait_seconds) for the request."""
    if wait is True:
        return True, 0.0
    if wait is False or wait is None:
        return False, 0.0
    seconds = parse_duration(wait)
    return False, seconds


def _print_queue(message: str) -> None:
    print(f"vaccel: {message}", file=sys.stderr, flush=True)


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
    ) -> None:
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
        self.gpus = gpus
        self.min_memory_mib = parse_size_mib(min_memory) if min_memory is not None else 0
        self.contract = contract
        self.config = config
        self.wait_forever, self.max_wait_s = _wait_fields(wait)
        self.socket = socket
        self.on_lost = on_lost
        self.on_queue = on_queue
        self.command = command or " ".join(sys.argv)[:200]
        self._lease: Lease | None = None
        self._connection: BrokerConnection | None = None
        self._heartbeat: Heartbeat | None = None
        self._saved_env: dict[str, str | None] = {}
        self._saved_handlers: dict[int, Any] = {}
        self._owner_thread = 0
        self._config_path: Path | None = None

    # -- decorator ---------------------------------------------------------------------

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._copy():
                return fn(*args, **kwargs)

        return wrapper

    def _copy(self) -> lease:
        clone = object.__new__(lease)
        clone.__dict__.update(self.__dict__)
        clone._lease = clone._connection = clone._heartbeat = None
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
        inherited = os.environ.get("VACCEL_LEASE_ID")
        parent = _ENTERED.get(inherited or "")
        if parent is not None and parent[0] != os.getpid():
            # A forked child of the holder (DataLoader worker, multiprocessing fork): it is
            # inside the parent's lease already, and the parent keeps heartbeating it.
            self._lease = parent[1].forked_view()
            return self._lease
        self._connection = BrokerConnection(self.socket)
        self._owner_thread = threading.get_ident()
        try:
            if inherited:
                msg = self._join(inherited)
                self._lease = Lease(msg, joined=True, connection=self._connection)
            else:
                msg = self._acquire()
                self._lease = Lease(msg, joined=False, connection=self._connection)
        except BaseException:
            self._connection.close()
            raise
        self._apply_env(self._lease.env)
        self._heartbeat = Heartbeat(self._lease, self._connection, self._lost)
        self._heartbeat.start()
        self._install_signal_handlers()
        _ENTERED[self._lease.id] = (os.getpid(), self._lease)
        for warning in self._lease.warnings:
            print(f"vaccel: warning: {warning}", file=sys.stderr)
        return self._lease

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._connection is None:  # a forked child's view: the parent owns the lease
            return
        if self._lease is not None and _ENTERED.get(self._lease.id, (0, None))[1] is self._lease:
            del _ENTERED[self._lease.id]
        self._restore_signal_handlers()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        current = self._lease
        if current is not None and current._accelerator is not None:
            try:
                current._accelerator.close()  # process group down before the devices go back
            except Exception as err:
                print(f"vaccel: closing the accelerator failed ({err}); releasing anyway", file=sys.stderr)
        if current is not None and not current.joined and not current.ended:
            try:
                self._connection.call("Release", pb.ReleaseRequest(lease_id=current.id),  # type: ignore[union-attr]
                                      timeout=10, retry_unavailable_s=5)
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    print(f"vaccel: could not release lease {current.id}: {err.details()}", file=sys.stderr)
                # else it had just ended anyway (expired, revoked): nothing left to give back
            except BrokerUnavailable as err:
                # The broker reclaims it anyway when this process exits.
                print(f"vaccel: could not release lease {current.id}: {err}", file=sys.stderr)
            current._released = True
        self._restore_env()
        if self._connection is not None:
            self._connection.close()

    # -- internals ---------------------------------------------------------------------

    def _join(self, lease_id: str) -> pb.Lease:
        assert self._connection is not None
        try:
            msg = self._connection.call("Join", pb.LeaseRef(lease_id=lease_id), retry_unavailable_s=5)
        except grpc.RpcError as exc:
            raise LeaseError(f"cannot join lease {lease_id} from VACCEL_LEASE_ID: {exc.details()}",
                             exc.code().name.lower()) from None
        if len(msg.devices) < self.gpus:
            raise LeaseError(
                f"this process runs inside lease {lease_id} with {len(msg.devices)} device(s) but asks "
                f"for {self.gpus}; ask for at most {len(msg.devices)} or start it outside that lease")
        return msg

    def _acquire(self) -> pb.Lease:
        from vaccel.contract_files import load_contract_files
        from vaccel.facts import gather_facts

        assert self._connection is not None
        files = load_contract_files(self.contract, self.config, Path.cwd())
        request = pb.AcquireRequest(
            gpus=self.gpus,
            min_memory_mib=self.min_memory_mib,
            max_wait_seconds=self.max_wait_s,
            wait_forever=self.wait_forever,
            runtime_spec_yaml=files.spec_text,
            runtime_spec_name=files.spec_name,
            accelerator_config_yaml=files.config_text,
            accelerator_config_name=files.config_name,
            command=self.command,
        )
        request.client.CopyFrom(gather_facts(files.packages))
        self._config_path = files.config_path
        return acquire_lease(self._connection, request, self.on_queue)

    def _lost(self, lost: Lease, reason: str) -> None:
        lost.mark_lost(reason)
        if self.on_lost is not None:
            self.on_lost(lost, reason)
            return
        message = f"lease {lost.id} ended: {reason}; stop using its devices"
        exc_type = type("LeaseLost", (LeaseLost,), {"__init__": lambda s: LeaseLost.__init__(s, message)})
        _raise_in_thread(self._owner_thread, exc_type)

    def _apply_env(self, env: dict[str, str]) -> None:
        # Clear what another backend may have left so only this lease's devices are visible.
        for key in (*DEVICE_ENV_VARS, *env):
            if key not in self._saved_env:
                self._saved_env[key] = os.environ.get(key)
        for key in DEVICE_ENV_VARS:
            os.environ.pop(key, None)
        os.environ.update(env)
        if self._config_path is not None:
            self._saved_env.setdefault("VACCEL_ACCELERATOR_CONFIG", os.environ.get("VACCEL_ACCELERATOR_CONFIG"))
            os.environ["VACCEL_ACCELERATOR_CONFIG"] = str(self._config_path)

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


def acquire_lease(connection: BrokerConnection, request: pb.AcquireRequest,
                  on_queue: Callable[[str], None] | None) -> pb.Lease:
    """Run the Acquire stream until the grant; map refusals to LeaseError."""
    return consume_acquire(open_acquire(connection, request), on_queue)


def open_acquire(connection: BrokerConnection, request: pb.AcquireRequest) -> Any:
    """Start the Acquire stream; cancelling the returned call leaves the queue."""
    try:
        return connection.stream("Acquire", request)
    except BrokerUnavailable as exc:
        raise LeaseError(str(exc), "unavailable") from None


def consume_acquire(call: Any, on_queue: Callable[[str], None] | None) -> pb.Lease:
    """Read queue updates until the grant. Shared by lease() and `vaccel run`."""
    granted: pb.Lease | None = None
    try:
        # Read to the end of the stream even after the grant: the broker ends it right
        # away, and a call dropped before that looks like a client that left, whose
        # grant the broker then takes back.
        for update in call:
            if update.HasField("granted"):
                granted = update.granted
            elif on_queue is not None and update.queued.message:
                on_queue(update.queued.message)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise LeaseError(f"lost the broker while waiting: {exc.details()}", "unavailable") from None
        if exc.code() == grpc.StatusCode.CANCELLED:
            raise LeaseError("the request was cancelled", "cancelled") from None
        raise error_from_rpc(exc) from None
    except BaseException:
        call.cancel()  # Ctrl-C while queued: leave the queue
        raise
    if granted is None:
        raise LeaseError("the broker ended the request without a grant", "internal")
    return granted

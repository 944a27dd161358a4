"""One lease's life on the client side, written once: connect, build the request, wait in
the queue, keep the lease alive, notice when it ends behind our back, give it back.

`vaccel.lease()` (leasing.py) and `vaccel run` (runner.py) are shells around LeaseSession
that add only what differs between them: lease() applies the environment to this process
and raises LeaseLost in its main thread; `vaccel run` waits for signals and stops its
command when the lease is lost. Anything else that holds a lease (a reservation, a
notebook kernel) is meant to be one more such shell.

    session = LeaseSession(socket)
    try:
        held = session.acquire(LeaseRequest(gpus=2, command="train.py"))
        session.start_heartbeat()
        ...                                   # use held.env / held.devices
        session.release()
    finally:
        session.close()
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from vaccel.contract.files import ContractFiles
from vaccel.session.acquisition import Acquisition
from vaccel.session.connection import BrokerConnection, BrokerUnavailable
from vaccel.session.grpc_lazy import SideRefusal, grpc
from vaccel.session.lease import Lease, LeaseEnding, LeaseError, ended_reason
from vaccel.session.request import LeaseRequest, time_limit_s, wait_fields  # noqa: F401 (callers import them here)
from vaccel_common.ending_notice import warning_lead_s
from vaccel_common.units import format_duration
from vaccel_common.v1 import broker_pb2 as pb

# Heartbeat replies meaning the lease is over for good (ended, someone else's, forgotten):
# every other failure is retried on the next beat. (Status names: grpc is imported lazily.)
_LEASE_OVER = frozenset({"NOT_FOUND", "FAILED_PRECONDITION", "PERMISSION_DENIED"})
# Release replies meaning the lease had already ended (expired, revoked): nothing to give back.
_ALREADY_ENDED = frozenset({"FAILED_PRECONDITION", "NOT_FOUND"})


class PendingGrant:
    """An Acquire in flight on a worker thread, so the calling thread stays free (to wait
    for signals). `done` is set the moment the stream ends, granted or not; a caller that
    wants to wake on the grant instead of polling passes `on_done` (run on the worker)."""

    def __init__(self, session: LeaseSession, acquisition: Acquisition,
                 on_done: Callable[[], None] | None) -> None:
        self._session = session
        self._acquisition = acquisition
        self._on_done = on_done
        self._granted: pb.Lease | None = None
        self._error: BaseException | None = None
        self._lease: Lease | None = None
        self.done = threading.Event()
        self._worker = threading.Thread(target=self._consume, name="vaccel-acquire", daemon=True)
        self._worker.start()

    def _consume(self) -> None:
        try:
            self._granted = self._acquisition.run()
        except BaseException as exc:  # handed to the caller's thread by result()
            self._error = exc
        self.done.set()
        if self._on_done is not None:
            self._on_done()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the stream has ended (call result()), False on timeout."""
        return self.done.wait(timeout)

    def cancel(self, join_s: float = 5.0) -> None:
        """Leave the queue; a grant that races the cancel is handed back by the broker."""
        self._acquisition.cancel()
        self._worker.join(join_s)

    def result(self) -> Lease:
        """The granted lease (now the session's), or the LeaseError that ended the wait."""
        self.done.wait()
        if self._error is not None:
            raise self._error
        assert self._granted is not None
        if self._lease is None:
            self._lease = self._session.adopt(self._granted, joined=False)
        return self._lease


class LeaseSession:
    """One connection to the broker and at most one lease on it, from request to release.

    Args:
        socket: the broker's socket (default: VACCEL_SOCKET, then the standard places).
        on_queue: called with each queue message while waiting (None: stay silent).
        on_lost: called (lease, reason) from the heartbeat thread after the lease has been
            marked lost, when the broker says it ended behind our back.
        on_ending: called with a LeaseEnding from the heartbeat thread when the lease will
            end soon (its time limit is near, or an admin revoked it with a grace), once for
            each new end.
        say: where problems the caller cannot act on are reported (a release that failed).
        on_contract: called with one line naming the contract files a request read, if any.
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        *,
        on_queue: Callable[[str], None] | None = None,
        on_lost: Callable[[Lease, str], None] | None = None,
        say: Callable[[str], None] | None = None,
        on_ending: Callable[[LeaseEnding], None] | None = None,
        on_contract: Callable[[str], None] | None = None,
    ) -> None:
        self.connection = BrokerConnection(socket)
        self.on_queue = on_queue
        self.on_lost = on_lost
        self.on_ending = on_ending
        self.on_contract = on_contract
        self._say = say or _stderr
        self.lease: Lease | None = None
        self.files = ContractFiles()
        self._heartbeat: _Heartbeat | None = None

    @property
    def config_path(self) -> str | None:
        """The accelerator config the request carried (absolute), for the job's accelerator."""
        return self.files.config_path

    # -- getting a lease ----------------------------------------------------------------

    def acquire(self, request: LeaseRequest) -> Lease:
        """Wait in this thread until the grant; Ctrl-C here leaves the queue. A broker
        that is down or restarts meanwhile is waited for (vaccel/session/acquisition.py)."""
        return self.adopt(self._acquisition(request).run(), joined=False)

    def acquire_in_background(self, request: LeaseRequest,
                              on_done: Callable[[], None] | None = None) -> PendingGrant:
        """Start waiting for the grant on a worker thread; see PendingGrant."""
        return PendingGrant(self, self._acquisition(request), on_done)

    def join(self, lease_id: str, gpus: int = 1, *, source: str = "VACCEL_LEASE_ID",
             part: Callable[[pb.Lease], pb.Lease] | None = None) -> Lease:
        """Join a lease this process runs inside instead of queueing. `source` says where its
        id came from (VACCEL_LEASE_ID, --lease); `part` picks what of it is asked for
        (vaccel/session/inside.py), else it must hold at least `gpus` devices."""
        from vaccel.session.inside import join_refusal

        try:
            msg = self.connection.call("Join", pb.LeaseRef(lease_id=lease_id), retry_unavailable_s=5)
        except BrokerUnavailable as exc:
            raise LeaseError(str(exc), "unavailable") from None
        except grpc.RpcError as exc:
            raise LeaseError(join_refusal(lease_id, exc.details() or exc.code().name, source),
                             exc.code().name.lower()) from None
        if part is not None:
            msg = part(msg)
        elif len(msg.devices) < gpus:
            raise LeaseError(
                f"this process runs inside lease {lease_id} with {len(msg.devices)} device(s) but asks "
                f"for {gpus}; ask for at most {len(msg.devices)} or start it outside that lease")
        return self.adopt(msg, joined=True)

    def adopt(self, msg: pb.Lease, *, joined: bool) -> Lease:
        """Make a lease message the session's lease."""
        self.lease = Lease(msg, joined=joined)
        return self.lease

    def _acquisition(self, request: LeaseRequest) -> Acquisition:
        wire, self.files = request.build(os.getcwd())
        if self.on_contract is not None and not self.files.empty:
            self.on_contract(self.files.said())
            if self.files.checked_against:
                self.on_contract(self.files.checked_against)
        return Acquisition(self.connection, wire, self.on_queue, self._say)

    # -- holding it ---------------------------------------------------------------------

    def start_heartbeat(self) -> None:
        """Keep the lease alive from a daemon thread until release() or close()."""
        assert self.lease is not None, "start_heartbeat() before a lease"
        self._heartbeat = _Heartbeat(self.lease, self.connection, self._lost, self.on_ending)
        self._heartbeat.start()

    def _lost(self, lost: Lease, reason: str) -> None:
        reason = ended_reason(lost.id, reason)
        lost.mark_lost(reason)
        if self.on_lost is not None:
            self.on_lost(lost, reason)

    # -- giving it back -----------------------------------------------------------------

    def release(self) -> bool:
        """Close the lease's accelerator, then give the lease back unless it was joined or
        has already ended. True when it was given back just now."""
        self._stop_heartbeat()
        current = self.lease
        if current is None:
            return False
        problem = current.close_accelerator()  # process group down before the devices go back
        if problem:
            self._say(f"closing the accelerator failed ({problem}); releasing anyway")
        if current.joined or current.ended:
            return False
        current.mark_released()
        try:
            self.connection.call("Release", pb.ReleaseRequest(lease_id=current.id),
                                 timeout=10, retry_unavailable_s=5, plain_refusal=True)
        except SideRefusal as err:  # a lease its container's exit ended: no grpc imported to hear so
            if err.code.upper() not in _ALREADY_ENDED:
                self._say(f"could not release lease {current.id} ({err.details}); "
                          "the broker reclaims it when this process exits")
            return False
        except grpc.RpcError as err:
            if err.code().name not in _ALREADY_ENDED:
                self._say(f"could not release lease {current.id} ({err.details()}); "
                          "the broker reclaims it when this process exits")
            return False
        except BrokerUnavailable as err:
            self._say(f"could not release lease {current.id} ({err}); "
                      "the broker reclaims it when this process exits")
            return False
        return True

    def hand_over(self) -> None:
        """Something else holds the lease now (a container started with -d): it is neither
        beaten nor released from here any more."""
        self._stop_heartbeat()
        self.lease = None

    def close(self) -> None:
        """Stop the heartbeat and close the connection (without releasing: see release())."""
        self._stop_heartbeat()
        self.connection.close()

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def __enter__(self) -> LeaseSession:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class _Heartbeat(threading.Thread):
    """Keeps one lease alive; calls `on_lost` once when the broker says it is over, and
    `on_ending` when its end comes near (the reply of each beat says when it ends)."""

    def __init__(self, held: Lease, connection: BrokerConnection,
                 on_lost: Callable[[Lease, str], None],
                 on_ending: Callable[[LeaseEnding], None] | None = None) -> None:
        super().__init__(name=f"vaccel-heartbeat-{held.id}", daemon=True)
        self.lease = held
        self.connection = connection
        self.on_lost = on_lost
        self.on_ending = on_ending
        self.stop_event = threading.Event()
        self._told: tuple[float, str] | None = None  # the end last announced

    def _next_wait(self, interval: float) -> float:
        # Jitter keeps many clients started together from beating in lockstep; the wait
        # is cut short to wake at the moment the holder must be warned.
        wait = interval * random.uniform(0.8, 1.0)
        held = self.lease
        if held.expires_at and self._told != (held.expires_at, held.notice):
            warn_at = held.expires_at - (0 if held.notice else warning_lead_s(held.time_limit_s))
            wait = max(0.0, min(wait, warn_at - time.time()))
        return wait

    def _maybe_warn(self) -> None:
        held = self.lease
        if self.on_ending is None or not held.expires_at or self._told == (held.expires_at, held.notice):
            return
        left = held.expires_at - time.time()
        if held.notice or left <= warning_lead_s(held.time_limit_s):
            self._told = (held.expires_at, held.notice)
            reason = held.notice or f"time limit of {format_duration(held.time_limit_s or left)}"
            self.on_ending(LeaseEnding(held.id, held.expires_at, left, reason))

    def run(self) -> None:
        interval = self.lease.heartbeat_interval_s
        request = pb.LeaseRef(lease_id=self.lease.id)
        self._maybe_warn()
        while not self.stop_event.wait(self._next_wait(interval)):
            try:
                # A broker restart shows up as UNAVAILABLE for a moment: retry, don't panic.
                reply = self.connection.call("Heartbeat", request, timeout=10, retry_unavailable_s=interval)
                self.lease.expires_at, self.lease.notice = reply.expires_at, reply.notice
                self._maybe_warn()
            except BrokerUnavailable:
                continue
            except grpc.RpcError as exc:
                if exc.code().name in _LEASE_OVER:
                    if not self.stop_event.is_set():
                        self.on_lost(self.lease, exc.details() or exc.code().name)
                    return
            except Exception:  # one failed beat must not end the lease: the TTL decides
                continue

    def stop(self) -> None:
        self.stop_event.set()


def _stderr(message: str) -> None:
    print(f"vaccel: {message}", file=sys.stderr, flush=True)

"""One Acquire, from the request to the grant, across broker restarts.

A request the broker can grant at once takes one unary call (TryAcquire); one that must
wait then opens the Acquire stream, which carries its queue updates.

The request carries a key this client chose, so the broker can match a later ask to it.
If the broker is down when we first ask, we retry for a few seconds (START_RETRY_S, never
past our own wait) and say so; once it has answered at all (a token on its identity socket
is enough), or its socket is there with nobody listening (left by a broker that crashed: a
clean stop removes it, and the unit restarts a crashed one after RestartSec=2s plus its
start-up), its absence is a restart, as below. If the stream breaks while we wait in the queue (the
broker restarted), or the broker goes away after it answered or accepted us at all (the
fast path said "wait", and the restart came before the stream's first place), we reconnect with
backoff for as long as a restart may take (RECONNECT_S) and ask again under the same key: the
broker, which recorded the request durably, gives us back our own place and our original
deadline once the kernel's identity of this process matches the recorded one. We then
print one line ("broker restarted; still waiting, position 2 of 3"), not a failure.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from vaccel.session.connection import BrokerConnection, BrokerUnavailable
from vaccel.session.grpc_lazy import grpc
from vaccel.session.lease import LeaseError
from vaccel_common.v1 import broker_pb2 as pb

START_RETRY_S = 5.0  # the broker is down when we first ask
RECONNECT_S = 60.0  # the broker went away while we waited (a restart takes seconds)
_BACKOFF_S = (0.05, 0.5)  # first and longest pause between tries
# What the broker says when it cannot record a request or grant for now (brokerd's
# Unrecorded, gRPC UNAVAILABLE: its disk is full); a broker that is down says otherwise.
_UNRECORDED = "the broker could not record"


class _Broken(Exception):
    """The stream ended without an answer from the broker (it went away)."""


class _Unrecorded(_Broken):
    """The broker answered that it cannot record the request for now (its disk is full):
    asked again, with backoff, for as long as the request may wait and the broker answers."""


def refusal(exc: grpc.RpcError) -> LeaseError:
    """The broker's answer to an Acquire, as the LeaseError the caller sees."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return LeaseError(f"lost the broker while waiting: {exc.details()}", "unavailable")
    if code == grpc.StatusCode.CANCELLED:
        return LeaseError("the request was cancelled", "cancelled")
    return LeaseError(exc.details() or str(code), code.name.lower())


class Acquisition:
    """Ask for a lease and wait for it; `run()` returns the granted lease message.

    `on_queue` gets each queue message; `say` gets the lines about the broker's absence.
    `cancel()` (from another thread) leaves the queue.
    """

    def __init__(self, connection: BrokerConnection, wire: pb.AcquireRequest,
                 on_queue: Callable[[str], None] | None, say: Callable[[str], None]) -> None:
        self.connection = connection
        self.wire = pb.AcquireRequest()
        self.wire.CopyFrom(wire)
        if not self.wire.request_key:
            self.wire.request_key = os.urandom(12).hex()
        self.on_queue = on_queue
        self.say = say
        self._deadline = None if wire.wait_forever else time.monotonic() + wire.max_wait_seconds
        self._lock = threading.Lock()
        self._call: Any = None
        self._cancelled = threading.Event()
        self._queued = False  # the broker has told us our place at least once
        self._back = False  # reconnected after a break: the next place is news to print
        self._answered = False  # the broker answered since the last failure
        self._met = False  # a broker is known here (it answered, or left its socket): its absence is a restart
        self._tried_now = False  # the unary fast path was asked (once: a waiter streams)
        self._tokens_before = connection.tokens_taken  # see _run

    def cancel(self) -> None:
        """Leave the queue; a grant that races the cancel is handed back by the broker."""
        self._cancelled.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()

    def run(self) -> pb.Lease:
        try:
            return self._run()
        except LeaseError as exc:
            raise self._naming_the_contract(exc) from None

    def _naming_the_contract(self, exc: LeaseError) -> LeaseError:
        """A refusal of a request that carried contract files names them (unless it does
        already): a file found in the working directory may be news to the user."""
        names = [name for name in (self.wire.runtime_spec_name, self.wire.accelerator_config_name) if name]
        if not names or exc.code not in ("failed_precondition", "invalid_argument") or any(
                name in str(exc) for name in names):
            return exc
        return LeaseError(f"{exc} (contract: {', '.join(names)})", exc.code)

    def _run(self) -> pb.Lease:
        failing_since: float | None = None
        told = False
        delay = _BACKOFF_S[0]
        while True:
            try:
                return self._attempt()
            except (BrokerUnavailable, _Broken) as exc:
                if self._cancelled.is_set():
                    raise LeaseError("the request was cancelled", "cancelled") from None
                if isinstance(exc, BrokerUnavailable) and not exc.transient:
                    raise LeaseError(str(exc), "unavailable") from None
                now = time.monotonic()
                # A broker that answered on its identity socket since we first asked (a
                # token, even if the call then failed) exists: one restarted again and again
                # may listen for under a second at a time, and each of our tries can land in
                # a window it is killed in.
                # A socket there that nobody listens on says so too: a broker crashed (a clean
                # stop removes it), and the unit restarts it after RestartSec=2s plus its start-up.
                left_behind = isinstance(exc, BrokerUnavailable) and exc.left_behind
                self._met = self._met or left_behind or self.connection.tokens_taken > self._tokens_before
                if failing_since is None or self._answered:
                    failing_since, delay, self._answered = now, _BACKOFF_S[0], False
                bound = RECONNECT_S if self._queued or self._met else START_RETRY_S
                give_up = min(failing_since + bound, self._deadline if self._deadline is not None else now + bound)
                if now + delay > give_up:
                    why = str(exc)
                    if not isinstance(exc, BrokerUnavailable | _Unrecorded) and not why.startswith("lost the broker"):
                        why = f"lost the broker while waiting: {why}"
                    raise LeaseError(why, "unavailable") from None
                if isinstance(exc, _Unrecorded) and not told:
                    told = True
                    self.say(f"{exc}; asking again")
                elif not self._queued and not told:
                    told = True
                    why = " (a broker stopped there without closing: waiting for its restart)" if left_behind else ""
                    self.say(f"cannot reach the vaccel broker yet{why}; retrying for up to {give_up - now:.0f}s")
                if self._cancelled.wait(delay * random.uniform(0.5, 1.0)):
                    raise LeaseError("the request was cancelled", "cancelled") from None
                delay = min(delay * 2, _BACKOFF_S[1])
                # A broker that accepts us again is back (if only for a moment, when it is
                # restarted again and again): the bound counts from its next absence, and
                # is a restart's from then on: a broker that listens exists.
                with contextlib.suppress(BrokerUnavailable):
                    if self.connection.wait_ready(min(1.0, max(give_up - time.monotonic(), 0.0))):
                        self._answered = self._met = True
                self._back = self._back or self._queued
                if self._deadline is not None:
                    self.wire.max_wait_seconds = max(self._deadline - time.monotonic(), 0.001)

    def _attempt(self) -> pb.Lease:
        if not self._tried_now:
            granted = self._try_now()
            if granted is not None:
                return granted
        with self._lock:
            if self._cancelled.is_set():
                raise LeaseError("the request was cancelled", "cancelled")
            call = self._call = self.connection.stream("Acquire", self.wire)
        try:
            return read_acquire(call, self.on_queue, self._heard)
        except LeaseError as exc:
            if exc.code == "unauthenticated":  # a new key on the broker's side: mint again
                self.connection.forget_token()
                raise _Broken(str(exc)) from None
            if exc.code == "unavailable" and _UNRECORDED in str(exc):
                raise _Unrecorded(str(exc).removeprefix("lost the broker while waiting: ")) from None
            # A restart cuts streams as UNAVAILABLE, a shutdown's grace as CANCELLED.
            if exc.code == "unavailable" or (exc.code == "cancelled" and not self._cancelled.is_set()):
                raise _Broken(str(exc)) from None
            raise
        finally:
            with self._lock:
                self._call = None

    def _try_now(self) -> pb.Lease | None:
        """The fast path: one unary call that is granted at once when devices are free
        (half the cost of a stream); None when the request must wait on the stream (or the
        broker predates TryAcquire). Nothing is queued by it, so nothing is left behind."""
        try:
            reply = self.connection.call("TryAcquire", self.wire)
        except grpc.RpcError as exc:
            self._tried_now = True
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            if exc.code() == grpc.StatusCode.UNAVAILABLE and _UNRECORDED in (exc.details() or ""):
                self._tried_now = False  # asked again the same way
                raise _Unrecorded(exc.details()) from None
            raise refusal(exc) from None
        self._tried_now = True
        self._answered = self._met = True
        if not reply.HasField("granted"):
            return None
        if self._cancelled.is_set():  # cancelled while the call was in flight: hand it back
            with contextlib.suppress(grpc.RpcError, BrokerUnavailable):
                self.connection.call("Release", pb.ReleaseRequest(lease_id=reply.granted.id), timeout=5)
            raise LeaseError("the request was cancelled", "cancelled")
        return reply.granted

    def _heard(self, queued: pb.Queued) -> bool:
        """Note our place; True when it was reported here (the first one after a break)."""
        self._answered = self._met = True
        if not queued.position:
            return False
        self._queued = True
        if not self._back:
            return False
        self._back = False
        self.say(f"broker restarted; still waiting, position {queued.position} of {queued.total}")
        return True


def read_acquire(call: Any, on_queue: Callable[[str], None] | None,
                 on_place: Callable[[pb.Queued], bool] | None = None) -> pb.Lease:
    """Read one Acquire stream's queue updates until the grant; refusals become LeaseError.
    `on_place` sees each update first and returns True when it has reported it itself."""
    granted: pb.Lease | None = None
    try:
        # Read to the end of the stream even after the grant: the broker ends it right
        # away, and a call dropped before that looks like a client that left, whose
        # grant the broker then takes back.
        for update in call:
            if update.HasField("granted"):
                granted = update.granted
            elif on_place is not None and on_place(update.queued):
                continue
            elif on_queue is not None and update.queued.message:
                on_queue(update.queued.message)
    except grpc.RpcError as exc:
        if granted is not None:  # the broker went away right after the grant: it is ours
            return granted
        raise refusal(exc) from None
    except BaseException:
        call.cancel()  # Ctrl-C while queued: leave the queue
        raise
    if granted is None:
        raise LeaseError("the broker ended the request without a grant", "internal")
    return granted

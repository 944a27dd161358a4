"""The client's connection to the broker: a gRPC channel over the Unix socket plus the
identity token minted by the daemon's side socket from the kernel's view of this process.
Until the process needs a channel, the few calls the side socket also serves go there
(vaccel_common/side_call.py): a short `vaccel run` or `vaccel status` then never imports grpc.

A connection belongs to the process that made it: after a fork the child gets a fresh
channel and token of its own (it is another pid), never the parent's.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from typing import TYPE_CHECKING, Any, BinaryIO

from vaccel.session.grpc_lazy import SideRefusal, grpc, side_call_error
from vaccel_common.auth import TOKEN_METADATA_KEY
from vaccel_common.paths import SYSTEM_SOCKET, client_socket, identity_socket
from vaccel_common.side_call import (
    MAX_HEADER_BYTES,
    MAX_REQUEST_BYTES,
    UNIMPLEMENTED,
    parse_reply_header,
    request_header,
)
from vaccel_common.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    from vaccel_common.v1 import broker_pb2_grpc

_RENEW_BEFORE_S = 60.0
_MAX_TOKEN_LINE = 4096
# What each call served over the identity socket (vaccel_common/side_call.py) answers with.
_SIDE_REPLIES = {"TryAcquire": pb.AcquireUpdate, "Release": pb.Lease, "Status": pb.StatusReply,
                 "AttachContainer": pb.Lease}
# After a broker restart the channel must find the new one within a moment, not after
# gRPC's default reconnect backoff (which grows to two minutes).
_CHANNEL_OPTIONS = [("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]


# The pid of the process that first opened a channel. gRPC (with its fork handlers off,
# see vaccel/__init__.py) cannot be used again in a child forked from it: a new channel
# there hangs. Such a child gets a clear error instead.
_GRPC_PID: int | None = None


class BrokerUnavailable(ConnectionError):
    """The broker cannot be reached; the message says where we looked and what to try.
    `transient` is False where trying again cannot help (a forked child, an impostor's folder).
    `left_behind`: its socket is there but nobody listens. A clean stop removes the socket,
    so a broker was here and crashed or was killed, and its service manager restarts it."""

    def __init__(self, message: str, *, transient: bool = True, left_behind: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
        self.left_behind = left_behind


_IS_IT_RUNNING = ("Is vaccel-brokerd running? (systemctl status vaccel-brokerd; or set VACCEL_SOCKET to your "
                  "broker's socket)")
_WRONG_PATH = "Set VACCEL_SOCKET (or --socket) to the broker's socket, or unset it for the standard places"


def _unreachable(path: str, why: str, hint: str = _IS_IT_RUNNING, *, left_behind: bool = False) -> BrokerUnavailable:
    return BrokerUnavailable(f"cannot reach the vaccel broker at {path}: {why}. {hint}", left_behind=left_behind)


def _nothing_there(path: str, by_rule: bool) -> BrokerUnavailable:
    """No identity socket beside `path`: say what is there instead, and, when the path came
    from the standard places, that the system's broker was looked for too."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISSOCK(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a file"
        return _unreachable(path, f"that is {kind}, not a broker's socket", _WRONG_PATH)
    if mode is not None:
        return _unreachable(path, f"a socket is there, but not a vaccel broker's (no {identity_socket(path)} "
                                  "beside it)", _WRONG_PATH)
    if by_rule and path != SYSTEM_SOCKET:
        return BrokerUnavailable(f"cannot reach the vaccel broker: no socket at {SYSTEM_SOCKET} (the system's "
                                 f"broker) nor at {path} (a broker of your own). {_IS_IT_RUNNING}")
    return _unreachable(path, "no broker socket there")


def _check_fallback_folder(path: str) -> None:
    """/tmp/vaccel-$UID is a fixed name in a shared folder: another user could create it
    first and serve an impostor broker there. Talk to it only if it is ours."""
    folder = os.path.dirname(os.path.normpath(path))
    if folder != f"/tmp/vaccel-{os.getuid()}":
        return
    try:
        owner = os.stat(folder).st_uid
    except FileNotFoundError:
        return
    if owner != os.getuid():
        raise BrokerUnavailable(f"refusing {path}: its folder belongs to uid {owner}, not to you; remove it "
                                "and restart your broker, or set VACCEL_SOCKET", transient=False)


class BrokerConnection:
    """`side_calls`: whether the calls the identity socket serves go there while this
    connection has no channel (by default yes). A short lease (grant, release) is then two
    round trips whether or not the process has imported grpc (anything that imports
    tensorboard, ray or wandb has): opening a channel costs a connection, HTTP/2's
    handshake and a token before the first call (bench.lease_cycle measures both). A lease
    that lives on opens the channel with its first heartbeat (not a side call), and from
    then on every call of this connection uses it."""

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, side_calls: bool | None = None) -> None:
        self.path = client_socket(socket_path)
        self.by_rule = not (socket_path or os.environ.get("VACCEL_SOCKET"))  # from the standard places
        self.side_calls = side_calls
        self._lock = threading.Lock()
        self._pid = -1
        self._channel: grpc.Channel | None = None
        self._stub: broker_pb2_grpc.BrokerStub | None = None
        self._token = ""
        self._token_expires = 0.0
        self._token_pid = -1
        # Tokens the broker's identity socket has given this connection: one given while a
        # request was asked for says a broker exists at this path, so its absence afterwards
        # is a restart (vaccel/session/acquisition.py).
        self.tokens_taken = 0

    # -- identity ----------------------------------------------------------------------

    def _identity_socket(self, timeout: float) -> socket.socket:
        """A connection to the identity socket, whose first line is our token."""
        _check_fallback_folder(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(identity_socket(self.path))
        except OSError as exc:
            sock.close()
            if isinstance(exc, FileNotFoundError):
                raise _nothing_there(self.path, self.by_rule) from None
            if isinstance(exc, PermissionError):
                raise _unreachable(self.path, "permission denied on the socket") from None
            if isinstance(exc, ConnectionRefusedError):
                raise _unreachable(self.path, "nobody listens there (a socket left by a broker that stopped)",
                                   left_behind=True) from None
            raise _unreachable(self.path, exc.strerror or str(exc)) from None
        return sock

    def _take_token(self, stream: BinaryIO) -> None:
        """Read the token line from the identity socket and keep the token."""
        try:
            data = stream.readline(_MAX_TOKEN_LINE)
        except OSError as exc:
            raise _unreachable(self.path, exc.strerror or str(exc)) from None
        if not data:  # accepted, then closed: a broker dying or restarting right now
            raise _unreachable(self.path, "the broker closed the connection before answering")
        reply: Any = None
        try:
            reply = json.loads(data)
            self._token, self._token_expires = reply["token"], float(reply["expires"])
            self._token_pid = os.getpid()
            self.tokens_taken += 1
        except (ValueError, KeyError, TypeError):
            why = reply.get("error", "bad identity reply") if isinstance(reply, dict) else "bad identity reply"
            raise _unreachable(self.path, why) from None

    def _mint_token(self) -> None:
        with self._identity_socket(10) as sock, sock.makefile("rb") as stream:
            self._take_token(stream)

    def side_call(self, method: str, request: Any, timeout: float, plain_refusal: bool = False) -> Any | None:
        """`method` over the identity socket (vaccel_common/side_call.py), while this
        connection has no channel (see the class): it may never need one. The reply; or
        the broker's refusal, raised as gRPC raises it (the same servicer code made it, and
        asking again could act twice: in Slurm delegate mode each ask is a Slurm job); or
        None when the side path did not answer (an older broker, a bound, a broken
        connection), and the caller then makes the call over gRPC."""
        reply_type = _SIDE_REPLIES.get(method)
        wanted = self.side_calls is not False
        if not wanted or reply_type is None or self._channel is not None or _GRPC_PID not in (None, os.getpid()):
            return None
        body = request.SerializeToString()
        if len(body) > MAX_REQUEST_BYTES:
            return None
        try:
            with self._identity_socket(timeout) as sock, sock.makefile("rb") as stream:
                sock.sendall(request_header(method, len(body)) + body)
                self._take_token(stream)
                header = parse_reply_header(stream.readline(MAX_HEADER_BYTES))
                if header is None:
                    return None
                code, length = header
                payload = stream.read(length)
        except (BrokerUnavailable, OSError):
            return None
        if len(payload) != length or code == UNIMPLEMENTED:
            return None
        if code:
            details = payload.decode(errors="replace")
            raise SideRefusal(code, details) if plain_refusal else side_call_error(code, details)
        try:
            return reply_type.FromString(payload)
        except Exception:  # protobuf's DecodeError: a reply we cannot read is one we did not get
            return None

    def _ensure(self) -> broker_pb2_grpc.BrokerStub:
        with self._lock:
            if self._pid != os.getpid():
                global _GRPC_PID
                if _GRPC_PID is not None and _GRPC_PID != os.getpid():
                    raise BrokerUnavailable(
                        "cannot talk to the vaccel broker from a process forked after its parent "
                        "used the broker (gRPC is not fork-safe); start workers with the 'spawn' "
                        "method, or use the parent's lease: its devices are already visible here",
                        transient=False,
                    )
                _GRPC_PID = os.getpid()
                from vaccel_common.v1 import broker_pb2_grpc  # imports grpc: only once a channel is needed

                self._channel = grpc.insecure_channel(f"unix:{self.path}", options=_CHANNEL_OPTIONS)
                self._stub = broker_pb2_grpc.BrokerStub(self._channel)
                self._pid = os.getpid()
                if self._token_pid != self._pid:  # a token is bound to the process that minted it
                    self._token = ""
            if not self._token or self._token_expires - time.time() < _RENEW_BEFORE_S:
                self._mint_token()
            assert self._stub is not None
            return self._stub

    def wait_ready(self, timeout: float) -> bool:
        """Whether the broker's gRPC socket accepts us within `timeout` seconds (the
        channel's reconnect backoff included). Raises BrokerUnavailable when its identity
        socket cannot even be reached."""
        self._ensure()
        try:
            grpc.channel_ready_future(self._channel).result(timeout=max(timeout, 0.0))
        except grpc.FutureTimeoutError:
            return False
        return True

    def forget_token(self) -> None:
        """The broker refused our token (it has a new key): mint a new one on the next call."""
        with self._lock:
            self._token = ""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, self._token),)

    # -- calls -------------------------------------------------------------------------

    def call(self, method: str, request: Any, *, timeout: float = 30.0,
             retry_unavailable_s: float = 0.0, plain_refusal: bool = False) -> Any:
        """A unary call. A rejected token (daemon restarted with a new key) is renewed once;
        UNAVAILABLE is retried for `retry_unavailable_s` (a daemon restart takes a moment).
        `plain_refusal`: a refusal heard on the identity socket is raised as SideRefusal
        (over gRPC it is grpc.RpcError either way)."""
        reply = self.side_call(method, request, timeout, plain_refusal)
        if reply is not None:
            return reply
        deadline = time.monotonic() + retry_unavailable_s
        renewed = False
        delay = 0.05
        while True:
            try:
                stub = self._ensure()
            except BrokerUnavailable as exc:
                # A restarting broker's identity socket is missing or not yet listening for a
                # moment: the token to mint is part of the call, and waits as UNAVAILABLE does
                # (else a heartbeat due then lost a whole interval, issue 46's faulted day).
                if exc.transient and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                raise
            try:
                return getattr(stub, method)(request, timeout=timeout, metadata=self.metadata())
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAUTHENTICATED and not renewed:
                    renewed = True
                    self._token = ""
                    continue
                if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise _unreachable(self.path, exc.details() or "unavailable") from None
                raise

    def stream(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        stub = self._ensure()
        return getattr(stub, method)(request, timeout=timeout, metadata=self.metadata())

    def close(self) -> None:
        with self._lock:
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            self._channel, self._stub, self._pid = None, None, -1

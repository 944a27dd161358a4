"""Kernel-verified caller identity.

gRPC does not expose a Unix socket peer's credentials to the server (grpc/grpc#15511,
#28755), so identity comes from a small side socket (`<socket>.id`) served in the same
event loop: at connect time the daemon reads SO_PEERCRED (uid, gid, pid) from the
kernel and answers with a short-lived token bound to them and to the process's start
time, HMAC-signed with a key kept in the state directory. Every gRPC call carries the
token in metadata; nothing the client says about itself is ever trusted.

The key survives restarts (tokens stay valid across a daemon crash, so holders only see
a retry) and is readable by the daemon's user only.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from brokerd.base.process import Identity, ProcessId
from brokerd.base.procinfo import process_info, start_time
from brokerd.state.state_dir import read_private, write_private

if TYPE_CHECKING:
    from brokerd.edge.side_calls import SideCalls

_KEY_FILE = "token.key"
_MAX_TOKEN_LEN = 1024


# What a raw client (docs/api.md) is told to do about a missing, expired or foreign token.
MINT = ("To mint a token: from the calling process, connect a stream Unix socket to this socket's path "
        "plus '.id' (e.g. /run/vaccel/brokerd.sock.id), read its one JSON line and send its \"token\" "
        "(docs/api.md, 'The identity token'; vaccel's client library does this for you)")


class TokenError(Exception):
    """The token is missing, forged, expired or malformed."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer of a connected Unix socket, from the kernel."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def load_or_create_key(state_dir: Path) -> bytes:
    """The signing key: read without following a symlink and only when it is the daemon's
    own private file (brokerd/state/state_dir.py), else made afresh."""
    path = state_dir / _KEY_FILE
    key = read_private(path)
    if key is not None and len(key) >= 32:
        return key
    key = secrets.token_bytes(32)
    write_private(path, key)
    return key


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenAuthority:
    """Mints and verifies tokens. Verification is an HMAC check plus one read of the
    process's start time: a token whose process has exited is refused for everything,
    even after another process (of any user) reuses its pid."""

    def __init__(self, key: bytes, ttl_s: float,
                 started_at: Callable[[int], int | None] = start_time) -> None:
        self._key = key
        self.ttl_s = ttl_s
        self._started_at = started_at
        self._cache: dict[str, tuple[Identity, float]] = {}
        # The service's pidfd watch (brokerd/core/liveness.py) answers for the processes it
        # watches without a read of /proc: None = not watched, look.
        self.alive: Callable[[ProcessId], bool | None] = lambda _process: None

    def mint(self, identity: Identity, now: float | None = None) -> tuple[str, float]:
        expires = (time.time() if now is None else now) + self.ttl_s
        payload = json.dumps(
            [identity.uid, identity.gid, identity.pid, identity.start_time, expires],
            separators=(",", ":"),
        ).encode()
        body = _b64(payload)
        return f"{body}.{self._sign(body)}", expires

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest()[:24])

    def verify(self, token: str | None, now: float | None = None) -> Identity:
        now = time.time() if now is None else now
        if not token:
            raise TokenError(f"no identity token: send metadata 'vaccel-token: TOKEN' with every call. {MINT}")
        cached = self._cache.get(token)
        if cached is not None:
            identity, expires = cached
        else:
            if len(token) > _MAX_TOKEN_LEN or token.count(".") != 1:
                raise TokenError(f"malformed identity token. {MINT}")
            body, signature = token.split(".")
            if not hmac.compare_digest(signature, self._sign(body)):
                raise TokenError(f"identity token not signed by this broker (another host's, or forged). {MINT}")
            try:
                uid, gid, pid, start, expires = json.loads(_unb64(body))
                identity = Identity(int(uid), int(gid), int(pid), int(start))
                expires = float(expires)
            except (ValueError, TypeError) as exc:
                raise TokenError(f"malformed identity token. {MINT}") from exc
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[token] = (identity, expires)
        if expires < now:
            raise TokenError(f"identity token expired (its line's \"expires\"; leases.token_ttl): mint a new one "
                             f"and call again. {MINT}")
        alive = self.alive(identity.process)
        if not alive and (alive is False or self._started_at(identity.pid) != identity.start_time):
            raise TokenError("identity token of a process that has exited: a token is bound to the process that "
                             f"minted it, so each process mints its own. {MINT}")
        return identity


class IdentityServer:
    """The side socket: one token line per connection, bound to the kernel's view of the
    peer, then at most one unary call on that token (`side_calls`, brokerd/edge/side_calls.py)."""

    def __init__(self, authority: TokenAuthority, path: Path, mode: int,
                 side_calls: SideCalls | None = None) -> None:
        self.authority = authority
        self.path = path
        self.mode = mode
        self.side_calls = side_calls
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.path))
        os.chmod(self.path, self.mode)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.path.unlink(missing_ok=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            pid, uid, gid = peer_credentials(sock)
            info = process_info(pid)
            # Read after SO_PEERCRED: if the caller exited and its pid was reused meanwhile,
            # the owner differs and the token must not bind uid to someone else's process.
            start = info.starttime if info is not None and info.uid == uid else None
            if start is None:
                writer.write(b'{"error": "could not verify the caller: it exited, or its pid was reused"}\n')
                await writer.drain()
                return
            token, expires = self.authority.mint(Identity(uid, gid, pid, start))
            reply = {"token": token, "expires": expires, "uid": uid, "pid": pid}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
            if self.side_calls is not None:
                await self.side_calls.serve(reader, writer, uid, token)
        except (TimeoutError, ConnectionError, OSError):
            pass  # the client went away mid-answer, or never read it: nothing to tell it
        finally:
            writer.close()

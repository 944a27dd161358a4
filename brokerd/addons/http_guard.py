"""What keeps the daemon's read-only HTTP servers (the dashboard, the metrics endpoint)
answering everyone while one client misbehaves: aiohttp on the daemon's own loop, where a
slow client is only a coroutine, with budgets per client and deadlines per request.

- A client is the kernel's answer, not an address: on loopback every local user arrives
  from 127.0.0.1 (or from any other of 127/8's addresses, free to pick), so a local peer
  is known by the uid that owns its socket (brokerd/base/tcp_peer.py); a remote peer by
  its address (its /64 for IPv6).
- Each client may hold at most `per_client` connections, everyone together `total`: the
  connection past either is closed at once, before it costs anything. So one user holding
  connections open keeps only themselves off.
- A request must arrive whole within `request_timeout_s` of the connection or of the
  previous response (aiohttp's keep-alive timer runs while the request trickles in, so
  it bounds the whole request, not one read), and its line and headers are size-limited.
- A malformed request is the client's mistake: one short line in the log, no traceback.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from brokerd.base.tcp_peer import peer_uid

log = logging.getLogger("vaccel.brokerd")

MAX_LINE = 4096  # the request line and each header line
MAX_HEADERS = 64


def split_listen(listen: str) -> tuple[str, int]:
    """"127.0.0.1:8642" -> ("127.0.0.1", 8642); "[::1]:8642" -> ("::1", 8642)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class ConnectionBudget:
    """Connections per client and in all; `client_of` tells a request's client."""

    def __init__(self, name: str, *, per_client: int, total: int) -> None:
        self.name = name  # "dashboard", "metrics": for the log
        self.per_client = per_client
        self.total = total
        self._open: Counter[str] = Counter()
        self._client: dict[asyncio.BaseTransport, str] = {}
        self._refused: Counter[str] = Counter()

    def protocol(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for loop.create_server: `make`'s protocols, admitted by budget."""
        return lambda: _Admitted(self, make)

    def client_of(self, transport: asyncio.BaseTransport | None) -> str:
        return self._client.get(transport, "unknown") if transport is not None else "unknown"

    def _admit(self, transport: asyncio.BaseTransport) -> bool:
        client = _client_key(transport.get_extra_info("socket"))
        if self._open[client] >= self.per_client or len(self._client) >= self.total:
            self._refused[client] += 1
            if self._refused[client] in (1, 100, 10_000):  # the first, then now and then: no flood in the log
                log.warning("%s: refusing connections from %s: at most %d at once per client, %d in all",
                            self.name, client, self.per_client, self.total)
            return False
        self._open[client] += 1
        self._client[transport] = client
        return True

    def _leave(self, transport: asyncio.BaseTransport) -> None:
        client = self._client.pop(transport, None)
        if client is not None:
            self._open[client] -= 1
            if not self._open[client]:
                del self._open[client]
                self._refused.pop(client, None)


class _Admitted(asyncio.Protocol):
    """One connection: handed to the server's own protocol if its client has room, closed
    at once otherwise."""

    def __init__(self, budget: ConnectionBudget, make: Callable[[], asyncio.Protocol]) -> None:
        self._budget = budget
        self._make = make
        self._inner: asyncio.Protocol | None = None  # None: refused
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._budget._admit(transport):
            transport.abort()  # type: ignore[attr-defined]
            return
        self._transport = transport
        self._inner = self._make()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None and self._transport is not None:
            self._budget._leave(self._transport)
            self._inner.connection_lost(exc)


def _client_key(sock: socket.socket | None) -> str:
    """"uid 1001" for a peer on this host, "address 192.0.2.7" (or its /64) otherwise."""
    if sock is None:
        return "unknown"
    try:
        local, peer = sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError:
        return "unknown"
    uid = peer_uid(local, peer)
    if uid is not None:
        return f"uid {uid}"
    address = ipaddress.ip_address(peer[0])
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None  # IPv4Address has none
    if address.version == 6 and mapped is None:
        return f"address {ipaddress.ip_network(f'{address}/64', strict=False)}"
    return f"address {mapped or address}"


class _ClientMistakes(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger: a request that does not parse is logged as one line without
    a traceback (at warning, so the journal's rate limit bounds a flood of them); anything
    else, a fault of ours, keeps its traceback."""

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.logger.warning("%s: a malformed HTTP request (%s): answered %s", self.extra["server"],
                                exc_info.message or type(exc_info).__name__, exc_info.code)
            return
        self.logger.error(msg, *args, exc_info=exc_info, **kwargs)


async def serve(app: web.Application, host: str, port: int, budget: ConnectionBudget, *,
                request_timeout_s: float) -> tuple[web.AppRunner, asyncio.AbstractServer]:
    """Serve `app` on host:port within `budget`; the runner and the listening server, to
    close. Raises OSError (the address is taken) with nothing left behind."""
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=1.0,
        keepalive_timeout=request_timeout_s, max_line_size=MAX_LINE, max_field_size=MAX_LINE,
        max_headers=MAX_HEADERS, lingering_time=1.0,
        handler_cancellation=True,  # a client that goes away ends its handler at once, freeing its place
        logger=_ClientMistakes(logging.getLogger("aiohttp.server"), {"server": budget.name}),
    )
    await runner.setup()
    handler = runner.server
    assert handler is not None
    try:
        server = await asyncio.get_running_loop().create_server(budget.protocol(handler), host, port,
                                                                 reuse_address=True)
    except BaseException:
        await runner.cleanup()
        raise
    return runner, server

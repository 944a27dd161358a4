"""The dashboard's HTTP server: aiohttp on the daemon's own event loop, read-only, with
no login (it shows only what `vaccel status` shows every local user).

What keeps it from ever stalling the lease path: every handler is a short synchronous
read of memory (the report is cached), a slow client is only a coroutine, the request
line and headers are size-limited, a connection that does not finish its request within
IDLE_TIMEOUT_S is closed, at most MAX_CONNECTIONS are open at once (a connection costs
the daemon a file descriptor), and the live streams are bounded (brokerd/addons/web/push.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

from brokerd.addons.web import shapes
from brokerd.addons.web.push import Broadcaster
from brokerd.base.journal import log_event
from brokerd.core.plugins import Reporter
from brokerd.core.service import BrokerService
from vaccel_common.units import parse_duration

log = logging.getLogger("vaccel.brokerd")

MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 15.0  # also bounds a client that trickles its request in
MAX_LINE = 4096  # the request line and each header line
MAX_HEADERS = 64
MAX_REPORT_S = 366 * 86400
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})

_FILES = {"/": ("index.html", "text/html"), "/app.js": ("app.js", "text/javascript"),
          "/style.css": ("style.css", "text/css")}
# The page loads nothing from elsewhere and runs no inline script: text from other users'
# processes (commands, names) can never become code, even if the page had a bug.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def split_listen(listen: str) -> tuple[str, int]:
    """"127.0.0.1:8642" -> ("127.0.0.1", 8642); "[::1]:8642" -> ("::1", 8642)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def _host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8642" -> "[::1]"."""
    header = header.lower()
    if header.startswith("["):
        return header.partition("]")[0] + "]"
    return header.partition(":")[0]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Dashboard:
    def __init__(self, service: BrokerService, listen: str, accounting: Reporter | None = None) -> None:
        self.service = service
        self.host, self.port = split_listen(listen)
        self.reports = shapes.ReportSource(accounting)
        self.push = Broadcaster(lambda: shapes.status(service))
        self._files = {path: (resources.files("brokerd.addons.web").joinpath("static", name).read_bytes(), kind)
                       for path, (name, kind) in _FILES.items()}
        # Served on loopback, only a loopback Host is answered: a web page elsewhere that
        # points its own name at 127.0.0.1 (DNS rebinding) cannot read the dashboard. Any
        # port: an ssh tunnel from a laptop may arrive under another one.
        self._hosts = LOOPBACK_NAMES if _loopback(self.host) else None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.base_events.Server | None = None

    # -- the application ---------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=1024)
        for path in self._files:
            app.router.add_get(path, self._file)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/timeline", self._timeline)
        app.router.add_get("/api/report", self._report)
        app.router.add_get("/events", self.push.stream)
        return app

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"], text="the dashboard is read-only\n")
        if self._hosts is not None and _host_name(request.host) not in self._hosts:
            raise web.HTTPMisdirectedRequest(text="this dashboard answers only to its loopback address\n")
        response = await handler(request)
        if not response.prepared:  # the event stream has sent its own already
            response.headers.update(_HEADERS)
        return response

    async def _file(self, request: web.Request) -> web.Response:
        body, kind = self._files[request.path]
        return web.Response(body=body, content_type=kind, charset="utf-8")

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(shapes.status(self.service))

    async def _timeline(self, request: web.Request) -> web.Response:
        hours = _number(request, "hours", 24.0)
        if not 0 < hours <= shapes.MAX_TIMELINE_HOURS:
            raise web.HTTPBadRequest(text=f"hours must be above 0 and at most {shapes.MAX_TIMELINE_HOURS}\n")
        return web.json_response(shapes.timeline(self.service, hours))

    async def _report(self, request: web.Request) -> web.Response:
        try:
            since_s = parse_duration(request.query.get("since", "7d"))
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"since: {exc}\n") from None
        by = request.query.get("by", "user")
        if by not in shapes.REPORT_BY or not 0 < since_s <= MAX_REPORT_S:
            raise web.HTTPBadRequest(text=f"by is one of {', '.join(shapes.REPORT_BY)}; since at most 366d\n")
        if not self.reports.available():
            raise web.HTTPNotFound(text="accounting not available: this daemon keeps no usage report\n")
        return web.json_response(await self.reports.report(since_s, by))

    # -- serving -----------------------------------------------------------------------

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0,
            keepalive_timeout=IDLE_TIMEOUT_S, max_line_size=MAX_LINE, max_field_size=MAX_LINE,
            max_headers=MAX_HEADERS, lingering_time=1.0,
            handler_cancellation=True,  # a page that goes away ends its stream at once, freeing its place
        )
        await self._runner.setup()
        handler = self._runner.server
        assert handler is not None

        def connection() -> asyncio.BaseProtocol:
            if len(handler.connections) >= MAX_CONNECTIONS:
                return _Refused()
            return handler()

        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(connection, self.host, self.port, reuse_address=True)
        except BaseException:  # the address is taken, say: nothing half-started stays behind
            await self._runner.cleanup()
            self._runner = None
            raise
        log_event("web", f"dashboard on http://{_url_host(self.host)}:{self.port}/", listen=f"{self.host}:{self.port}")

    def changed(self) -> None:
        self.push.changed()

    async def close(self) -> None:
        await self.push.close()
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._server is not None:
            await self._server.wait_closed()


class _Refused(asyncio.Protocol):
    """Over MAX_CONNECTIONS: closed at once, before it costs anything more."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]


def _number(request: web.Request, name: str, default: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number\n") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


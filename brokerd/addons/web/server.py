"""The dashboard's HTTP server: aiohttp on the daemon's own event loop, read-only, with
no login (it shows only what `vaccel status` shows every local user).

What keeps it from ever stalling the lease path, and one client from keeping the others
off: every handler is a short synchronous read of memory (the report is cached, and
waited for at most REPORT_WAIT_S), a slow client is only a coroutine, a request must
arrive whole within IDLE_TIMEOUT_S, at most MAX_CONNECTIONS are open at once and at most
PER_CLIENT_CONNECTIONS of one client (a local user, as the kernel knows them:
brokerd/addons/http_guard.py), and the live streams are bounded in all and per client
(brokerd/addons/web/push.py).

What it shows is what any local user may see (docs/security.md, "Privacy"): the status as
`vaccel status` shows it to a user who is not an admin, and other users' history (the
timeline's past holders, the report's per-user rows) only where the lab made usage
public (`[accounting] per_user_report = "everyone"`): the page has no login, so it
cannot tell an admin from anyone else.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

from brokerd.addons.http_guard import ConnectionBudget, serve, split_listen
from brokerd.addons.web import shapes
from brokerd.addons.web.push import Broadcaster
from brokerd.base.journal import log_event
from brokerd.core.plugins import Reporter
from brokerd.core.service import BrokerService
from brokerd.leasing.errors import Busy
from vaccel_common.units import parse_duration

log = logging.getLogger("vaccel.brokerd")

MAX_CONNECTIONS = 256
PER_CLIENT_CONNECTIONS = 32  # a browser opens 6 per host; a few pages and tabs stay far below
IDLE_TIMEOUT_S = 15.0  # also bounds a client that trickles its request in
REPORT_WAIT_S = 10.0  # the accounting thread may be busy with a year's report for an admin
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
        self.budget = ConnectionBudget("dashboard", per_client=PER_CLIENT_CONNECTIONS, total=MAX_CONNECTIONS)
        self.push = Broadcaster(lambda: shapes.status(service), lambda r: self.budget.client_of(r.transport))
        self._files = {path: (resources.files("brokerd.addons.web").joinpath("static", name).read_bytes(), kind)
                       for path, (name, kind) in _FILES.items()}
        # Served on loopback, only a loopback Host is answered: a web page elsewhere that
        # points its own name at 127.0.0.1 (DNS rebinding) cannot read the dashboard. Any
        # port: an ssh tunnel from a laptop may arrive under another one.
        self._hosts = LOOPBACK_NAMES if _loopback(self.host) else None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None

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
        return web.json_response(shapes.timeline(self.service, hours, personal=shapes.usage_is_public(self.service)))

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
        try:
            async with asyncio.timeout(REPORT_WAIT_S):
                return web.json_response(await self.reports.report(since_s, by))
        except (TimeoutError, Busy):  # Busy: the dashboard's reports are bounded like a user's
            raise web.HTTPServiceUnavailable(text="the usage report is busy; try again shortly\n",
                                             headers={"Retry-After": "10"}) from None

    # -- serving -----------------------------------------------------------------------

    async def start(self) -> None:
        self._runner, self._server = await serve(self.app(), self.host, self.port, self.budget,
                                                 request_timeout_s=IDLE_TIMEOUT_S)
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


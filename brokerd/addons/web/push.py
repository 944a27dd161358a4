"""Server-sent events for the dashboard: every change of the broker's state reaches each
open page as one `status` event carrying the `vaccel status --json` data.

Bounded in every direction a page could push the daemon: a burst of changes becomes at
most MAX_PUSHES_PER_S events (the last state wins), at most MAX_CLIENTS streams are open,
at most MAX_PER_CLIENT of them for one client (a local user, as the kernel knows them:
brokerd/addons/http_guard.py), so one user holding streams open keeps only themselves
off, and a client that does not read its events falls behind by at most QUEUE_SIZE of
them before it is dropped (its browser reconnects by itself) — so no client makes the
daemon buffer without limit or wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

log = logging.getLogger("vaccel.brokerd")

MAX_CLIENTS = 64
MAX_PER_CLIENT = 8  # a person keeps a few tabs open; more is someone holding places
MAX_PUSHES_PER_S = 5
QUEUE_SIZE = 4
KEEPALIVE_S = 15.0  # a comment line now and then: proxies and browsers keep the stream open
WRITE_TIMEOUT_S = 10.0
RETRY_MS = 2000  # what the browser waits before it reconnects


class _Client:
    def __init__(self, task: asyncio.Task[Any], transport: asyncio.BaseTransport | None, who: str) -> None:
        self.task = task
        self.transport = transport
        self.who = who
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_SIZE)

    def drop(self) -> None:
        # abort(), not close(): close() would keep the socket until its unread buffer is
        # sent, which for a client that stopped reading is never. The handler's pending
        # write then fails and the handler ends.
        if self.transport is not None:
            self.transport.abort()


class Broadcaster:
    """`changed()` is cheap and synchronous (it runs inside the service's change feed,
    brokerd/core/changes.py); building the event happens once per push, on the loop, shared
    by every client."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], client_of: Callable[[web.Request], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._snapshot = snapshot
        self._client_of = client_of  # who is asking, for the per-client bound
        self._clock = clock
        self._clients: set[_Client] = set()
        self._scheduled: asyncio.TimerHandle | None = None
        self._last_push = 0.0
        self._closed = False

    @property
    def clients(self) -> int:
        return len(self._clients)

    def changed(self) -> None:
        if not self._clients or self._scheduled is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last_push + 1.0 / MAX_PUSHES_PER_S - self._clock())
        self._scheduled = loop.call_later(delay, self._push)

    def _event(self) -> bytes:
        data = json.dumps(self._snapshot(), separators=(",", ":"))
        return f"event: status\ndata: {data}\n\n".encode()

    def _push(self) -> None:
        self._scheduled = None
        self._last_push = self._clock()
        if not self._clients:
            return
        try:
            event = self._event()
        except Exception:  # a page must never take the change path down with it
            log.exception("dashboard: could not build the status event")
            return
        for client in list(self._clients):
            try:
                client.queue.put_nowait(event)
            except asyncio.QueueFull:
                log.info("dashboard: dropping an events client that does not keep up")
                self._clients.discard(client)
                client.drop()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """GET /events: the current status at once, then one event per change."""
        who = self._client_of(request)
        if self._closed or len(self._clients) >= MAX_CLIENTS:
            raise web.HTTPServiceUnavailable(text=f"at most {MAX_CLIENTS} live pages at once; try again later\n",
                                             headers={"Retry-After": "30"})
        if sum(client.who == who for client in self._clients) >= MAX_PER_CLIENT:
            raise web.HTTPTooManyRequests(text=f"at most {MAX_PER_CLIENT} live pages at once for one user; "
                                               "close one\n", headers={"Retry-After": "30"})
        task = asyncio.current_task()
        assert task is not None
        client = _Client(task, request.transport, who)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no"})
        self._clients.add(client)
        try:
            await response.prepare(request)
            await self._write(response, f"retry: {RETRY_MS}\n\n".encode() + self._event())
            while True:
                try:
                    event = await asyncio.wait_for(client.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    event = b": still here\n\n"
                await self._write(response, event)
        except TimeoutError:
            client.drop()  # stopped reading; its browser reconnects if the page is still open
        except ConnectionError:
            pass  # the page went away
        finally:
            self._clients.discard(client)
        return response

    @staticmethod
    async def _write(response: web.StreamResponse, data: bytes) -> None:
        # write() waits only when the socket's buffer is full: a client that stops reading.
        await asyncio.wait_for(response.write(data), WRITE_TIMEOUT_S)

    async def close(self) -> None:
        """End every stream (at shutdown), so stopping the server does not wait on them."""
        self._closed = True
        if self._scheduled is not None:
            self._scheduled.cancel()
        tasks = [client.task for client in self._clients]
        for client in self._clients:
            client.drop()
            client.task.cancel()  # it may be waiting for an event, not writing
        self._clients.clear()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 1.0)

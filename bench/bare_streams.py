"""The memory reference for bench.scale: a bare grpc.aio server holding W open streams.

A waiting request is an open server stream: what gRPC itself keeps per stream (its call
arena, HTTP/2 stream state, the call's Python objects) is in the daemon's RSS whatever the
broker does. This server does nothing else: each stream gets one small message (a waiter's
first place) and is then held open, as a waiter's is. Its clients are spread over
processes of `per_process` streams each (one channel per process), as bench.scale spreads
its waiters. Its RSS at W streams, read in the same run, is what the daemon's RSS at W
waiters is printed against.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from bench.leases import START_TIMEOUT_S, Bench, BenchError, bare_server_main, end_processes

HOLD_SERVICE = "vaccel.bench.Hold"
HOLD_METHOD = f"/{HOLD_SERVICE}/Hold"


async def _hold(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield request  # the first line, as a waiter's place
    await asyncio.Event().wait()  # then open until the client goes


def _hold_methods() -> tuple[str, dict[str, grpc.RpcMethodHandler]]:
    return HOLD_SERVICE, {"Hold": grpc.unary_stream_rpc_method_handler(_hold)}


def _client_main(path: str, count: int, opened: Any, stop: Any) -> None:
    """Open `count` streams on one channel, read each one's first message, say so, hold."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            hold = channel.unary_stream(HOLD_METHOD)
            calls = [hold(b"waiting for 1 GPU: position 1 of 1") for _ in range(count)]
            for call in calls:
                await call.read()
            opened.put(count)
            while not stop.is_set():
                await asyncio.sleep(0.1)
            for call in calls:
                call.cancel()

    asyncio.run(main())


def rss_by_streams(bench: Bench, counts: list[int], per_process: int, rss_mb: Any, ctx: Any = None) -> dict[int, float]:
    """The bare server's RSS (MB) once it holds each of `counts` streams (ascending); its
    clients start from `ctx` (default the bench's)."""
    path = str(bench.workdir / "bare.sock")
    ctx = ctx or bench.ctx
    ready, stop, opened = bench.ctx.Event(), ctx.Event(), ctx.Queue()
    server = bench.ctx.Process(target=bare_server_main, args=(path, ready, _hold_methods), daemon=True,
                               name="bare-streams")
    server.start()
    clients: list[Any] = []
    out: dict[int, float] = {}
    try:
        if not ready.wait(START_TIMEOUT_S):
            raise BenchError(f"the bare stream server did not start (exit code {server.exitcode})")
        held = 0
        for count in sorted(counts):
            while held < count:
                share = min(per_process, count - held)
                client = ctx.Process(target=_client_main, args=(path, share, opened, stop), daemon=True)
                client.start()
                clients.append(client)
                try:
                    held += opened.get(timeout=START_TIMEOUT_S)
                except Exception:  # queue.Empty
                    raise BenchError(f"bare streams: a client did not open its {share} streams") from None
            time.sleep(0.5)  # as the daemon's window follows its queue's join
            out[count] = rss_mb(server.pid)
    finally:
        stop.set()
        end_processes([*clients, server])
    return out

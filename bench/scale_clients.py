"""bench.scale's client processes: the holder and the waiters (one process and uid each,
asyncio), the Status pollers, and the pipe that drives each from the benchmark.

They are forked from a server that has imported gRPC and the messages already
(`context()`): at 10,000 waiters that is 200 processes, which spawned afresh took
~40 MB and a second of CPU each; forked they share the imported modules.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time
from typing import Any

from bench.leases import Bench, BenchError

WAITERS_PER_CLIENT = 50  # the broker lets one user queue 64 requests
STEP_TIMEOUT_S = 120.0
_PRELOAD = ["asyncio", "grpc", "grpc.aio", "vaccel_common.v1.broker_pb2", "vaccel_common.v1.broker_pb2_grpc",
            "vaccel.session.connection", "bench.scale_clients", "bench.bare_streams"]


def context() -> Any:
    """The multiprocessing context the client processes start from: forked from a server
    that has imported what they use (it never opens a channel, so forking it is safe)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def identity(path: str) -> tuple[tuple[str, str], ...]:
    """A token for this process, minted the way every client gets one."""
    from vaccel.session.connection import BrokerConnection

    from vaccel_common.v1 import broker_pb2 as pb

    conn = BrokerConnection(path)
    conn.call("Status", pb.StatusRequest(), retry_unavailable_s=5)
    metadata = conn.metadata()
    conn.close()
    return metadata


class Client:
    """One client process (one uid): holds leases and keeps them alive, keeps a number of
    Acquire streams waiting; a grant is reported on `grants` and the new lease held, and
    a new waiter takes the granted one's place at the tail."""

    def __init__(self, path: str, control: Any, grants: Any) -> None:
        import grpc

        from vaccel_common.v1 import broker_pb2 as pb
        from vaccel_common.v1 import broker_pb2_grpc

        self.pb = pb
        self.metadata = identity(path)
        self.channel = grpc.aio.insecure_channel(f"unix:{path}", options=[("grpc.enable_retries", 0)])
        self.stub = broker_pb2_grpc.BrokerStub(self.channel)
        self.control = control
        self.grants = grants
        self.held: list[str] = []
        self.tasks: set[asyncio.Future[Any]] = set()
        self.want_waiting = 0
        self.waiting = 0  # streams the broker has queued
        self.joining = 0  # streams started, not queued yet
        self.errors: list[str] = []
        self.changed = asyncio.Event()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def hold(self, lease: Any) -> None:
        self.held.append(lease.id)
        self._spawn(self._beat(lease.id, lease.heartbeat_interval_s or 5.0))

    async def _beat(self, lease_id: str, interval: float) -> None:
        request = self.pb.LeaseRef(lease_id=lease_id)
        while True:
            await asyncio.sleep(interval * random.uniform(0.8, 1.0))
            if lease_id not in self.held:
                return
            try:
                await self.stub.Heartbeat(request, metadata=self.metadata, timeout=10)
            except Exception as exc:
                if lease_id in self.held:  # else released while this beat was on its way
                    self.errors.append(f"heartbeat {lease_id}: {exc!r}")

    async def _acquire(self, report: bool) -> None:
        """One Acquire stream, read to its end (a stream dropped early is a client that left)."""
        request = self.pb.AcquireRequest(gpus=1, wait_forever=True, command="bench.scale")
        self.joining += 1
        queued = False
        try:
            async for update in self.stub.Acquire(request, metadata=self.metadata):
                if update.HasField("granted"):
                    granted_at = time.monotonic()
                    if queued:
                        self.waiting -= 1
                        queued = False
                    else:
                        self.joining -= 1
                    self.hold(update.granted)
                    if report:
                        self.grants.put((os.getpid(), granted_at))
                        self._top_up()
                elif not queued:
                    queued = True
                    self.joining -= 1
                    self.waiting += 1
                self.changed.set()
        except Exception as exc:
            self.errors.append(f"acquire (uid {os.getuid()}, {self.waiting} of its requests queued): {exc!r}")
            self.changed.set()

    def _top_up(self) -> None:
        """Start waiters until `want_waiting` are waiting or on their way."""
        for _ in range(self.want_waiting - self.waiting - self.joining):
            self._spawn(self._acquire(report=True))

    async def _until(self, predicate: Any) -> None:
        while not predicate():
            if self.errors:
                raise BenchError(f"client failed: {self.errors[0]}")
            self.changed.clear()
            await self.changed.wait()

    async def do(self, command: str, arg: Any) -> Any:
        if command == "hold":  # take `arg` devices now: the pool has them free
            want = len(self.held) + arg
            for _ in range(arg):
                self._spawn(self._acquire(report=False))
            await self._until(lambda: len(self.held) >= want)
            return len(self.held)
        if command == "waiters":  # start joining; "counts" tells how far they got
            self.want_waiting = arg
            self._top_up()
            return self.waiting
        if command == "release":  # one held lease back; the monotonic time it was sent
            lease_id = self.held.pop(0)
            start = time.monotonic()
            await self.stub.Release(self.pb.ReleaseRequest(lease_id=lease_id), metadata=self.metadata, timeout=30)
            return start
        if command == "counts":
            return {"held": len(self.held), "waiting": self.waiting, "errors": self.errors[:3]}
        raise ValueError(f"unknown command {command!r}")

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        loop.add_reader(self.control.fileno(), lambda: inbox.put_nowait(self.control.recv()))
        while True:
            command, arg = await inbox.get()
            if command == "stop":
                self.control.send(("ok", self.errors))
                return
            try:
                self.control.send(("ok", await self.do(command, arg)))
            except Exception as exc:
                self.control.send(("error", repr(exc)))


def client_main(path: str, uid: int, control: Any, grants: Any) -> None:
    if uid and os.geteuid() == 0:  # another user: the broker bounds what one user queues
        os.setgid(uid)
        os.setgroups([])
        os.setuid(uid)

    async def main() -> None:
        await Client(path, control, grants).serve()

    asyncio.run(main())


def pollers_main(path: str, count: int, stop: Any, errors: Any) -> None:
    import grpc

    from vaccel_common.v1 import broker_pb2 as pb
    from vaccel_common.v1 import broker_pb2_grpc

    async def main() -> None:
        metadata = identity(path)

        async def poll(i: int) -> None:
            async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
                stub = broker_pb2_grpc.BrokerStub(channel)
                await asyncio.sleep(i / count)  # spread over the second
                while not stop.is_set():
                    try:
                        await stub.Status(pb.StatusRequest(), metadata=metadata, timeout=10)
                    except Exception as exc:
                        errors.put(repr(exc))
                    await asyncio.sleep(1.0)

        await asyncio.gather(*(poll(i) for i in range(count)))

    asyncio.run(main())



class Remote:
    """One client process behind a pipe."""

    def __init__(self, ctx: Any, bench: Bench, path: str, uid: int, grants: Any) -> None:
        self.uid = uid
        self.held = 0
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=client_main, args=(path, uid, child, grants), daemon=True,
                                name=f"scale-client-{uid}")
        self.proc.start()
        bench._children.append(self.proc)

    def send(self, command: str, arg: Any = None) -> None:
        self.conn.send((command, arg))

    def reply(self, command: str, timeout_s: float = STEP_TIMEOUT_S) -> Any:
        if not self.conn.poll(max(0.0, timeout_s)):
            raise BenchError(f"client uid {self.uid} did not answer {command!r} within {max(0.0, timeout_s):.1f} s")
        status, reply = self.conn.recv()
        if status != "ok":
            raise BenchError(f"client uid {self.uid} failed at {command!r}: {reply}")
        return reply

    def ask(self, command: str, arg: Any = None) -> Any:
        self.send(command, arg)
        return self.reply(command)


def ask_all(clients: list[Remote], command: str, args: list[Any], deadline: float) -> list[Any]:
    """Send each client its command at once, then read every reply by `deadline` (monotonic):
    200 processes starting or counting side by side, not one after another."""
    for client, arg in zip(clients, args, strict=True):
        client.send(command, arg)
    return [client.reply(command, deadline - time.monotonic()) for client in clients]

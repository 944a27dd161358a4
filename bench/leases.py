"""Lease benchmark: the real broker side by side with a bare gRPC echo, in one run.

    python -m bench.leases             # the full run (about a minute on 2 cores)
    python bench/leases.py --quick     # a few hundred operations: a smoke run
    python -m bench.leases --json      # the figures as JSON

Both servers listen on a Unix socket in a temp dir and are measured with the same client
model: client *processes* (spawned, never forked, because identity tokens are bound to a
pid) each running threads that share one synchronous gRPC channel. "32 clients" is 4
processes x 8 threads by default, so the clients can use both cores the way 32 real
training scripts would, instead of fighting over one interpreter lock.

- echo: a minimal grpc.aio server (bytes in, bytes out, no protoc), one unary call per op.
- broker: `python -m brokerd` on 64 simulated devices, so 32 clients never queue;
  one op is an acquire as the client library makes it (vaccel/session/acquisition.py: the unary
  TryAcquire, granted at once here) plus Release.
  Its latency figure is the acquire alone; its rate is acquire+release cycles.

The issue's goals: acquire p50 at most 2x the echo p50; at least 1,000 acquire+release
cycles/s with 32 clients. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

import grpc
from vaccel.session.acquisition import Acquisition
from vaccel.session.connection import BrokerConnection

if __package__ in (None, ""):  # run as a script (python bench/leases.py): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.stats import percentile
from vaccel_common.paths import identity_socket
from vaccel_common.v1 import broker_pb2 as pb

ECHO_METHOD = "/vaccel.bench.Echo/Echo"
SIMULATED_DEVICES = 64
ACQUIRE_P50_GOAL = 2.0  # acquire p50 at most this many echo p50s
CYCLES_GOAL = 1000.0  # acquire+release cycles/s with 32 clients
COMMITS_ENV = "VACCEL_BENCH_COMMITS_FILE"
IDLE_PAUSE_S = 0.03  # before each idle echo: bench.handover's default hold
START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 600.0

# The daemon exactly as `python -m brokerd` runs it, plus one hook: at shutdown the
# store's commit counter is written to a file, so the run can show how well grants and
# releases were grouped into SQLite transactions. Nothing on the request path changes.
_BROKER_LAUNCHER = textwrap.dedent("""
    import os, sys
    from brokerd.daemon import main
    from brokerd.state import store
    _close = store.LeaseStore.close
    def _close_and_count(self):
        with open(os.environ["VACCEL_BENCH_COMMITS_FILE"], "w") as f:
            f.write(str(self.commits))
        _close(self)
    store.LeaseStore.close = _close_and_count
    sys.exit(main.main())
""")


class BenchError(RuntimeError):
    """A server or client of the benchmark failed; the message says which and why."""


def print_outcome(measure: Callable[[], dict[str, Any]], render: Callable[[dict[str, Any]], str],
                  as_json: bool) -> int:
    """Run a benchmark and print its figures (JSON or the table); main()'s exit status:
    0, 1 when a server or client failed, 130 on Ctrl-C (everything is cleaned up)."""
    try:
        result = measure()
    except KeyboardInterrupt:
        print("bench: interrupted; servers and temp files cleaned up", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if as_json else render(result))
    return 0


@dataclass(frozen=True)
class Sizes:
    """How many operations each run does."""

    single_ops: int  # ops of the one-client run (latency and 1-client rate)
    ops_per_thread: int  # ops of each thread in the many-client run
    warmup: int  # unmeasured ops per thread before the clock starts


FULL = Sizes(single_ops=3000, ops_per_thread=300, warmup=30)
QUICK = Sizes(single_ops=100, ops_per_thread=8, warmup=3)


@dataclass
class RunResult:
    """One run of N clients: every op's latency and the wall time they took together."""

    ops: int
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ops / self.wall_s if self.wall_s > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        return percentile(self.latencies_s, q) * 1000.0


# -- the echo server (runs in its own process) ------------------------------------------


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def _echo_methods() -> tuple[str, dict[str, grpc.RpcMethodHandler]]:
    return "vaccel.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}


async def _serve_bare(path: str, ready: Any, methods: Callable[[], tuple[str, dict[str, Any]]]) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(*methods()),))
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def bare_server_main(path: str, ready: Any, methods: Callable[[], tuple[str, dict[str, Any]]]) -> None:
    """A grpc.aio server with nothing but `methods()` (service name, handlers) on a Unix
    socket, in a process of its own (a module-level `methods` crosses the spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    asyncio.run(_serve_bare(path, ready, methods))


# -- client operations (run in the client processes) ------------------------------------


def _echo_op(path: str) -> Callable[[], float]:
    """One unary echo call per op; returns its latency."""
    channel = grpc.insecure_channel(f"unix:{path}", options=[("grpc.enable_retries", 0)])
    call = channel.unary_unary(ECHO_METHOD)  # no serializers: bytes in, bytes out
    payload = pb.AcquireRequest(gpus=1, wait_forever=True).SerializeToString()

    def op() -> float:
        start = time.monotonic()
        call(payload, timeout=30)
        return time.monotonic() - start

    return op


def _idle_echo_op(path: str) -> Callable[[], float]:
    """The echo after IDLE_PAUSE_S of silence, as every hand-over comes (bench.handover):
    on these machines waking the idle server and client costs more than the call itself.
    The pause is not counted."""
    echo = _echo_op(path)

    def op() -> float:
        time.sleep(IDLE_PAUSE_S)
        return echo()

    return op


def _broker_op(path: str) -> Callable[[], float]:
    """Acquire one device then release it, the way the client library asks (the unary
    TryAcquire when devices are free, the stream when it must wait); returns the acquire
    latency (up to the grant)."""
    connection = BrokerConnection(path)
    request = pb.AcquireRequest(gpus=1, wait_forever=True, command="bench")  # as a client says

    def op() -> float:
        start = time.monotonic()
        lease = Acquisition(connection, request, None, lambda _line: None).run()
        latency = time.monotonic() - start
        connection.call("Release", pb.ReleaseRequest(lease_id=lease.id), timeout=30)
        return latency

    return op


_OPS: dict[str, Callable[[str], Callable[[], float]]] = {"echo": _echo_op, "echo_idle": _idle_echo_op,
                                                          "broker": _broker_op}


def _client_process_main(kind: str, path: str, threads: int, ops: int, warmup: int,
                         start: Any, results: Any) -> None:
    """Warm up, report ready, wait for the common start, run, report the timings."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        op = _OPS[kind](path)
        ready = threading.Barrier(threads + 1)
        latencies: list[list[float]] = [[] for _ in range(threads)]
        spans: list[tuple[float, float]] = [(0.0, 0.0)] * threads
        errors: list[str] = []

        def run(i: int) -> None:
            try:
                for _ in range(warmup):
                    op()
            except Exception as exc:
                errors.append(f"warm-up: {exc!r}")
                ready.abort()
                return
            ready.wait()
            start.wait()
            began = time.monotonic()
            try:
                latencies[i] = [op() for _ in range(ops)]
            except Exception as exc:
                errors.append(repr(exc))
            spans[i] = (began, time.monotonic())

        workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for w in workers:
            w.start()
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            results.put(("error", os.getpid(), "; ".join(errors) or "a client thread failed"))
            return
        results.put(("ready", os.getpid(), None))
        for w in workers:
            w.join()
        if errors:
            results.put(("error", os.getpid(), "; ".join(errors)))
            return
        flat = [x for per_thread in latencies for x in per_thread]
        results.put(("done", os.getpid(), (min(s for s, _ in spans), max(e for _, e in spans), flat)))
    except Exception as exc:
        results.put(("error", os.getpid(), repr(exc)))


# -- the driver ---------------------------------------------------------------------------


class Bench:
    """Owns every process and temp dir of one benchmark run; `close` ends them all."""

    def __init__(self, processes: int, threads: int, sizes: Sizes) -> None:
        self.ctx: SpawnContext = multiprocessing.get_context("spawn")
        self.processes = processes
        self.threads = threads
        self.sizes = sizes
        self.workdir = Path(tempfile.mkdtemp(prefix="vaccel-bench-", dir="/tmp"))  # short socket paths
        self._children: list[Any] = []
        self._broker: subprocess.Popen[bytes] | None = None
        self._broker_root = self.workdir / "broker"

    @property
    def broker_pid(self) -> int | None:
        return self._broker.pid if self._broker is not None else None

    def close(self) -> None:
        try:
            end_processes(self._children)
            self._children.clear()
            self.stop_broker()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- servers -----------------------------------------------------------------------

    def start_echo(self) -> str:
        path = str(self.workdir / "echo.sock")
        ready = self.ctx.Event()
        server = self.ctx.Process(target=bare_server_main, args=(path, ready, _echo_methods), daemon=True,
                                  name="echo")
        server.start()
        self._children.append(server)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.1):
            if not server.is_alive() or time.monotonic() > deadline:
                raise BenchError(f"the echo server did not start (exit code {server.exitcode})")
        return path

    def start_broker(self, devices: int = SIMULATED_DEVICES, name: str = "broker") -> str:
        """Start the daemon on `devices` simulated devices (one at a time per Bench); its socket."""
        root = self.workdir / name
        root.mkdir()
        self._broker_root = root
        socket_path = root / "brokerd.sock"
        inventory = root / "inventory.yaml"
        inventory.write_text(_inventory_yaml(devices))
        config = root / "brokerd.toml"
        # Defaults except a TTL comfortably above one op, stated so the run is reproducible.
        config.write_text('[leases]\nheartbeat_ttl = "30s"\n[server]\nlog_level = "info"\n')
        command = [sys.executable, "-c", _BROKER_LAUNCHER, "--config", str(config), "--socket", str(socket_path),
                   "--state-dir", str(root / "state"), "--inventory", str(inventory)]
        env = {**os.environ, COMMITS_ENV: str(root / "commits"), "PYTHONUNBUFFERED": "1"}
        env.pop("VACCEL_LEASE_ID", None)
        self._broker_log = root / "brokerd.log"
        with self._broker_log.open("wb") as log:
            # Own session: a Ctrl-C at the terminal reaches us, and we stop the daemon cleanly.
            self._broker = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        id_socket = Path(identity_socket(socket_path))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (socket_path.exists() and id_socket.exists()):
            if self._broker.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the broker did not start:\n{self._broker_log.read_text()[-2000:]}")
            time.sleep(0.02)
        return str(socket_path)

    def broker_log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self._broker_root / "brokerd.log").read_text(errors="replace")[-chars:]
        return ""

    def stop_broker(self) -> int | None:
        """Stop the daemon (SIGTERM, as systemd would); its SQLite commit count, if it wrote one."""
        proc, self._broker = self._broker, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError, ValueError):
            return int((self._broker_root / "commits").read_text())
        return None

    # -- clients -----------------------------------------------------------------------

    def run_clients(self, kind: str, path: str, processes: int, threads: int, ops: int) -> RunResult:
        """`processes` x `threads` clients, each doing `ops` measured ops after a warm-up."""
        start, results = self.ctx.Event(), self.ctx.Queue()
        procs: list[Any] = []
        try:
            for i in range(processes):
                proc = self.ctx.Process(target=_client_process_main, name=f"{kind}-client-{i}", daemon=True,
                                        args=(kind, path, threads, ops, self.sizes.warmup, start, results))
                proc.start()
                procs.append(proc)
                self._children.append(proc)
            self._collect(results, procs, "ready", START_TIMEOUT_S)
            start.set()
            done = self._collect(results, procs, "done", RUN_TIMEOUT_S)
            for p in procs:
                p.join(timeout=5)  # they have reported: only exiting is left
        finally:
            end_processes(procs)
            for p in procs:
                self._children.remove(p)
        began = min(d[0] for d in done)
        ended = max(d[1] for d in done)
        latencies = [x for d in done for x in d[2]]
        return RunResult(ops=len(latencies), wall_s=ended - began, latencies_s=latencies)

    def _collect(self, results: Any, procs: list[Any], what: str, timeout: float) -> list[Any]:
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < len(procs):
            try:
                status, pid, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise BenchError(f"client process {dead[0].name} died (exit code {dead[0].exitcode})") from None
                if time.monotonic() > deadline:
                    raise BenchError(f"clients not {what} after {timeout:.0f}s") from None
                continue
            if status == "error":
                raise BenchError(f"client pid {pid} failed: {payload}")
            if status == what:
                got.append(payload)
        return got


def end_processes(procs: list[Any]) -> None:
    """Terminate what is still running (SIGTERM, then SIGKILL) and reap everything."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _inventory_yaml(count: int) -> str:
    lines = ["devices:"]
    for i in range(count):
        lines += [
            "  - vendor: nvidia",
            "    name: NVIDIA A100-SXM4-80GB",
            f"    uuid: GPU-bench000-0000-0000-0000-{i:012d}",
            f'    pci_bus_id: "0000:{i + 1:02x}:00.0"',
            "    memory_mib: 81920",
            '    compute_capability: "8.0"',
            '    driver_version: "535.54.03"',
            "    memory_bandwidth_gbps: 2039",
        ]
    return "\n".join(lines) + "\n"


# -- the report ---------------------------------------------------------------------------


def _measure(bench: Bench, kind: str, path: str) -> dict[str, RunResult]:
    sizes = bench.sizes
    return {
        "one": bench.run_clients(kind, path, 1, 1, sizes.single_ops),
        "many": bench.run_clients(kind, path, bench.processes, bench.threads, sizes.ops_per_thread),
    }


def run(processes: int, threads: int, sizes: Sizes) -> dict[str, Any]:
    """Measure echo then broker; return the figures (see `render` for their meaning)."""
    bench = Bench(processes, threads, sizes)
    try:
        echo = _measure(bench, "echo", bench.start_echo())
        broker_path = bench.start_broker()
        broker = _measure(bench, "broker", broker_path)
        commits = bench.stop_broker()
    finally:
        bench.close()
    clients = processes * threads
    warmup_cycles = sizes.warmup * (1 + clients)  # every client thread warms up
    cycles = warmup_cycles + broker["one"].ops + broker["many"].ops

    def row(echo_value: float, broker_value: float) -> dict[str, float]:
        ratio = broker_value / echo_value if echo_value else 0.0
        return {"echo": echo_value, "broker": broker_value, "ratio": ratio}

    figures = {
        "p50_ms_1_client": row(echo["one"].percentile_ms(50), broker["one"].percentile_ms(50)),
        "p99_ms_1_client": row(echo["one"].percentile_ms(99), broker["one"].percentile_ms(99)),
        "ops_per_s_1_client": row(echo["one"].rate, broker["one"].rate),
        f"ops_per_s_{clients}_clients": row(echo["many"].rate, broker["many"].rate),
        f"p50_ms_{clients}_clients": row(echo["many"].percentile_ms(50), broker["many"].percentile_ms(50)),
        f"p99_ms_{clients}_clients": row(echo["many"].percentile_ms(99), broker["many"].percentile_ms(99)),
    }
    p50_ratio = figures["p50_ms_1_client"]["ratio"]
    many_rate = figures[f"ops_per_s_{clients}_clients"]["broker"]
    return {
        "clients": {"processes": processes, "threads_per_process": threads, "total": clients,
                    "model": "spawned processes x threads, one synchronous grpc channel per process, "
                             "Unix socket"},
        "ops": {"echo_1": echo["one"].ops, "echo_many": echo["many"].ops,
                "broker_1": broker["one"].ops, "broker_many": broker["many"].ops},
        "cpus": os.cpu_count(),
        "figures": figures,
        "goals": {
            "acquire_p50_at_most_2x_echo_p50": {"value": p50_ratio, "pass": p50_ratio <= ACQUIRE_P50_GOAL},
            "cycles_per_s_32_clients_at_least_1000": {
                "value": many_rate, "pass": clients >= 32 and many_rate >= CYCLES_GOAL},
        },
        "sqlite": None if commits is None else {
            "commits": commits, "grants_and_releases": 2 * cycles,
            "ops_per_commit": 2 * cycles / commits if commits else 0.0,
        },
    }


_LABELS = {
    "p50_ms": "latency p50 (ms)",
    "p99_ms": "latency p99 (ms)",
    "ops_per_s": "ops/s",
}


def _label(key: str) -> str:
    for prefix, text in _LABELS.items():
        if key.startswith(prefix):
            who = key[len(prefix) + 1:].replace("_", " ")
            return f"{text}, {who}"
    return key


def render(result: dict[str, Any]) -> str:
    """The human table: one row per figure, echo and broker side by side, then the goals."""
    c = result["clients"]
    lines = [
        f"vaccel lease benchmark on {result['cpus']} CPU(s); clients = {c['processes']} process(es) x "
        f"{c['threads_per_process']} thread(s) (spawned processes, threads share one sync grpc channel "
        "per process, Unix socket)",
        "op: echo = one unary call; broker = an acquire as the client library makes it, granted at once "
        "(the unary TryAcquire: the latency figure) + Release (the ops/s figure is whole cycles)",
        "",
        f"{'figure':<32}{'echo':>12}{'broker':>12}{'broker/echo':>14}",
    ]
    for key, row in result["figures"].items():
        digits = 3 if "_ms" in key else 0
        lines.append(f"{_label(key):<32}{row['echo']:>12.{digits}f}{row['broker']:>12.{digits}f}"
                     f"{row['ratio']:>13.2f}x")
    goals = result["goals"]
    p50 = goals["acquire_p50_at_most_2x_echo_p50"]
    cyc = goals["cycles_per_s_32_clients_at_least_1000"]
    lines += [
        "",
        f"goal: acquire p50 <= 2x echo p50 ................ {'PASS' if p50['pass'] else 'MISS'} "
        f"({p50['value']:.2f}x)",
        f"goal: >= 1000 acquire+release cycles/s, 32 clients {'PASS' if cyc['pass'] else 'MISS'} "
        f"({cyc['value']:.0f}/s with {c['total']} clients)",
    ]
    sqlite = result["sqlite"]
    if sqlite:
        lines.append(f"sqlite: {sqlite['commits']} commits for {sqlite['grants_and_releases']} grants+releases "
                     f"({sqlite['ops_per_commit']:.1f} per commit; whole broker run incl. warm-up)")
    ops = result["ops"]
    lines.append(f"ops measured: echo {ops['echo_1']} + {ops['echo_many']}, broker {ops['broker_1']} + "
                 f"{ops['broker_many']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.leases", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few hundred operations (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients of the many-client run")
    parser.add_argument("--processes", type=int, default=4, help="client processes they are spread over")
    parser.add_argument("--ops", type=int, default=None,
                        help="measured ops per client thread in the many-client run "
                             f"(default {FULL.ops_per_thread}; one-client run: 10x that)")
    return parser


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C so every subprocess and temp dir is cleaned up."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 1 or args.processes < 1 or args.clients % args.processes:
        print("bench: --clients must be a positive multiple of --processes", file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else FULL
    if args.ops is not None:
        sizes = Sizes(single_ops=10 * args.ops, ops_per_thread=args.ops, warmup=sizes.warmup)
    def measure() -> dict[str, Any]:
        with _terminate_as_exit():
            return run(args.processes, args.clients // args.processes, sizes)

    return print_outcome(measure, render, args.json)


if __name__ == "__main__":
    sys.exit(main())

"""Scale benchmark: a large host at steady state, every device leased, a long queue.

    python -m bench.scale                       # 4 and 64 devices x 10 and 200 waiters (~50 s)
    python -m bench.scale --long                # 10..500 waiters in 5 steps, longer windows (minutes)
    python -m bench.scale --devices 64 --waiters 10,500 --window 10
    python -m bench.scale --json
    python -m bench.scale --accounting-rows 1000,100000,1000000   # accounting's cost (bench/scale_accounting.py)

For each device count a fresh daemon serves that many simulated devices (64: a large
host with MIG slices). One client process (asyncio) takes every device and keeps each
lease alive with heartbeats at the interval the broker asks for; W Acquire streams wait
in the queue, spread over client processes of 50 each, each process another uid (the
broker lets one user queue at most 64 requests; this needs root, and no accounts: the
uids are bare numbers from 61000). A granted waiter's process then holds and heartbeats
that lease and queues a new waiter, so the queue keeps its length. Another process plays
20 clients polling `Status` once a second. At each queue length, in this order:

- daemon CPU: % of one core over a quiet window (heartbeats, pollers, waiting streams);
- daemon RSS (VmRSS) at the end of that window;
- `vaccel status`: the whole CLI process, start to exit (it lists every waiter);
- grant latency to the head waiter: a holder's Release sent -> the head waiter's
  Granted received (the new holder then heartbeats, a new waiter joins the tail).
  Twice: back to back (each release the moment the last grant arrived, while the broker
  still takes in its replacement waiter: a burst of releases), then settled (each release
  once the queue is back at W, after a pause of 50-150 ms: the steady state of the goal).

How long the queue took to reach W is shown too (join s); a length it cannot reach
within --join-budget is a row that says so. Goals (issue 16): CPU <= 10% of one core,
`vaccel status` <= 150 ms, grant <= 5 ms, RSS <= 60 MB; the RSS is printed against a bare
grpc.aio server holding the same number of streams in the same run (x bare). The table ends with how each
figure grows from the fewest to the most waiters and devices. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bare_streams import rss_by_streams
from bench.leases import Bench, BenchError, Sizes, end_processes, print_outcome
from bench.startup import vaccel_command
from bench.stats import median, percentile

POLLERS = 20
CPU_GOAL_PCT = 10.0
STATUS_GOAL_MS = 150.0
GRANT_GOAL_MS = 5.0
WAITERS_PER_CLIENT = 50  # the broker lets one user queue 64 requests
WAITER_UID = 61000  # waiters run as uids 61000, 61001, ... (no account needed) when we are root
RSS_GOAL_MB = 60.0
SETTLE_S = (0.05, 0.15)  # the pause before a settled release (uniform, seconds)
STEP_TIMEOUT_S = 120.0


# -- the client processes: holders, heartbeats, waiters (asyncio) ----------------------------


def _identity(path: str) -> tuple[tuple[str, str], ...]:
    """A token for this process, minted the way every client gets one."""
    from vaccel.session.connection import BrokerConnection

    from vaccel_common.v1 import broker_pb2 as pb

    conn = BrokerConnection(path)
    conn.call("Status", pb.StatusRequest(), retry_unavailable_s=5)
    metadata = conn.metadata()
    conn.close()
    return metadata


class _Client:
    """One client process (one uid): holds leases and keeps them alive, keeps a number of
    Acquire streams waiting; a grant is reported on `grants` and the new lease held, and
    a new waiter takes the granted one's place at the tail."""

    def __init__(self, path: str, control: Any, grants: Any) -> None:
        import grpc

        from vaccel_common.v1 import broker_pb2 as pb
        from vaccel_common.v1 import broker_pb2_grpc

        self.pb = pb
        self.metadata = _identity(path)
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
            self.errors.append(f"acquire: {exc!r}")
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
            return {"held": len(self.held), "waiting": self.waiting, "errors": self.errors[:1]}
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


def _client_main(path: str, uid: int, control: Any, grants: Any) -> None:
    if uid and os.geteuid() == 0:  # another user: the broker bounds what one user queues
        os.setgid(uid)
        os.setgroups([])
        os.setuid(uid)

    async def main() -> None:
        await _Client(path, control, grants).serve()

    asyncio.run(main())


# -- the pollers: 20 clients, Status once a second ----------------------------------------------


def _pollers_main(path: str, count: int, stop: Any, errors: Any) -> None:
    import grpc

    from vaccel_common.v1 import broker_pb2 as pb
    from vaccel_common.v1 import broker_pb2_grpc

    async def main() -> None:
        metadata = _identity(path)

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


# -- the daemon's own figures -------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


class _Remote:
    """One client process behind a pipe."""

    def __init__(self, bench: Bench, path: str, uid: int, grants: Any) -> None:
        self.uid = uid
        self.held = 0
        self.conn, child = bench.ctx.Pipe()
        self.proc = bench.ctx.Process(target=_client_main, args=(path, uid, child, grants), daemon=True,
                                      name=f"scale-client-{uid}")
        self.proc.start()
        bench._children.append(self.proc)

    def send(self, command: str, arg: Any = None) -> None:
        self.conn.send((command, arg))

    def reply(self, command: str) -> Any:
        if not self.conn.poll(STEP_TIMEOUT_S):
            raise BenchError(f"client uid {self.uid} did not answer {command!r} within {STEP_TIMEOUT_S:.0f}s")
        status, reply = self.conn.recv()
        if status != "ok":
            raise BenchError(f"client uid {self.uid} failed at {command!r}: {reply}")
        return reply

    def ask(self, command: str, arg: Any = None) -> Any:
        self.send(command, arg)
        return self.reply(command)


def _status_times(socket_path: str, runs: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("VACCEL_LEASE_ID", "PYTHONDONTWRITEBYTECODE")}
    env["VACCEL_SOCKET"] = socket_path
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([*vaccel_command(), "status"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=60)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise BenchError(f"vaccel status exited {done.returncode}: {done.stderr.decode(errors='replace')}")
    return times


def _open_to_others(bench: Bench) -> None:
    """The waiters run as other users (the broker bounds what one user queues): let them
    reach the socket in the benchmark's private temp dir."""
    for folder in (bench.workdir, *bench.workdir.iterdir()):
        if folder.is_dir() and folder.name != "state":
            os.chmod(folder, 0o755)


def _grant_latency(holders: list[_Remote], waiters: list[_Remote], grants: Any) -> float:
    """Release one lease (from whoever holds one) -> the next grant anywhere."""
    releaser = next(c for c in holders + waiters if c.held > 0)
    released_at = releaser.ask("release")
    releaser.held -= 1
    try:
        pid, granted_at = grants.get(timeout=STEP_TIMEOUT_S)
    except queue.Empty:
        raise BenchError("no waiter was granted the released device") from None
    for c in waiters:
        if c.proc.pid == pid:
            c.held += 1
    return granted_at - released_at


def _settled_grant_latency(holder: _Remote, waiters: list[_Remote], grants: Any, count: int) -> float:
    """A release into the steady state: the queue back at its length (the last grant's
    replacement waiter has joined), then a pause, as releases come on a real host: minutes
    apart, not the moment the last hand-over ends."""
    problem = _wait_queued(waiters, count, STEP_TIMEOUT_S)
    if problem:
        raise BenchError(f"the queue did not settle between grants: {problem}")
    time.sleep(random.uniform(*SETTLE_S))
    return _grant_latency([holder], waiters, grants)


def _wait_queued(waiters: list[_Remote], count: int, budget_s: float) -> str:
    """Wait until `count` requests are queued; "" then, else what went wrong."""
    deadline = time.monotonic() + budget_s
    while True:
        counts = [c.ask("counts") for c in waiters]
        queued = sum(c["waiting"] for c in counts)
        errors = [e for c in counts for e in c["errors"]]
        if errors:
            return f"{queued} of {count} queued, then: {' '.join(errors[0].split())[:240]}"
        if queued >= count:
            return ""
        if time.monotonic() > deadline:
            return f"only {queued} of {count} queued after {budget_s:.0f} s (--join-budget)"
        time.sleep(0.2)


def measure_devices(bench: Bench, devices: int, waiter_counts: list[int], window_s: float, status_runs: int,
                    grants_per_step: int, join_budget_s: float) -> list[dict[str, Any]]:
    path = bench.start_broker(devices=devices, name=f"broker-{devices}")
    pid = bench.broker_pid
    assert pid is not None
    stop, errors, grants = bench.ctx.Event(), bench.ctx.Queue(), bench.ctx.Queue()
    pollers = bench.ctx.Process(target=_pollers_main, args=(path, POLLERS, stop, errors), daemon=True)
    pollers.start()
    bench._children.append(pollers)
    can_switch_users = os.geteuid() == 0
    if can_switch_users:
        _open_to_others(bench)
    holder = _Remote(bench, path, 0, grants)
    waiters: list[_Remote] = []
    rows = []
    try:
        holder.held = holder.ask("hold", devices)
        for count in sorted(waiter_counts):
            per_client = WAITERS_PER_CLIENT if can_switch_users else count
            while len(waiters) * per_client < count:
                waiters.append(_Remote(bench, path, WAITER_UID + len(waiters) if can_switch_users else 0, grants))
            shares = [min(per_client, max(0, count - i * per_client)) for i in range(len(waiters))]
            joined_at = time.monotonic()
            for client, share in zip(waiters, shares, strict=True):
                client.ask("waiters", share)
            problem = _wait_queued(waiters, count, join_budget_s)
            join_s = time.monotonic() - joined_at
            if problem:  # a figure in itself: how far the queue got, and why it stopped
                rows.append({"devices": devices, "waiters": count, "error": problem, "join_s": join_s})
                break
            time.sleep(1.0)  # let the burst of joining settle
            cpu0, t0 = _cpu_seconds(pid), time.monotonic()
            time.sleep(window_s)
            cpu_pct = (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0) * 100.0
            rss = _rss_mb(pid)
            status = _status_times(path, status_runs)
            grant = [_grant_latency([holder], waiters, grants) for _ in range(grants_per_step)]
            settled = [_settled_grant_latency(holder, waiters, grants, count) for _ in range(grants_per_step)]
            rows.append({"devices": devices, "waiters": count, "waiter_uids": len(waiters), "join_s": join_s,
                         "cpu_pct": cpu_pct,
                         "rss_mb": rss, "status_p50_ms": median(status) * 1000.0,
                         "status_p90_ms": percentile(status, 90) * 1000.0,
                         "grant_p50_ms": median(grant) * 1000.0, "grant_p90_ms": percentile(grant, 90) * 1000.0,
                         "grant_settled_p50_ms": median(settled) * 1000.0,
                         "grant_settled_p90_ms": percentile(settled, 90) * 1000.0})
        broken = any("error" in r for r in rows)
        for client in [holder, *waiters]:
            if broken:
                break  # the clients are in an unknown state: the row says what failed
            problems = client.ask("stop")
            if problems:
                raise BenchError(f"client uid {client.uid} saw errors: {problems[:3]}")
        if not errors.empty():
            raise BenchError(f"a status poller failed: {errors.get()}")
    except BenchError as exc:
        raise BenchError(f"{exc}\nthe broker's log ends with:\n{bench.broker_log_tail()}") from None
    finally:
        stop.set()
        pollers.join(timeout=5)
        end_processes([c.proc for c in (holder, *waiters)])
        bench.stop_broker()
    return rows



def run(device_counts: list[int], waiter_counts: list[int], window_s: float, status_runs: int,
        grants: int, join_budget_s: float = 20.0) -> dict[str, Any]:
    bench = Bench(1, 1, Sizes(single_ops=200, ops_per_thread=0, warmup=20))
    rows: list[dict[str, Any]] = []
    try:
        echo = bench.run_clients("echo", bench.start_echo(), 1, 1, 200)
        per_process = WAITERS_PER_CLIENT if os.geteuid() == 0 else max(waiter_counts)  # as the waiters are spread
        bare_rss = rss_by_streams(bench, waiter_counts, per_process, _rss_mb)
        for devices in sorted(device_counts):
            rows += measure_devices(bench, devices, waiter_counts, window_s, status_runs, grants, join_budget_s)
    finally:
        bench.close()
    echo_p50_ms = median(echo.latencies_s) * 1000.0
    for row in (r for r in rows if "error" not in r):
        row["grant_x_echo_p50"] = row["grant_p50_ms"] / echo_p50_ms if echo_p50_ms else 0.0
        row["bare_rss_mb"] = bare_rss.get(row["waiters"], 0.0)
        row["rss_x_bare"] = row["rss_mb"] / row["bare_rss_mb"] if row["bare_rss_mb"] else 0.0
        row["pass"] = {"cpu": row["cpu_pct"] <= CPU_GOAL_PCT, "rss": row["rss_mb"] <= RSS_GOAL_MB,
                       "status": row["status_p50_ms"] <= STATUS_GOAL_MS, "grant": row["grant_p50_ms"] <= GRANT_GOAL_MS,
                       "grant settled": row["grant_settled_p50_ms"] <= GRANT_GOAL_MS}
    return {"cpus": os.cpu_count(), "pollers": POLLERS, "window_s": window_s, "status_runs": status_runs,
            "grants_per_step": grants, "echo_p50_ms": echo_p50_ms, "bare_rss_mb": bare_rss, "rows": rows,
            "growth": _growth(rows)}


_FIGURES = ("cpu_pct", "rss_mb", "status_p50_ms", "grant_p50_ms")


def _growth(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each figure's ratio from the fewest to the most waiters (at the most devices) and
    from the fewest to the most devices (at the most waiters)."""
    rows = [r for r in rows if "error" not in r]
    if not rows:
        return {}
    most_dev = max(r["devices"] for r in rows)
    most_wait = max(r["waiters"] for r in rows)
    out: dict[str, dict[str, float]] = {}
    by_wait = sorted((r for r in rows if r["devices"] == most_dev), key=lambda r: r["waiters"])
    by_dev = sorted((r for r in rows if r["waiters"] == most_wait), key=lambda r: r["devices"])
    for name, series in ((f"waiters {by_wait[0]['waiters']}->{by_wait[-1]['waiters']} at {most_dev} devices", by_wait),
                         (f"devices {by_dev[0]['devices']}->{by_dev[-1]['devices']} at {most_wait} waiters", by_dev)):
        if len(series) > 1:
            out[name] = {f: series[-1][f] / series[0][f] if series[0][f] else 0.0 for f in _FIGURES}
    return out


def render(result: dict[str, Any]) -> str:
    lines = [
        f"scale: every device leased and heartbeating, W waiters queued, {result['pollers']} clients polling "
        f"Status once a second; {result['cpus']} CPU(s); CPU over {result['window_s']:.0f} s windows",
        f"bare gRPC echo p50 in the same run: {result['echo_p50_ms']:.3f} ms; a bare grpc.aio server holding W "
        "streams (bench/bare_streams.py): "
        + ", ".join(f"{mb:.1f} MB at W={w}" for w, mb in result["bare_rss_mb"].items()),
        "",
        f"{'devices':>7}{'waiters':>8}{'join s':>8}{'CPU %':>8}{'RSS MB':>8}{'x bare':>8}{'status p50':>12}{'p90':>8}"
        f"{'grant p50':>11}{'p90':>8}{'x echo':>8}{'settled p50':>13}{'p90':>8}",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['devices']:>7}{r['waiters']:>8}{r['join_s']:>8.1f}  could not queue them: {r['error']}")
            continue
        lines.append(f"{r['devices']:>7}{r['waiters']:>8}{r['join_s']:>8.1f}{r['cpu_pct']:>8.1f}{r['rss_mb']:>8.1f}"
                     f"{r['rss_x_bare']:>7.2f}x"
                     f"{r['status_p50_ms']:>10.1f}ms{r['status_p90_ms']:>6.1f}ms"
                     f"{r['grant_p50_ms']:>9.2f}ms{r['grant_p90_ms']:>6.2f}ms{r['grant_x_echo_p50']:>7.1f}x"
                     f"{r['grant_settled_p50_ms']:>11.2f}ms{r['grant_settled_p90_ms']:>6.2f}ms")
    lines += ["", f"goals: CPU <= {CPU_GOAL_PCT:.0f}%, RSS <= {RSS_GOAL_MB:.0f} MB, vaccel status <= "
              f"{STATUS_GOAL_MS:.0f} ms, grant <= {GRANT_GOAL_MS:.0f} ms (back to back, and settled)"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"  {r['devices']} devices, {r['waiters']} waiters: MISS (could not queue them)")
            continue
        missed = [k for k, ok in r["pass"].items() if not ok]
        lines.append(f"  {r['devices']} devices, {r['waiters']} waiters: "
                     + ("PASS" if not missed else "MISS " + ", ".join(missed)))
    for name, ratios in result["growth"].items():
        lines.append(f"growth, {name}: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise ValueError(text)
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="4,64", help="simulated device counts (default 4,64)")
    parser.add_argument("--waiters", default=None, help="queue lengths (default 10,200; --long 10..500 in 5 steps)")
    parser.add_argument("--window", type=float, default=None, help="CPU window in s (default 2, --long 10)")
    parser.add_argument("--status-runs", type=int, default=None,
                        help="`vaccel status` runs per step (default 3, --long 10)")
    parser.add_argument("--grants", type=int, default=None, help="releases timed per step (default 5, --long 20)")
    parser.add_argument("--join-budget", type=float, default=None,
                        help="seconds the queue may take to reach a length (default 15, --long 120)")
    parser.add_argument("--long", action="store_true", help="more steps, longer windows (several minutes)")
    parser.add_argument("--accounting-rows", metavar="N[,N...]", default=None,
                        help="instead: fill a fresh broker's accounting with N leases of a year and time reports")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.accounting_rows is not None:
        from bench import scale_accounting

        try:
            counts = _ints(args.accounting_rows)
        except ValueError:
            print("bench: --accounting-rows takes positive integers, comma-separated", file=sys.stderr)
            return 2
        return print_outcome(lambda: scale_accounting.run(counts), scale_accounting.render, args.json)
    try:
        devices = _ints(args.devices)
        waiters = _ints(args.waiters or ("10,50,100,250,500" if args.long else "10,200"))
    except ValueError:
        print("bench: --devices and --waiters take positive integers, comma-separated", file=sys.stderr)
        return 2
    window = args.window if args.window is not None else (10.0 if args.long else 2.0)
    status_runs = args.status_runs if args.status_runs is not None else (10 if args.long else 3)
    grants = args.grants if args.grants is not None else (20 if args.long else 5)
    if window <= 0 or status_runs < 1 or grants < 1:
        print("bench: --window, --status-runs and --grants must be positive", file=sys.stderr)
        return 2
    budget = args.join_budget if args.join_budget is not None else (120.0 if args.long else 15.0)
    return print_outcome(lambda: run(devices, waiters, window, status_runs, grants, budget), render, args.json)


if __name__ == "__main__":
    sys.exit(main())

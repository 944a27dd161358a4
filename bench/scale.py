"""Scale benchmark: a large host at steady state, every device leased, a long queue.

    python -m bench.scale                       # 4 and 64 devices x 10 and 200 waiters (~50 s)
    python -m bench.scale --long                # 10..500 waiters in 5 steps, longer windows (minutes)
    python -m bench.scale --devices 4,64 --waiters 10,100,1000,10000   # the queue as it grows (root)
    python -m bench.scale --devices 64 --waiters 10,500 --window 10
    python -m bench.scale --json
    python -m bench.scale --accounting-rows 1000,100000,1000000   # accounting's cost (bench/scale_accounting.py)

For each device count a fresh daemon serves that many simulated devices (64: a large
host with MIG slices). One client process (asyncio) takes every device and keeps each
lease alive with heartbeats at the interval the broker asks for; W Acquire streams wait
in the queue, spread over client processes of 50 each, each process another uid (the
broker lets one user queue at most 64 requests; this needs root, and no accounts: the
uids are bare numbers from 6100000; 10,000 waiters are 200 processes, forked from one
that has imported gRPC: bench/scale_clients.py). A granted waiter's process then holds
and heartbeats that lease and queues a new waiter, so the queue keeps its length. Another
process plays 20 clients polling `Status` once a second. At each queue length, in this order:

- daemon CPU: % of one core over a quiet window (heartbeats, pollers, waiting streams);
- daemon RSS (VmRSS) at the end of that window, and what each waiter beyond the fewest
  added to it (KB/w);
- `vaccel status` and `vaccel run --no-wait --gpus 1 -- true`: whole CLI processes, start
  to exit, as a user who holds and waits for nothing (bench/scale_cli.py); the run is
  refused at once, exit 75, and that refusal is what the user waits for;
- grant latency to the head waiter: a holder's Release sent -> the head waiter's
  Granted received (the new holder then heartbeats, a new waiter joins the tail).
  Twice: back to back (each release the moment the last grant arrived, while the broker
  still takes in its replacement waiter: a burst of releases), then settled (each release
  once the queue is back at W, after a pause of 50-150 ms: the steady state of the goal).

How long the queue took to reach W is shown too (join s: the client processes started
and every request queued); a length it cannot reach within --join-budget (default 15 s
and 10 ms per waiter) is a row that says how far it got and why, and ends that daemon's
steps. Goals (issue 16): CPU <= 10% of one core, `vaccel status` <= 150 ms, grant <= 5 ms,
RSS <= 60 MB; the RSS is printed against a bare grpc.aio server holding the same number of
streams in the same run (x bare). The table ends with how each figure grows from the
fewest to the most waiters and devices, and the machine's load average before and after.
Printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bare_streams import rss_by_streams
from bench.leases import Bench, BenchError, Sizes, end_processes, print_outcome
from bench.scale_cli import EXIT_BUSY, RUN_NO_WAIT, STATUS, bystander, cli_times, cpu_seconds, rss_mb
from bench.scale_clients import STEP_TIMEOUT_S, WAITERS_PER_CLIENT, Remote, ask_all, context, pollers_main
from bench.stats import median, percentile

POLLERS = 20
CPU_GOAL_PCT = 10.0
STATUS_GOAL_MS = 150.0
GRANT_GOAL_MS = 5.0
# Waiters run as uids 6100000, 6100001, ... (no account needed) when we are root: clear of
# bench.lab's users (61001, ...), whose replay may signal every process of its uids.
WAITER_UID = 6_100_000
RSS_GOAL_MB = 60.0
JOIN_BUDGET_S, JOIN_PER_WAITER_S = 15.0, 0.01  # the default --join-budget of a step
SETTLE_S = (0.05, 0.15)  # the pause before a settled release (uniform, seconds)


def _open_to_others(bench: Bench) -> None:
    """The waiters and the bystander run as other users (the broker bounds what one user
    queues): let them reach the socket in the benchmark's private temp dir."""
    for folder in (bench.workdir, *bench.workdir.iterdir()):
        if folder.is_dir() and folder.name != "state":
            os.chmod(folder, 0o755)


def _grant_latency(holders: list[Remote], waiters: list[Remote], grants: Any) -> float:
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


def _settled_grant_latency(holder: Remote, waiters: list[Remote], grants: Any, count: int) -> float:
    """A release into the steady state: the queue back at its length (the last grant's
    replacement waiter has joined), then a pause, as releases come on a real host: minutes
    apart, not the moment the last hand-over ends."""
    problem = _wait_queued(waiters, count, time.monotonic() + STEP_TIMEOUT_S)
    if problem:
        raise BenchError(f"the queue did not settle between grants: {problem}")
    time.sleep(random.uniform(*SETTLE_S))
    return _grant_latency([holder], waiters, grants)


def _wait_queued(waiters: list[Remote], count: int, deadline: float) -> str:
    """Wait until `count` requests are queued, at the latest until `deadline` (monotonic);
    "" then, else what went wrong."""
    queued = 0
    while True:
        try:
            counts = ask_all(waiters, "counts", [None] * len(waiters), max(deadline, time.monotonic() + 5.0))
        except BenchError as exc:
            return f"{queued} of {count} queued, then: {exc}"
        queued = sum(c["waiting"] for c in counts)
        errors = [e for c in counts for e in c["errors"]]
        if errors:
            return f"{queued} of {count} queued, then: {' '.join(errors[0].split())[:240]}"
        if queued >= count:
            return ""
        if time.monotonic() > deadline:
            return f"only {queued} of {count} queued within the --join-budget"
        time.sleep(0.2)


def _join(bench: Bench, ctx: Any, path: str, waiters: list[Remote], grants: Any, count: int,
          budget_s: float) -> str:
    """Start what client processes `count` waiters need and have them queue, all within
    `budget_s`; "" once `count` are queued, else how far it got and why not."""
    deadline = time.monotonic() + budget_s
    switch = os.geteuid() == 0
    per_client = WAITERS_PER_CLIENT if switch else count
    while len(waiters) * per_client < count:
        waiters.append(Remote(ctx, bench, path, WAITER_UID + len(waiters) if switch else 0, grants))
    shares = [min(per_client, max(0, count - i * per_client)) for i in range(len(waiters))]
    try:
        ask_all(waiters, "waiters", shares, deadline)
    except BenchError as exc:
        return f"the {len(waiters)} client processes did not all start within the --join-budget: {exc}"
    return _wait_queued(waiters, count, deadline)


def _step(bench: Bench, pid: int, path: str, holder: Remote, waiters: list[Remote], grants: Any, count: int,
          window_s: float, runs: int, grants_per_step: int) -> dict[str, Any]:
    """The figures at one queue length, the queue at `count`."""
    time.sleep(1.0)  # let the burst of joining settle
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window_s)
    cpu_pct = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0) * 100.0
    rss = rss_mb(pid)
    status = cli_times(path, bench.workdir, STATUS, runs)
    no_wait = cli_times(path, bench.workdir, RUN_NO_WAIT, runs, expect=EXIT_BUSY)
    grant = [_grant_latency([holder], waiters, grants) for _ in range(grants_per_step)]
    settled = [_settled_grant_latency(holder, waiters, grants, count) for _ in range(grants_per_step)]
    return {"waiter_uids": len(waiters), "cpu_pct": cpu_pct, "rss_mb": rss,
            "status_p50_ms": median(status) * 1000.0, "status_p90_ms": percentile(status, 90) * 1000.0,
            "no_wait_p50_ms": median(no_wait) * 1000.0, "no_wait_p90_ms": percentile(no_wait, 90) * 1000.0,
            "grant_p50_ms": median(grant) * 1000.0, "grant_p90_ms": percentile(grant, 90) * 1000.0,
            "grant_settled_p50_ms": median(settled) * 1000.0,
            "grant_settled_p90_ms": percentile(settled, 90) * 1000.0}


def measure_devices(bench: Bench, devices: int, waiter_counts: list[int], window_s: float, status_runs: int,
                    grants_per_step: int, join_budget_s: float | None) -> list[dict[str, Any]]:
    ctx = context()
    path = bench.start_broker(devices=devices, name=f"broker-{devices}")
    pid = bench.broker_pid
    assert pid is not None
    stop, errors, grants = ctx.Event(), ctx.Queue(), ctx.Queue()
    pollers = ctx.Process(target=pollers_main, args=(path, POLLERS, stop, errors), daemon=True)
    pollers.start()
    bench._children.append(pollers)
    if os.geteuid() == 0:
        _open_to_others(bench)
    holder = Remote(ctx, bench, path, 0, grants)
    waiters: list[Remote] = []
    rows = []
    try:
        holder.held = holder.ask("hold", devices)
        for count in sorted(waiter_counts):
            joined_at = time.monotonic()
            budget = join_budget_s if join_budget_s is not None else JOIN_BUDGET_S + JOIN_PER_WAITER_S * count
            problem = _join(bench, ctx, path, waiters, grants, count, budget)
            join_s = time.monotonic() - joined_at
            if problem:  # a figure in itself: how far the queue got, and why it stopped
                rows.append({"devices": devices, "waiters": count, "error": problem, "join_s": join_s,
                             "rss_mb": rss_mb(pid)})
                break
            rows.append({"devices": devices, "waiters": count, "join_s": join_s,
                         **_step(bench, pid, path, holder, waiters, grants, count, window_s, status_runs,
                                 grants_per_step)})
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
        grants: int, join_budget_s: float | None = None) -> dict[str, Any]:
    bench = Bench(1, 1, Sizes(single_ops=200, ops_per_thread=0, warmup=20))
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        echo = bench.run_clients("echo", bench.start_echo(), 1, 1, 200)
        per_process = WAITERS_PER_CLIENT if os.geteuid() == 0 else max(waiter_counts)  # as the waiters are spread
        bare_rss = rss_by_streams(bench, waiter_counts, per_process, rss_mb, context())
        for devices in sorted(device_counts):
            rows += measure_devices(bench, devices, waiter_counts, window_s, status_runs, grants, join_budget_s)
    finally:
        bench.close()
    echo_p50_ms = median(echo.latencies_s) * 1000.0
    for row in (r for r in rows if "error" not in r):
        row["grant_x_echo_p50"] = row["grant_p50_ms"] / echo_p50_ms if echo_p50_ms else 0.0
        row["bare_rss_mb"] = bare_rss.get(row["waiters"], 0.0)
        row["rss_x_bare"] = row["rss_mb"] / row["bare_rss_mb"] if row["bare_rss_mb"] else 0.0
        first = min((r for r in rows if r["devices"] == row["devices"] and "error" not in r),
                    key=lambda r: r["waiters"])
        more = row["waiters"] - first["waiters"]  # what each waiter beyond the fewest adds to the daemon
        row["kb_per_waiter"] = (row["rss_mb"] - first["rss_mb"]) * 1024.0 / more if more else 0.0
        row["pass"] = {"cpu": row["cpu_pct"] <= CPU_GOAL_PCT, "rss": row["rss_mb"] <= RSS_GOAL_MB,
                       "status": row["status_p50_ms"] <= STATUS_GOAL_MS, "grant": row["grant_p50_ms"] <= GRANT_GOAL_MS,
                       "grant settled": row["grant_settled_p50_ms"] <= GRANT_GOAL_MS}
    return {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
            "pollers": POLLERS, "window_s": window_s, "status_runs": status_runs, "cli_uid": bystander(),
            "grants_per_step": grants, "echo_p50_ms": echo_p50_ms, "bare_rss_mb": bare_rss, "rows": rows,
            "growth": _growth(rows)}


_FIGURES = ("cpu_pct", "rss_mb", "status_p50_ms", "no_wait_p50_ms", "grant_p50_ms", "grant_settled_p50_ms")


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
        f"Status once a second; {result['cpus']} CPU(s), load {_load(result['load_before'])} before, "
        f"{_load(result['load_after'])} after; CPU over {result['window_s']:.0f} s windows",
        f"the CLI (status, run --no-wait --gpus 1 -- true: refused, {EXIT_BUSY}) as uid {result['cli_uid']}, "
        f"{result['status_runs']} runs each per step",
        f"bare gRPC echo p50 in the same run: {result['echo_p50_ms']:.3f} ms; a bare grpc.aio server holding W "
        "streams (bench/bare_streams.py): "
        + ", ".join(f"{mb:.1f} MB at W={w}" for w, mb in result["bare_rss_mb"].items()),
        "",
        f"{'devices':>7}{'waiters':>8}{'join s':>8}{'CPU %':>8}{'RSS MB':>8}{'x bare':>8}{'KB/w':>6}"
        f"{'status p50':>12}{'p90':>8}{'no-wait p50':>13}{'p90':>8}{'grant p50':>11}{'p90':>8}{'x echo':>8}"
        f"{'settled p50':>13}{'p90':>8}",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['devices']:>7}{r['waiters']:>8}{r['join_s']:>8.1f}  could not queue them: {r['error']}")
            continue
        lines.append(f"{r['devices']:>7}{r['waiters']:>8}{r['join_s']:>8.1f}{r['cpu_pct']:>8.1f}{r['rss_mb']:>8.1f}"
                     f"{r['rss_x_bare']:>7.2f}x{r['kb_per_waiter']:>6.0f}"
                     f"{r['status_p50_ms']:>10.1f}ms{r['status_p90_ms']:>6.1f}ms"
                     f"{r['no_wait_p50_ms']:>11.1f}ms{r['no_wait_p90_ms']:>6.1f}ms"
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


def _load(loads: tuple[float, ...] | list[float]) -> str:
    return "/".join(f"{x:.1f}" for x in loads)


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
                        help="seconds the queue may take to reach a length (default 15 + 0.01 per waiter, --long 120)")
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
    budget = args.join_budget if args.join_budget is not None else (120.0 if args.long else None)
    return print_outcome(lambda: run(devices, waiters, window, status_runs, grants, budget), render, args.json)


if __name__ == "__main__":
    sys.exit(main())

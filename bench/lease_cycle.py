"""`with lease(): pass`, one cycle (grant, then release), in a process that has imported
grpc and in one that has not, interleaved round by round in one run.

    python -m bench.lease_cycle                 # 6 rounds of 40 cycles per kind, ~30 s on 2 cores
    python -m bench.lease_cycle --rounds 10 --cycles 100
    python -m bench.lease_cycle --json

Anything that imports tensorboard, ray or wandb has imported grpc before its first lease,
so both kinds are what users run. Each round starts a fresh process per kind (its own
interpreter, one warm-up cycle not counted) against one broker on 4 simulated devices
that are free, so no cycle waits. Beside them, in the same run: a bare gRPC echo's p50; a
cycle is two calls (grant, release), so two echoes are its floor before the broker's own
work (identity, the durable commit). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.leases import Bench, BenchError, Sizes, print_outcome
from bench.stats import median, summary_ms

KINDS = {"without grpc imported": "", "with grpc imported": "import grpc\n"}

CHILD = textwrap.dedent("""
    import json, sys, time
    {pre}import vaccel
    with vaccel.lease(gpus=1, on_queue=None):   # warm-up: imports, the first connection
        pass
    took = []
    for _ in range({cycles}):
        start = time.perf_counter()
        with vaccel.lease(gpus=1, on_queue=None):
            pass
        took.append(time.perf_counter() - start)
    print(json.dumps({{"took": took, "grpc": "grpc" in sys.modules}}))
""")


def run(rounds: int, cycles: int) -> dict[str, Any]:
    bench = Bench(1, 1, Sizes(single_ops=0, ops_per_thread=0, warmup=0))
    try:
        echo_p50 = median(bench.run_clients("echo", bench.start_echo(), 1, 1, 500).latencies_s) * 1000.0
        socket_path = bench.start_broker(devices=4)
        env = {k: v for k, v in os.environ.items() if k != "VACCEL_LEASE_ID"}
        env.update(VACCEL_SOCKET=socket_path, PYTHONUNBUFFERED="1")
        took: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(rounds):
            for kind, pre in KINDS.items():
                done = subprocess.run([sys.executable, "-c", CHILD.format(pre=pre, cycles=cycles)], env=env,
                                      capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    raise BenchError(f"{kind}: exited {done.returncode}: {done.stderr[-800:]}")
                reply = json.loads(done.stdout.splitlines()[-1])
                if reply["grpc"] != bool(pre):
                    raise BenchError(f"{kind}: grpc imported = {reply['grpc']}")
                took[kind] += reply["took"]
    finally:
        bench.close()
    figures = {kind: summary_ms(values) for kind, values in took.items()}
    for row in figures.values():
        row["x_echo"] = row["p50_ms"] / echo_p50 if echo_p50 else None
        row["x_two_echoes"] = row["p50_ms"] / (2 * echo_p50) if echo_p50 else None
    with_grpc, without = figures["with grpc imported"]["p50_ms"], figures["without grpc imported"]["p50_ms"]
    return {"rounds": rounds, "cycles": cycles, "echo_p50_ms": echo_p50,
            "figures": figures, "with_over_without": with_grpc / without if without else None}


def render(result: dict[str, Any]) -> str:
    lines = [f"`with lease(): pass`, {result['rounds']} rounds x {result['cycles']} cycles per kind, interleaved",
             f"bare gRPC echo p50 {result['echo_p50_ms']:.3f} ms", "",
             f"{'kind':<26}{'p50 ms':>9}{'p90 ms':>9}{'min ms':>9}{'x echo':>9}{'x 2 echoes':>12}"]
    for kind, row in result["figures"].items():
        lines.append(f"{kind:<26}{row['p50_ms']:>9.2f}{row['p90_ms']:>9.2f}{row['min_ms']:>9.2f}"
                     f"{row['x_echo']:>8.2f}x{row['x_two_echoes']:>11.2f}x")
    lines += ["", f"with grpc / without: {result['with_over_without']:.2f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lease_cycle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="fresh processes per kind (default 6)")
    parser.add_argument("--cycles", type=int, default=40, help="cycles timed in each process (default 40)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.cycles < 1:
        print("bench: --rounds and --cycles must be at least 1", file=sys.stderr)
        return 2
    return print_outcome(lambda: run(args.rounds, args.cycles), render, args.json)


if __name__ == "__main__":
    sys.exit(main())

"""Whole-process benchmark: `vaccel run --gpus 1 -- true` and `vaccel status`, start to
exit, beside what any Python client of the broker pays before doing anything: `python -c
pass`, the client floor (the standard modules `vaccel run` needs plus the generated
protobuf API, which brings protobuf's runtime), and `python -c 'import grpc'` for scale.
Both commands talk to the broker over its identity socket (vaccel_common/side_call.py),
so neither imports grpc.

    python -m bench.startup              # 20 runs of each (about 15 s on 2 cores)
    python -m bench.startup --runs 100   # steadier figures
    python -m bench.startup --json

Every figure is a fresh process, as a user's shell starts it (the `vaccel` console script
beside this interpreter when there is one, else `python -m vaccel.cli`), against a real
daemon on 4 simulated devices that are free, so `vaccel run` never queues. The commands
are interleaved round by round, so a noisy neighbour slows all of them alike.

Goal (issue 16): `vaccel run --gpus 1 -- true` median <= 100 ms; `vaccel status` <= 150 ms.
Single-node Slurm runs `srun --gres=gpu:1 true` in 31-38 ms (the issue's measurement).
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.leases import Bench, BenchError, Sizes, print_outcome
from bench.stats import summary_ms

RUN_GOAL_MS = 100.0
STATUS_GOAL_MS = 150.0
SLURM_MS = 35.0  # srun --gres=gpu:1 true, single node, the 31-38 ms
FLOOR = "client floor (stdlib + protobuf)"


def vaccel_command() -> list[str]:
    """How a user starts `vaccel`: the console script next to this interpreter, if any."""
    script = Path(sys.executable).with_name("vaccel")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vaccel.cli"]


def commands() -> dict[str, list[str]]:
    vaccel = vaccel_command()
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import grpc'": [sys.executable, "-c", "import grpc"],
        FLOOR: [sys.executable, "-c", "import argparse, ctypes, json, signal, socket, subprocess, threading; "
                "import vaccel_common.v1.broker_pb2; import os; os._exit(0)"],
        "vaccel run --gpus 1 -- true": [*vaccel, "run", "-q", "--gpus", "1", "--", "true"],
        "vaccel status": [*vaccel, "status"],
    }


def time_commands(cmds: dict[str, list[str]], runs: int, env: dict[str, str]) -> dict[str, list[float]]:
    """Each command `runs` times, round-robin; wall seconds from spawn to exit."""
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(runs):
        for name, argv in cmds.items():
            start = time.perf_counter()
            done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
            took = time.perf_counter() - start
            if done.returncode != 0:
                raise BenchError(f"{name} exited {done.returncode}: {done.stderr.decode(errors='replace')[-500:]}")
            times[name].append(took)
    return times


def run(runs: int) -> dict[str, Any]:
    bench = Bench(1, 1, Sizes(single_ops=0, ops_per_thread=0, warmup=0))
    try:
        socket_path = bench.start_broker(devices=4)
        # PYTHONDONTWRITEBYTECODE would make every run compile the client from source
        # (~15 ms): an installed client has its bytecode, so measure with it.
        env = {k: v for k, v in os.environ.items() if k not in ("VACCEL_LEASE_ID", "PYTHONDONTWRITEBYTECODE")}
        env["VACCEL_SOCKET"] = socket_path
        cmds = commands()
        time_commands(cmds, 1, env)  # warm the page cache and the daemon
        times = time_commands(cmds, runs, env)
    finally:
        bench.close()
    figures = {name: summary_ms(values) for name, values in times.items()}
    grpc_p50, floor = figures["python -c 'import grpc'"]["p50_ms"], figures[FLOOR]["p50_ms"]
    for row in figures.values():
        row["x_import_grpc"] = row["p50_ms"] / grpc_p50 if grpc_p50 else 0.0
        row["x_floor"] = row["p50_ms"] / floor if floor else 0.0
        row["x_slurm"] = row["p50_ms"] / SLURM_MS
    run_p50 = figures["vaccel run --gpus 1 -- true"]["p50_ms"]
    status_p50 = figures["vaccel status"]["p50_ms"]
    return {
        "runs": runs,
        "cpus": os.cpu_count(),
        "vaccel": cmds["vaccel status"][:-1],
        "figures": figures,
        "goals": {
            "run_median_at_most_100_ms": {"value": run_p50, "pass": run_p50 <= RUN_GOAL_MS},
            "status_median_at_most_150_ms": {"value": status_p50, "pass": status_p50 <= STATUS_GOAL_MS},
        },
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"whole-process start-to-exit, {result['runs']} runs each, interleaved, on {result['cpus']} CPU(s); "
        f"vaccel = {' '.join(result['vaccel'])}",
        "",
        f"{'command':<34}{'p50 ms':>9}{'p90 ms':>9}{'min ms':>9}{'x floor':>9}{'x import grpc':>15}{'x slurm':>9}",
    ]
    for name, row in result["figures"].items():
        lines.append(f"{name:<34}{row['p50_ms']:>9.1f}{row['p90_ms']:>9.1f}{row['min_ms']:>9.1f}"
                     f"{row['x_floor']:>8.2f}x{row['x_import_grpc']:>14.2f}x{row['x_slurm']:>8.2f}x")
    goals = result["goals"]
    run_goal, status_goal = goals["run_median_at_most_100_ms"], goals["status_median_at_most_150_ms"]
    lines += [
        "",
        f"goal: vaccel run median <= 100 ms ..... {'PASS' if run_goal['pass'] else 'MISS'} "
        f"({run_goal['value']:.1f} ms)",
        f"goal: vaccel status median <= 150 ms .. {'PASS' if status_goal['pass'] else 'MISS'} "
        f"({status_goal['value']:.1f} ms)",
        f"x slurm: against srun --gres=gpu:1 true at {SLURM_MS:.0f} ms (issue 16's single-node measurement)",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs of each command (default 20)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.runs < 1:
        print("bench: --runs must be at least 1", file=sys.stderr)
        return 2
    return print_outcome(lambda: run(args.runs), render, args.json)


if __name__ == "__main__":
    sys.exit(main())

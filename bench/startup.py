"""Whole-process benchmark: `vaccel run --gpus 1 -- true` and `vaccel status`, start to
exit, beside the references issue 36 measures them against, in the same run:

- `python -c pass` from the same venv: the interpreter's floor (goal: `vaccel status`
  at most 1.5x it);
- `srun --gres=gpu:1 true` on a real single-node Slurm started for the run
  (bench/testbeds/slurm.py: needs root and slurm-wlm; without them the row says it is
  absent) (goal: `vaccel run` at most 1.0x it);
- for scale: the client floor (the standard modules `vaccel run` needs plus the generated
  protobuf API) and `python -c 'import grpc'`.

    python -m bench.startup              # 20 runs of each (about 20 s on 2 cores, Slurm's start included)
    python -m bench.startup --runs 100   # steadier figures
    python -m bench.startup --json
    python -m bench.startup --baseline /tmp/old-tree   # the same commands from another checkout too

Every figure is a fresh process, as a user's shell starts it (the `vaccel` command beside
this interpreter when there is one, else `python -m vaccel.entry`), against a real daemon
on 4 simulated devices that are free, so `vaccel run` never queues. The commands are
interleaved round by round, so a noisy neighbour slows all of them alike. `vaccel status`
is answered ready-made by the broker (client/vaccel/entry.py); `vaccel run` goes through
the full CLI over the identity socket (vaccel_common/side_call.py), so neither imports grpc.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.leases import Bench, BenchError, Sizes, print_outcome
from bench.stats import summary_ms
from bench.testbeds.slurm import SlurmCluster, missing_programs

PASS = "python -c pass"
SRUN = "srun --gres=gpu:1 true"
RUN = "vaccel run --gpus 1 -- true"
STATUS = "vaccel status"
FLOOR = "client floor (stdlib + protobuf)"
STATUS_GOAL_X_PASS = 1.5
RUN_GOAL_X_SRUN = 1.0


def vaccel_command() -> list[str]:
    """How a user starts `vaccel`: the command next to this interpreter, if any."""
    script = Path(sys.executable).with_name("vaccel")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vaccel.entry"]


def commands(with_srun: bool) -> dict[str, list[str]]:
    vaccel = vaccel_command()
    cmds = {
        PASS: [sys.executable, "-c", "pass"],
        "python -c 'import grpc'": [sys.executable, "-c", "import grpc"],
        FLOOR: [sys.executable, "-c", "import argparse, ctypes, json, signal, socket, subprocess, threading; "
                "import vaccel_common.v1.broker_pb2; import os; os._exit(0)"],
        RUN: [*vaccel, "run", "-q", "--gpus", "1", "--", "true"],
        STATUS: [*vaccel, "status"],
    }
    if with_srun:
        cmds[SRUN] = ["srun", "--gres=gpu:1", "true"]
    return cmds


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster | str]:
    """A started single-node Slurm, or why there is none (the bench then runs without it)."""
    missing = missing_programs()
    if missing:
        yield f"absent: {', '.join(missing)} not installed (slurm-wlm)"
        return
    if os.geteuid() != 0:
        yield "absent: starting the test cluster needs root (device nodes, the munge user)"
        return
    root = Path(tempfile.mkdtemp(prefix="vaccel-bench-startup-"))
    cluster = SlurmCluster(root / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def baseline_commands(tree: Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    """`vaccel run` and `vaccel status` from another checkout (e.g. before a change), with the
    same interpreter and launcher: its client and shared code come first on the path."""
    cmds = commands(with_srun=False)
    label = f" [{tree.name}]"
    return ({RUN + label: cmds[RUN], STATUS + label: cmds[STATUS]},
            {"PYTHONPATH": f"{tree / 'client'}{os.pathsep}{tree}"})


def time_commands(cmds: dict[str, list[str]], runs: int, env: dict[str, str],
                  extra_env: dict[str, dict[str, str]] | None = None) -> dict[str, list[float]]:
    """Each command `runs` times, round-robin; wall seconds from spawn to exit."""
    times: dict[str, list[float]] = {name: [] for name in cmds}
    extra_env = extra_env or {}
    for _ in range(runs):
        for name, argv in cmds.items():
            start = time.perf_counter()
            done = subprocess.run(argv, env={**env, **extra_env.get(name, {})}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=60)
            took = time.perf_counter() - start
            if done.returncode != 0:
                raise BenchError(f"{name} exited {done.returncode}: {done.stderr.decode(errors='replace')[-500:]}")
            times[name].append(took)
    return times


def run(runs: int, baseline: Path | None = None) -> dict[str, Any]:
    bench = Bench(1, 1, Sizes(single_ops=0, ops_per_thread=0, warmup=0))
    try:
        socket_path = bench.start_broker(devices=4)
        with slurm_cluster() as cluster:
            # PYTHONDONTWRITEBYTECODE would make every run compile the client from source
            # (~15 ms): an installed client has its bytecode, so measure with it.
            env = {k: v for k, v in os.environ.items() if k not in ("VACCEL_LEASE_ID", "PYTHONDONTWRITEBYTECODE")
                   and not k.startswith("SLURM_")}
            env["VACCEL_SOCKET"] = socket_path
            if isinstance(cluster, SlurmCluster):
                env["SLURM_CONF"] = str(cluster.conf)
            cmds = commands(with_srun=isinstance(cluster, SlurmCluster))
            extra_env: dict[str, dict[str, str]] = {}
            if baseline is not None:
                old, old_env = baseline_commands(baseline)
                cmds.update(old)
                extra_env = {name: old_env for name in old}
            time_commands(cmds, 1, env, extra_env)  # warm the page cache, the daemon and Slurm
            times = time_commands(cmds, runs, env, extra_env)
            slurm = "started: single node, 4 fake GPUs (bench/testbeds/slurm.py)" if isinstance(cluster, SlurmCluster) \
                else cluster
    finally:
        bench.close()
    figures = {name: summary_ms(values) for name, values in times.items()}
    pass_p50 = figures[PASS]["p50_ms"]
    srun_p50 = figures[SRUN]["p50_ms"] if SRUN in figures else None
    for row in figures.values():
        row["x_pass"] = row["p50_ms"] / pass_p50 if pass_p50 else None
        row["x_srun"] = row["p50_ms"] / srun_p50 if srun_p50 else None
    status_x, run_x = figures[STATUS]["x_pass"], figures[RUN]["x_srun"]
    return {
        "runs": runs,
        "cpus": os.cpu_count(),
        "vaccel": cmds[STATUS][:-1],
        "slurm": slurm,
        "figures": figures,
        "goals": {
            "status_at_most_1.5x_python_pass": {"value": status_x,
                                                "pass": status_x is not None and status_x <= STATUS_GOAL_X_PASS},
            "run_at_most_1.0x_srun": {"value": run_x, "pass": None if run_x is None else run_x <= RUN_GOAL_X_SRUN},
        },
    }


def _ratio(value: float | None) -> str:
    return f"{value:>8.2f}x" if value is not None else f"{'-':>9}"


def render(result: dict[str, Any]) -> str:
    lines = [
        f"whole-process start-to-exit, {result['runs']} runs each, interleaved, on {result['cpus']} CPU(s); "
        f"vaccel = {' '.join(result['vaccel'])}",
        f"slurm: {result['slurm']}",
        "",
        f"{'command':<42}{'p50 ms':>9}{'p90 ms':>9}{'min ms':>9}{'x pass':>9}{'x srun':>9}",
    ]
    for name, row in result["figures"].items():
        lines.append(f"{name:<42}{row['p50_ms']:>9.1f}{row['p90_ms']:>9.1f}{row['min_ms']:>9.1f}"
                     f"{_ratio(row['x_pass'])}{_ratio(row['x_srun'])}")
    goals = result["goals"]
    status_goal, run_goal = goals["status_at_most_1.5x_python_pass"], goals["run_at_most_1.0x_srun"]
    verdict = {True: "PASS", False: "MISS", None: "NOT MEASURED (no srun)"}
    lines += [
        "",
        f"goal: vaccel status <= 1.5x python -c pass ........ {verdict[status_goal['pass']]}"
        + (f" ({status_goal['value']:.2f}x)" if status_goal["value"] is not None else ""),
        f"goal: vaccel run --gpus 1 -- true <= 1.0x srun .... {verdict[run_goal['pass']]}"
        + (f" ({run_goal['value']:.2f}x)" if run_goal["value"] is not None else ""),
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs of each command (default 20)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="also time vaccel run and vaccel status from this checkout (e.g. a git worktree of the "
                             "commit before a change), interleaved with the rest")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.runs < 1:
        print("bench: --runs must be at least 1", file=sys.stderr)
        return 2
    if args.baseline is not None and not (args.baseline / "client" / "vaccel" / "entry.py").is_file():
        print(f"bench: --baseline {args.baseline}: not a vaccel checkout (no client/vaccel/entry.py)", file=sys.stderr)
        return 2
    return print_outcome(lambda: run(args.runs, args.baseline), render, args.json)


if __name__ == "__main__":
    sys.exit(main())

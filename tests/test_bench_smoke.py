"""The lease benchmark runs end to end in its quick mode and prints every figure.

Only the shape of the output is checked, never a timing: figures depend on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"p50_ms_1_client", "p99_ms_1_client", "ops_per_s_1_client", "ops_per_s_32_clients",
           "p50_ms_32_clients", "p99_ms_32_clients"}


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VACCEL_SOCKET", "VACCEL_LEASE_ID")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_quick_json_has_every_figure() -> None:
    before = set(Path("/tmp").glob("vaccel-bench-*"))
    done = _bench("-m", "bench.leases", "--quick", "--json")
    assert done.returncode == 0, done.stderr
    assert set(Path("/tmp").glob("vaccel-bench-*")) <= before, "the run left its temp dir behind"
    result = json.loads(done.stdout)
    assert set(result["figures"]) == FIGURES
    for name, row in result["figures"].items():
        assert row["echo"] > 0 and row["broker"] > 0, name
        assert row["ratio"] == row["broker"] / row["echo"], name
    assert result["clients"] == {**result["clients"], "processes": 4, "threads_per_process": 8, "total": 32}
    assert result["ops"] == {"echo_1": 100, "echo_many": 256, "broker_1": 100, "broker_many": 256}
    goals = result["goals"]
    assert set(goals) == {"acquire_p50_at_most_2x_echo_p50", "cycles_per_s_32_clients_at_least_1000"}
    assert all(isinstance(goal["pass"], bool) for goal in goals.values())
    sqlite = result["sqlite"]
    # Every measured and warm-up cycle is one grant plus one release.
    assert sqlite["grants_and_releases"] == 2 * (100 + 256 + 3 * 33)
    assert 0 < sqlite["commits"] <= sqlite["grants_and_releases"] + 1


def test_quick_table_as_a_script_with_few_clients() -> None:
    done = _bench("bench/leases.py", "--quick", "--clients", "4", "--processes", "2")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for label in ("latency p50 (ms), 1 client", "latency p99 (ms), 1 client", "ops/s, 1 client",
                  "ops/s, 4 clients", "latency p50 (ms), 4 clients"):
        assert label in out
    assert "2 process(es) x 2 thread(s)" in out
    assert "goal: acquire p50 <= 2x echo p50" in out
    # The throughput goal is stated for 32 clients: with 4 it can only be a miss.
    assert "goal: >= 1000 acquire+release cycles/s, 32 clients MISS" in out
    assert "sqlite:" in out and "commits for" in out


def test_rejects_clients_not_divisible_by_processes() -> None:
    done = _bench("-m", "bench.leases", "--clients", "5", "--processes", "2")
    assert done.returncode == 2
    assert "--clients must be a positive multiple of --processes" in done.stderr


def test_startup_benchmark_prints_every_command() -> None:
    done = _bench("-m", "bench.startup", "--runs", "1", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    srun = ["srun --gres=gpu:1 true"] if result["slurm"].startswith("started") else []
    assert set(result["figures"]) == {"python -c pass", "python -c 'import grpc'", "client floor (stdlib + protobuf)",
                                      "vaccel run --gpus 1 -- true", "vaccel status", *srun}
    for name, row in result["figures"].items():
        assert row["n"] == 1 and row["p50_ms"] > 0 and row["x_pass"] > 0, name
    assert set(result["goals"]) == {"status_at_most_1.5x_python_pass", "run_at_most_1.0x_srun"}
    assert (result["goals"]["run_at_most_1.0x_srun"]["value"] is None) == (not srun)


def test_handover_benchmark_prints_each_row() -> None:
    before = set(Path("/tmp").glob("vaccel-bench-*"))
    done = _bench("-m", "bench.handover", "--waiters", "1", "--samples", "2", "--hold", "0.02",
                  "--exit-hold", "0.3", "--whole-hold", "0.3")
    assert done.returncode == 0, done.stderr
    assert set(Path("/tmp").glob("vaccel-bench-*")) <= before, "the run left its temp dir behind"
    out = done.stdout
    assert "bare gRPC echo p50 in the same run" in out and "ms of silence (idle)" in out and "x idle echo" in out
    for row in ("in-process, release, 1 waiting", "in-process, exit, 1 waiting", "of it the kernel's, 1 waiting",
                "whole process, 1 waiting"):
        assert row in out
    kernel_line = next(line for line in out.splitlines() if "of it the kernel's" in line)
    assert float(kernel_line.split()[-5]) > 0, "the kernel's part of an exit was not measured"


def test_handover_rejects_bad_waiters() -> None:
    done = _bench("-m", "bench.handover", "--waiters", "0")
    assert done.returncode == 2
    assert "--waiters takes positive integers" in done.stderr


def test_scale_benchmark_runs_a_tiny_host() -> None:
    done = _bench("-m", "bench.scale", "--devices", "2", "--waiters", "3", "--window", "0.5",
                  "--status-runs", "1", "--grants", "2", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    [row] = result["rows"]
    assert "error" not in row, row
    assert row["devices"] == 2 and row["waiters"] == 3
    assert row["cpu_pct"] >= 0 and row["rss_mb"] > 0 and row["status_p50_ms"] > 0 and row["grant_p50_ms"] > 0
    assert row["grant_settled_p50_ms"] > 0 and row["grant_settled_p90_ms"] >= row["grant_settled_p50_ms"]
    # `vaccel run --no-wait` on the full host: refused (75), and how long the user waited for it.
    assert row["no_wait_p50_ms"] > 0 and row["no_wait_p90_ms"] >= row["no_wait_p50_ms"]
    assert row["kb_per_waiter"] == 0.0  # one step: nothing to compare it with
    assert len(result["load_before"]) == 3 and len(result["load_after"]) == 3
    assert set(row["pass"]) == {"cpu", "rss", "status", "grant", "grant settled"}
    # The memory reference: a bare grpc.aio server holding as many streams, in the same run.
    assert result["bare_rss_mb"]["3"] > 0 and row["bare_rss_mb"] == result["bare_rss_mb"]["3"]
    assert row["rss_x_bare"] == row["rss_mb"] / row["bare_rss_mb"]


def test_scale_benchmark_says_when_the_queue_is_not_reached_within_the_join_budget() -> None:
    done = _bench("-m", "bench.scale", "--devices", "2", "--waiters", "3", "--window", "0.5",
                  "--status-runs", "1", "--grants", "1", "--join-budget", "0.001", "--json")
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)["rows"]
    assert "--join-budget" in row["error"] and row["waiters"] == 3 and row["rss_mb"] > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="a private dockerd needs root")
def test_containers_benchmark_prints_every_figure() -> None:
    # Its own folders only: other benches (bench.lab's vaccel-bench-lab-*) may run meanwhile.
    before = set(Path("/tmp").glob("vaccel-bench-ct-*")) | set(Path("/tmp").glob("vct-*"))
    done = _bench("-m", "bench.containers", "--runs", "1", "--starts", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert set(Path("/tmp").glob("vaccel-bench-ct-*")) | set(Path("/tmp").glob("vct-*")) <= before
    result = json.loads(done.stdout)
    assert set(result["figures"]) == {"docker run --rm IMAGE true", "vaccel run --gpus 1 -- docker run --rm IMAGE true"}
    assert set(result["lease_follows_container"]) == {"bare_start", "grant_to_start", "exit_to_next_grant",
                                                      "kill_to_stopped", "kill_to_next_grant"}
    for row in (*result["figures"].values(), *result["lease_follows_container"].values(), result["engine_start"],
                result["image_import"]):
        assert row["n"] == 1 and row["p50_ms"] > 0
    assert result["leased_x_bare"] > 0
@pytest.mark.skipif(os.geteuid() != 0, reason="a private dockerd needs root")
def test_container_overhead_benchmark_prints_every_command_and_the_breakdown() -> None:
    before = set(Path("/tmp").glob("vaccel-bench-co-*")) | set(Path("/tmp").glob("vaccel-trace-*"))
    done = _bench("-m", "bench.container_overhead", "--runs", "1", "--breakdown", "--json")
    assert done.returncode == 0, done.stderr
    assert set(Path("/tmp").glob("vaccel-bench-co-*")) | set(Path("/tmp").glob("vaccel-trace-*")) <= before
    result = json.loads(done.stdout)
    assert set(result["figures"]) == {
        "docker run --rm IMAGE true", "docker run --rm [vaccel's options] IMAGE true, bare",
        "vaccel run --gpus 1 -- docker run ...", "vaccel run -q --gpus 1 -- docker run ..."}
    assert all(row["n"] == 1 and row["p50_ms"] > 0 and row["x_bare"] > 0 for row in result["figures"].values())
    said = [what for _, what in result["trace"]]
    assert said[0].endswith("exec vaccel") and any("exec docker" in what for what in said)
    assert result["importtime"][0][1] == "(all top-level imports)"


def test_notebook_benchmark_prints_every_figure() -> None:
    done = _bench("-m", "bench.notebook", "--starts", "1", "--ends", "1", "--watch", "1", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for name in ("start_to_lease", "start_to_first_cell", "python_import_torch", "end_to_kernel_stopped",
                 "end_to_restarted_without_lease"):
        assert result[name]["n"] >= 1 and result[name]["p50_ms"] > 0, name
    assert result["leases_or_waits_seen_after_the_end"] == 0 and result["ends"] == 1

"""DDP with 2 gloo ranks under one (hand-made) lease, started by torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from vaccel_common.backends import lease_env

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
    "torchrun"
)

pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")


def torchrun(script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # --standalone: a free rendezvous port, so parallel test runs do not collide.
    return subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(script), *args],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )


def lease_environment(**lease: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VACCEL_")}
    env.update(lease_env(**lease))  # type: ignore[arg-type]
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize(
    "lease",
    [
        {"lease_id": "L-ddp", "backend_name": "cpu", "device_ids": []},
        {"lease_id": "L-ddp", "backend_name": "cuda", "device_ids": ["GPU-a", "GPU-b"],
         "simulated": True},
    ],
    ids=["cpu-lease", "simulated-2-device-lease"],
)
def test_two_gloo_ranks_train_one_model(tmp_path: Path, lease: dict) -> None:
    env = {**lease_environment(**lease), "DDP_OUT": str(tmp_path)}
    result = torchrun(ROOT / "tests" / "accelerator_ddp_worker.py", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["world_size"] == 2
        assert report["lease"] == "L-ddp" and report["device"] == "cpu"
        assert report["wrapped"] and report["backend"] == "gloo"
        assert report["sampler_rank"] == rank and report["batches"] == 8  # 256 / 2 / 16
        assert report["losses"][-1] < 0.5 * report["losses"][0]
        assert report["group_destroyed"]
    # Each rank saw its own half of the data, and the gradients were averaged: both
    # ranks end with the same weights although they started from different ones.
    first_epoch = [set(r["samples_seen"][0]) for r in reports]
    assert not first_epoch[0] & first_epoch[1]
    assert first_epoch[0] | first_epoch[1] == set(range(256))
    # The sampler's epoch advances, so every pass is shuffled afresh.
    assert reports[0]["samples_seen"][0] != reports[0]["samples_seen"][1]
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)


def test_ddp_example_runs_under_a_cpu_lease() -> None:
    env = lease_environment(lease_id="L-ex", backend_name="cpu", device_ids=[])
    result = torchrun(ROOT / "examples" / "train_ddp.py", "--epochs", "2", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("2 ranks on cpu")  # printed by the main rank only, once
    assert sum("epoch 0" in line for line in lines) == 1


UNCLOSED_STEP = ROOT / "tests" / "ddp_unclosed_step.py"


def test_a_script_that_never_closes_its_group_exits_cleanly_every_time() -> None:
    """The group the accelerator started is ended by vaccel at interpreter exit; left to
    the interpreter, gloo aborted a rank now and then (exit 134, pytorch/pytorch#190489)."""
    env = lease_environment(lease_id="L-exit", backend_name="cpu", device_ids=[])
    runs, deadline = 0, time.monotonic() + 60
    while runs < 20 and (runs == 0 or time.monotonic() < deadline):
        result = torchrun(UNCLOSED_STEP, env=env)
        runs += 1
        assert result.returncode == 0, f"run {runs}: " + result.stdout + result.stderr
        assert "terminate called" not in result.stderr
        lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
        assert lines == ["rank 0 of 2 sum 3.0 DistributedDataParallel", "rank 1 of 2 sum 3.0 DistributedDataParallel"]


def test_a_dead_peer_does_not_hold_up_the_exit() -> None:
    # Rank 1 vanishes (no interpreter shutdown, so none of its collectives) right after the
    # group is up; rank 0's exit must not wait on it: no barrier on the way out.
    # (torchrun() gives up after 120 s; a collective with the dead rank would wait 30 minutes.)
    env = lease_environment(lease_id="L-dead", backend_name="cpu", device_ids=[])
    result = torchrun(UNCLOSED_STEP, "--peer-dies", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 of 2 sum 1.0 DistributedDataParallel" in result.stdout

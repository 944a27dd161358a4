"""The examples under real leases from a running daemon (simulated lab server: the
devices are simulated, so the ranks compute on the CPU and say so)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))


def test_example_under_vaccel_run(broker) -> None:
    result = broker.vaccel("run", "--gpus", "1", "--", sys.executable,
                           str(ROOT / "examples" / "train.py"), "--epochs", "2", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "device cpu (cuda)" in result.stdout.splitlines()[-1]
    assert "simulated cuda devices; computing on the CPU" in result.stderr


def test_example_takes_its_own_lease(broker) -> None:
    import subprocess

    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--epochs", "2"],
                            env=broker.env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "device cpu (cuda)" in result.stdout.splitlines()[-1]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_torchrun_ranks_share_one_lease(broker) -> None:
    result = broker.vaccel(
        "run", "--gpus", "2", "--", TORCHRUN, "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_ddp.py"), "--epochs", "1", timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("2 ranks on cuda, rank 0 on cpu")

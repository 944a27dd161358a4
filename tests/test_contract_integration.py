"""Runtime contracts through the real daemon on a simulated mixed host: `vaccel check`,
fail-fast versus waiting, selection, and the kernel-image refusal with a faked torch
arch list (the torch here is a CPU build)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

MIXED_INVENTORY = """\
devices:
  - {vendor: nvidia, name: NVIDIA A100-SXM4-80GB, uuid: GPU-a100, memory_mib: 81920,
     compute_capability: "8.0", driver_version: "535.104.05", memory_bandwidth_gbps: 2039}
  - {vendor: nvidia, name: Tesla T4, uuid: GPU-t4, memory_mib: 15360,
     compute_capability: "7.5", driver_version: "535.104.05", memory_bandwidth_gbps: 320}
  - {vendor: amd, name: AMD Instinct MI250X, uuid: GPU-mi250x, memory_mib: 65536,
     gfx_target: gfx90a, driver_version: "6.7.0", memory_bandwidth_gbps: 1638}
  - {vendor: intel, name: Intel(R) Data Center GPU Max 1550, uuid: GPU-max1550,
     memory_mib: 131072, arch: Xe_HPC, driver_version: "1.3.29735"}
"""
CUDA_ARCHS = "sm_50,sm_60,sm_70,sm_75,sm_80,sm_86,sm_90"


@pytest.fixture
def mixed(start_broker, tmp_path: Path):  # type: ignore[no-untyped-def]
    inventory = tmp_path / "mixed.yaml"
    inventory.write_text(MIXED_INVENTORY)
    broker = start_broker(inventory=inventory)
    broker.env["VACCEL_FAKE_TORCH_ARCHS"] = CUDA_ARCHS
    return broker


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_check_reports_each_device(mixed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec = write(tmp_path / "runtime-spec.yaml",
                 "required_features:\n  - gpu_compute_capability: sm_80\n  - min_memory: 20GiB\n")
    r = mixed.vaccel("check", str(spec))
    assert r.returncode == 0, r.stderr
    assert "[CHECK] GPU compute capability: sm_80 (A100) - OK" in r.stdout
    assert "[ERROR] GPU compute capability: required sm_80, found gfx90a (MI250X)" in r.stdout
    assert "[ERROR] GPU memory: required 20 GiB, found 15 GiB (T4)" in r.stdout


def test_check_unsatisfiable_exits_1_with_a_suggestion(mixed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec = write(tmp_path / "sm90.yaml", "required_features: [{gpu_compute_capability: sm_90}]\n")
    r = mixed.vaccel("check", str(spec))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Result: NOT satisfiable" in r.stdout
    assert "Run on a host with H100/B200, or relax gpu_compute_capability" in r.stdout


def test_bad_file_exits_2_naming_file_line_and_key(mixed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec = write(tmp_path / "typo.yaml", "required_features:\n  - gpu_compute_capabilty: sm_80\n")
    r = mixed.vaccel("check", str(spec))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "typo.yaml:2: required_features[0].gpu_compute_capabilty" in r.stderr
    assert "did you mean 'gpu_compute_capability'?" in r.stderr
    assert "Traceback" not in r.stderr


def test_unsatisfiable_fails_fast_but_busy_waits(mixed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sm90 = write(tmp_path / "sm90.yaml", "required_features: [{gpu_compute_capability: sm_90}]\n")
    # Nothing here could ever satisfy it: had it been queued it would wait until the call's
    # timeout, so an answer at all is the refusal at once (no clock: a loaded machine's CLI
    # start is seconds).
    r = mixed.vaccel("run", "--contract", str(sm90), "--", "true")
    assert r.returncode == 1 and "no device on this host meets the contract" in r.stderr
    sm80 = write(tmp_path / "sm80.yaml", "required_features: [{gpu_compute_capability: sm_80}]\n")
    holder = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--contract", str(sm80),
                               "--", "sleep", "3600"], env=mixed.env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120  # only turns a hang into a failure
        while True:
            status = mixed.vaccel("status", "--json")
            if '"GPU-a100"' in status.stdout and '"leased"' in status.stdout:
                break
            assert time.monotonic() < deadline, "the holder never got its device"
            time.sleep(0.1)
        r = mixed.vaccel("run", "--contract", str(sm80), "--wait", "1s", "--", "true")
        assert r.returncode == 75 and "gave up" in r.stderr, r.stderr
    finally:
        holder.terminate()
        holder.wait(10)


def test_selection_follows_the_contract(mixed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec = write(tmp_path / "spec.yaml", "required_features: [{min_memory: 20GiB}]\n")
    r = mixed.vaccel("run", "--contract", str(spec), "--", "sh", "-c", "echo $VACCEL_DEVICES")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "GPU-a100"  # T4 too small; the others need another torch build


def test_kernel_image_refusal(start_broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    inventory = write(tmp_path / "blackwell.yaml", """\
devices:
  - {vendor: nvidia, name: NVIDIA RTX PRO 6000, uuid: GPU-sm120, memory_mib: 97887,
     compute_capability: "12.0", driver_version: "575.51.03"}
""")
    broker = start_broker(inventory=inventory)
    broker.env["VACCEL_FAKE_TORCH_ARCHS"] = CUDA_ARCHS
    spec = write(tmp_path / "spec.yaml", "required_features: []\n")
    r = broker.vaccel("run", "--contract", str(spec), "--", "true")
    assert r.returncode == 1
    assert "no kernels for sm_120" in r.stderr
    broker.env["VACCEL_FAKE_TORCH_ARCHS"] = CUDA_ARCHS + ",compute_90"
    r = broker.vaccel("check", str(spec))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kernels would JIT from PTX compute_90" in r.stdout

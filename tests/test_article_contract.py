"""The vendor-agnostic article's runtime-spec.yaml and accelerator-config.yaml, as it writes
them with its troubleshooting keys: every key parses and means something checkable, and
`vaccel check` / `vaccel run` take both files on the simulated lab server."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from brokerd.contract import evaluate
from brokerd.contract.accel_config import parse_accelerator_config
from brokerd.contract.located import ContractError
from brokerd.contract.spec import parse_runtime_spec
from brokerd.contract.torch_build import upstream_problem
from tests.mixed_host import A100, CUDA_FACTS, MI250X, requirement
from vaccel_common.backends import lease_env, memory_settings
from vaccel_common.v1 import broker_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
ARTICLE = ROOT / "examples" / "article"
SPEC = (ARTICLE / "runtime-spec.yaml").read_text()
CONFIG = (ARTICLE / "accelerator-config.yaml").read_text()
ROCM_FACTS = replace(CUDA_FACTS, torch_version="2.1.2+rocm5.7", torch_backend="rocm",
                     torch_runtime_version="5.7", kernel_archs=("gfx90a", "gfx942"), ptx_archs=(),
                     distributed_backends=("nccl", "gloo"))
SIMULATED_A100 = replace(A100, simulated=True)


def lines(ev, uuid: str, name: str):  # type: ignore[no-untyped-def]
    return [ln for ln in ev.per_device[uuid] if ln.name == name]


# --- the files parse, every key into a field ---------------------------------------------


def test_the_article_files_parse_with_every_key() -> None:
    spec = parse_runtime_spec(SPEC)
    torch_dep, vision = spec.dependencies
    assert (torch_dep.name, torch_dep.vendor_agnostic_wheel, torch_dep.full_distribution) == (
        "pytorch", True, True)
    assert (vision.vendor_agnostic_wheel, vision.full_distribution) == (False, False)
    assert spec.vendor_agnostic_wheel and spec.full_distribution
    config = parse_accelerator_config(CONFIG)
    assert (config.memory_pool_size_mb, config.use_unified_memory) == (16384, False)
    assert (config.amp_dtype, config.grad_scaler) == ("float16", True)
    assert config.runtime_contract == "./runtime-spec.yaml"


@pytest.mark.parametrize(("text", "message"), [
    ("dependencies:\n  - name: torchvision\n    vendor_agnostic_wheel: true\n",
     "spec.yaml:3: dependencies[0].vendor_agnostic_wheel: applies to pytorch only"),
    ("dependencies:\n  - name: numpy\n    full_distribution: true\n",
     "spec.yaml:3: dependencies[0].full_distribution: applies to pytorch only"),
    ("dependencies:\n  - name: pytorch\n    full_distribution: yes please\n",
     "spec.yaml:3: dependencies[0].full_distribution: expected true or false"),
    ("dependencies:\n  - name: pytorch\n    vendor_agnostic_whl: true\n",
     "did you mean 'vendor_agnostic_wheel'?"),
])
def test_spec_key_errors(text: str, message: str) -> None:
    with pytest.raises(ContractError) as err:
        parse_runtime_spec(text, "spec.yaml")
    assert message in str(err.value)


@pytest.mark.parametrize(("text", "message"), [
    ("amp_config: {backend: apex}\n", "cfg.yaml:1: amp_config.backend: only 'native'"),
    ("rocm_config: {use_unified_memory: sometimes}\n",
     "cfg.yaml:1: rocm_config.use_unified_memory: expected true or false"),
    ("rocm_config: {memory_pool_size_mb: 0}\n", "rocm_config.memory_pool_size_mb: must be positive"),
    ("rocm_config: {use_unified_mem: true}\n", "did you mean 'use_unified_memory'?"),
])
def test_config_key_errors(text: str, message: str) -> None:
    with pytest.raises(ContractError) as err:
        parse_accelerator_config(text, "cfg.yaml")
    assert message in str(err.value)


# --- vendor_agnostic_wheel -----------------------------------------------------------------


@pytest.mark.parametrize("version", ["2.1.0+cu121", "2.1.2+rocm5.7", "2.5.0+xpu", "2.1.0+cpu",
                                     "2.1.0", "2.5.0.dev20240801+cu121", "2.1.0+cpu.cxx11.abi"])
def test_upstream_versions(version: str) -> None:
    assert upstream_problem(version) == ""


@pytest.mark.parametrize(("version", "why"), [
    ("2.1.0a0+32f93b1", "'+32f93b1' is none of the labels"),   # a vendor's container build
    ("2.3.0a0+41361538.nv23.06", "'+41361538.nv23.06'"),
    ("2.4.0a0", "a source build"),
])
def test_forked_or_source_versions(version: str, why: str) -> None:
    assert why in upstream_problem(version)


def test_wheel_must_drive_the_leased_backend() -> None:
    spec = "dependencies: [{name: pytorch, vendor_agnostic_wheel: true}]"
    ev = evaluate(requirement(spec), [A100, MI250X])
    (ok,) = lines(ev, A100.uuid, "PyTorch wheel")
    assert ok.level == "OK" and ok.message == "torch 2.1.0+cu121 is an upstream build that drives cuda (A100)"
    (bad,) = lines(ev, MI250X.uuid, "PyTorch wheel")
    assert bad.level == "ERROR" and "drives cuda only; MI250X needs a build that drives rocm" in bad.message
    ev = evaluate(requirement(spec, facts=ROCM_FACTS), [MI250X])
    assert [ln.level for ln in lines(ev, MI250X.uuid, "PyTorch wheel")] == ["OK"]
    forked = replace(CUDA_FACTS, torch_version="2.1.0a0+32f93b1")
    ev = evaluate(requirement(spec, facts=forked), [A100])
    (line,) = lines(ev, A100.uuid, "PyTorch wheel")
    assert line.level == "ERROR" and "not an upstream PyTorch build" in line.message
    assert A100.uuid not in ev.eligible and not ev.satisfiable
    # Without the key, the same forked build is not judged on its label.
    assert lines(evaluate(requirement("dependencies: [{name: pytorch}]", facts=forked), [A100]),
                 A100.uuid, "PyTorch wheel") == []


# --- full_distribution ---------------------------------------------------------------------


def test_full_distribution_needs_the_backends_collective() -> None:
    spec = "dependencies: [{name: pytorch, full_distribution: true}]"
    ev = evaluate(requirement(spec), [A100])
    assert [(ln.level, ln.message) for ln in lines(ev, A100.uuid, "torch.distributed")] == [
        ("OK", "backend nccl")]
    no_nccl = replace(CUDA_FACTS, distributed_backends=("gloo",))
    ev = evaluate(requirement(spec, facts=no_nccl), [A100])
    (line,) = lines(ev, A100.uuid, "torch.distributed")
    assert line.level == "ERROR" and line.message == "backend nccl missing (has gloo)"
    assert not ev.satisfiable
    stripped = replace(CUDA_FACTS, distributed_available=False, distributed_backends=())
    ev = evaluate(requirement(spec, facts=stripped), [A100])
    assert [ln.level for ln in lines(ev, A100.uuid, "torch.distributed")] == ["ERROR"]


def test_full_distribution_on_a_simulated_device_needs_gloo() -> None:
    cpu_torch = replace(CUDA_FACTS, torch_version="2.13.0+cpu", torch_backend="")
    spec = "dependencies: [{name: pytorch, full_distribution: true}]"
    ev = evaluate(requirement(spec, facts=cpu_torch), [SIMULATED_A100])
    assert [(ln.level, ln.message) for ln in lines(ev, A100.uuid, "torch.distributed")] == [
        ("OK", "backend gloo")]
    ev = evaluate(requirement(spec, facts=replace(cpu_torch, distributed_available=False)),
                  [SIMULATED_A100])
    assert [ln.level for ln in lines(ev, A100.uuid, "torch.distributed")] == ["ERROR"]


# --- rocm_config -----------------------------------------------------------------------------


def test_memory_section_on_its_backends_devices() -> None:
    ev = evaluate(requirement(config=CONFIG, facts=ROCM_FACTS), [MI250X])
    (pool,) = lines(ev, MI250X.uuid, "Memory pool")
    assert pool.level == "OK"
    assert pool.message.startswith("16 GiB of 64 GiB (MI250X): VACCEL_MEMORY_CAP_MIB=16384")
    assert "PYTORCH_HIP_ALLOC_CONF" in pool.message
    (unified,) = lines(ev, MI250X.uuid, "Unified memory")
    assert (unified.level, unified.message) == ("OK", "off (HSA_XNACK left as the host sets it; MI250X)")
    on = evaluate(requirement(config="rocm_config: {use_unified_memory: true}", facts=ROCM_FACTS),
                  [MI250X, replace(MI250X, uuid="GPU-mi100", arch="gfx908", name="AMD Instinct MI100")])
    assert [ln.level for ln in lines(on, MI250X.uuid, "Unified memory")] == ["OK"]
    assert "HSA_XNACK=1" in lines(on, MI250X.uuid, "Unified memory")[0].message
    assert [ln.level for ln in lines(on, "GPU-mi100", "Unified memory")] == ["WARN"]
    too_big = evaluate(requirement(config="rocm_config: {memory_pool_size_mb: 70000}",
                                   facts=ROCM_FACTS), [MI250X])
    (line,) = lines(too_big, MI250X.uuid, "Memory pool")
    assert line.level == "ERROR" and "at most 65536" in line.suggestion
    assert not too_big.satisfiable


def test_memory_section_is_not_applicable_elsewhere() -> None:
    ev = evaluate(requirement(config=CONFIG), [A100])
    (line,) = lines(ev, A100.uuid, "rocm_config")
    assert line.level == "INFO"
    assert line.message == ("not applicable to cuda (A100): memory_pool_size_mb and "
                            "use_unified_memory apply to rocm leases only")
    assert ev.satisfiable and ev.eligible == (A100.uuid,)
    assert ev.warnings_for([A100.uuid]) == ()


def test_memory_section_sets_the_lease_environment() -> None:
    assert memory_settings(CONFIG, "rocm") == (16384, False)
    assert memory_settings(CONFIG, "cuda") == (0, False)
    assert memory_settings("", "rocm") == (0, False)
    unified = "rocm_config: {memory_pool_size_mb: 8192, use_unified_memory: true}"
    pool, on = memory_settings(unified, "rocm")
    env = lease_env(lease_id="L1", backend_name="rocm", device_ids=["0"], memory_pool_mib=pool,
                    unified_memory=on)
    assert env["VACCEL_MEMORY_CAP_MIB"] == "8192" and env["HSA_XNACK"] == "1"
    capped = lease_env(lease_id="L1", backend_name="rocm", device_ids=["0"], memory_cap_mib=4096,
                       memory_pool_mib=pool, unified_memory=on)
    assert capped["VACCEL_MEMORY_CAP_MIB"] == "4096"  # the daemon's cap is never raised
    cuda = lease_env(lease_id="L1", backend_name="cuda", device_ids=["GPU-1"], memory_pool_mib=pool,
                     unified_memory=on)
    assert "VACCEL_MEMORY_CAP_MIB" not in cuda and "HSA_XNACK" not in cuda


# --- amp_config ------------------------------------------------------------------------------


def test_amp_line_says_what_the_accelerator_does() -> None:
    ev = evaluate(requirement(config=CONFIG), [A100])
    amp = [ln for ln in ev.host_checks if ln.name == "AMP"]
    assert [(ln.level, ln.message) for ln in amp] == [
        ("OK", "native torch.amp autocast float16, GradScaler on (accelerator-config.yaml)")]
    off = evaluate(requirement(config="amp_config: {backend: native, dtype: float16, "
                               "grad_scaler: false}"), [A100])
    assert [ln.message for ln in off.host_checks if ln.name == "AMP"] == [
        "native torch.amp autocast float16, GradScaler off (grad_scaler: false) "
        "(accelerator-config.yaml)"]


def test_amp_config_drives_the_accelerator(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from vaccel.accelerator import Accelerator

    config = tmp_path / "accelerator-config.yaml"
    env = {**lease_env(lease_id="L-cpu", backend_name="cpu", device_ids=[]),
           "VACCEL_ACCELERATOR_CONFIG": str(config)}
    config.write_text(CONFIG)
    acc = Accelerator(env=env)
    assert acc.amp.dtype == "float16" and acc.scaler is not None
    config.write_text(CONFIG.replace("grad_scaler: true", "grad_scaler: false"))
    acc = Accelerator(env=env)
    assert acc.amp.dtype == "float16" and acc.scaler is None
    config.write_text(CONFIG.replace("backend: native", "backend: apex"))
    with pytest.raises(ValueError, match=r"amp_config\.backend 'apex' is not supported"):
        Accelerator(env=env)


# --- the report's shape ------------------------------------------------------------------------


def test_report_ends_in_success_only_when_nothing_failed() -> None:
    from vaccel.contract.report import render_check, render_line

    info = pb.CheckLine(level="INFO", name="rocm_config", message="not applicable")
    assert render_line(info) == "[INFO] rocm_config: not applicable"
    ok = pb.CheckLine(level="OK", name="GPU memory", message="80 GiB (A100)")
    warn = pb.CheckLine(level="WARN", name="Kernel image", message="JIT")
    passed = pb.CheckReply(satisfiable=True, host_checks=[ok],
                           devices=[pb.DeviceCheck(eligible=True, checks=[info])])
    assert render_check(passed).splitlines()[-1] == \
        "[SUCCESS] All checks passed. Environment is compatible."
    passed.host_checks.append(warn)
    assert render_check(passed).splitlines()[-1] == \
        "[SUCCESS] All checks passed. Environment is compatible (1 warning(s) above)."
    err = pb.CheckLine(level="ERROR", name="GPU memory", message="too small", suggestion="x")
    partly = pb.CheckReply(satisfiable=True, host_checks=[ok],
                           devices=[pb.DeviceCheck(eligible=False, checks=[err])])
    assert "[SUCCESS]" not in render_check(partly)


# --- through the daemon on the simulated lab server ------------------------------------------


def installed_pins(tmp_path: Path) -> Path:
    """The article's two files with the pins moved to what this environment has (torch
    2.13 here, no torchvision): everything else as the article writes it."""
    torch = pytest.importorskip("torch")
    release = torch.__version__.split("+")[0]
    major, minor = (int(x) for x in release.split(".")[:2])
    spec = re.sub(r"version_range: 2\.1\.0,2\.2\.0", f"version_range: {major}.{minor}.0,{major}.{minor + 1}.0",
                  SPEC)
    spec = spec[:spec.index("  - name: torchvision")]
    (tmp_path / "runtime-spec.yaml").write_text(spec)
    (tmp_path / "accelerator-config.yaml").write_text(CONFIG)
    return tmp_path


def test_check_of_the_article_files_as_written(broker) -> None:  # type: ignore[no-untyped-def]
    r = broker.vaccel("check", str(ARTICLE / "runtime-spec.yaml"), "--config",
                      str(ARTICLE / "accelerator-config.yaml"))
    # Accepted (a bad file exits 2); not satisfiable here: this torch is not 2.1.x and
    # torchvision is missing, which the report says with what to do.
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert "[CHECK] GPU compute capability: sm_80 (A100) - OK" in out
    assert "[CHECK] Memory bandwidth: 2039 GB/s (A100) - OK" in out
    assert "[CHECK] Driver version: 535.54.03 (A100) - OK" in out
    # The Python checked is the first python3 on PATH (this venv's): the lines name it.
    python = r.stderr.split("vaccel: contract checked against ", 1)[1].split(" (torch ", 1)[0]
    assert any(ln.startswith("[ERROR] PyTorch version: ") and f"— suggestion: {python} -m pip install" in ln
               for ln in out)
    assert f"Suggestion: {python} -m pip install 'torchvision<0.17.0,>=0.16.0', or run the job with a Python " \
           "that has it" in out
    assert not any("[SUCCESS]" in ln for ln in out)


def test_check_passes_with_the_installed_pins(broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    files = installed_pins(tmp_path)
    r = broker.vaccel("check", str(files / "runtime-spec.yaml"), "--config",
                      str(files / "accelerator-config.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert re.search(r"^\[CHECK\] PyTorch wheel: torch \S+ is an upstream build that drives cpu "
                     r"\(A100, simulated: computes on the CPU\) - OK$", r.stdout, re.MULTILINE)
    assert "[CHECK] torch.distributed: backend gloo - OK" in out
    assert ("[INFO] rocm_config: not applicable to cuda (A100): memory_pool_size_mb and "
            "use_unified_memory apply to rocm leases only") in out
    assert any(ln.startswith("[CHECK] AMP: native torch.amp autocast float16, GradScaler on")
               for ln in out)
    # Two of the four lab devices fall short of 2000 GB/s: satisfiable, but not "all passed".
    assert "Result: satisfiable (2 of 4 device(s) eligible)" in out
    assert not any("[SUCCESS]" in ln for ln in out)
    one = broker.vaccel("check", str(files / "runtime-spec.yaml"), "--config",
                        str(files / "accelerator-config.yaml"), "--json")
    reply = json.loads(one.stdout)
    assert one.returncode == 0 and reply["satisfiable"] is True


def test_check_success_line_on_a_host_that_meets_everything(start_broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fast = tmp_path / "a100s.yaml"
    fast.write_text("devices:\n" + "".join(
        f"  - {{vendor: nvidia, name: NVIDIA A100-SXM4-80GB, uuid: GPU-a100-{i}, memory_mib: 81920,\n"
        f"     compute_capability: \"8.0\", driver_version: \"535.54.03\", memory_bandwidth_gbps: 2039}}\n"
        for i in range(2)))
    broker = start_broker(inventory=fast)
    files = installed_pins(tmp_path)
    r = broker.vaccel("check", str(files / "runtime-spec.yaml"), "--config",
                      str(files / "accelerator-config.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "[SUCCESS] All checks passed. Environment is compatible."


def test_run_with_the_article_files(broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    files = installed_pins(tmp_path)
    probe = ("import os, vaccel; a = vaccel.init_accelerator(); "
             "print(a.amp.dtype, a.scaler is not None, os.environ.get('HSA_XNACK'), "
             "os.environ.get('VACCEL_MEMORY_CAP_MIB'))")
    r = broker.vaccel("run", "--contract", str(files / "runtime-spec.yaml"), "--config",
                      str(files / "accelerator-config.yaml"), "--", sys.executable, "-c", probe)
    assert r.returncode == 0, r.stdout + r.stderr
    # amp_config drives the accelerator; rocm_config sets nothing on these cuda devices.
    assert r.stdout.strip().splitlines()[-1] == "float16 True None None"


def test_run_applies_the_memory_section_on_its_backend(start_broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    inventory = tmp_path / "amd.yaml"
    inventory.write_text("devices:\n  - {vendor: amd, name: AMD Instinct MI250X, uuid: GPU-mi250x, "
                         "memory_mib: 65536, gfx_target: gfx90a, driver_version: \"6.7.0\"}\n")
    broker = start_broker(inventory=inventory)
    config = tmp_path / "accelerator-config.yaml"
    config.write_text("rocm_config:\n  memory_pool_size_mb: 16384\n  use_unified_memory: true\n")
    probe = "import os; print(os.environ.get('HSA_XNACK'), os.environ.get('VACCEL_MEMORY_CAP_MIB'))"
    r = broker.vaccel("run", "--config", str(config), "--", sys.executable, "-c", probe)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "1 16384"

"""The per-device and host-wide checks against a simulated mixed host
(A100 sm_80, T4 sm_75, MI250X gfx90a, Intel Max 1550 Xe_HPC)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from brokerd.contract import ClientFacts, evaluate
from brokerd.contract.checks import short_name
from tests.mixed_host import A100, CUDA_FACTS, MAX1550, MI250X, MIXED, T4, gpu, requirement

EXAMPLE_SPEC = (Path(__file__).resolve().parent / "fixtures" / "pinned-runtime-spec.yaml").read_text()
SM80 = "required_features: [{gpu_compute_capability: sm_80}]"
ANY = "required_features: []"  # a contract that asks for nothing but makes torch checks bind


def lines_of(evaluation, uuid: str, name: str):  # type: ignore[no-untyped-def]
    return [ln for ln in evaluation.per_device[uuid] if ln.name == name]


def test_example_contract_on_the_mixed_host() -> None:
    ev = evaluate(requirement(EXAMPLE_SPEC), MIXED)
    assert ev.eligible == (A100.uuid,)
    assert ev.satisfiable and ev.reason == ""
    assert {ln.level for ln in ev.per_device[A100.uuid]} == {"OK"}
    cap = lines_of(ev, MI250X.uuid, "GPU compute capability")[0]
    assert (cap.level, cap.message) == ("ERROR", "required sm_80, found gfx90a (MI250X)")
    assert cap.suggestion == "run on a host with A100/H100, or relax gpu_compute_capability"
    t4 = {ln.name: ln for ln in ev.per_device[T4.uuid]}
    assert t4["GPU memory"].message == "required 20 GiB, found 15 GiB (T4)"
    assert t4["Driver version"].message == "required >= 535.54.03, found 525.60.13 (T4)"
    assert t4["Memory bandwidth"].level == "ERROR"
    # A plain driver minimum next to an NVIDIA capability is NVIDIA's numbering only.
    assert lines_of(ev, MI250X.uuid, "Driver version") == []
    host = {ln.name: ln for ln in ev.host_checks}
    assert host["PyTorch version"].message == "2.1.0+cu121 (matches 2.1.0,2.2.0)"
    assert host["torchvision version"].level == "OK"


def test_unsatisfiable_contract_fails_with_a_suggestion() -> None:
    host = (T4, gpu(T4, 4))
    ev = evaluate(requirement(SM80), host)
    assert not ev.satisfiable and ev.eligible == ()
    assert ev.reason == ("no device on this host meets the contract; GPU compute capability: "
                         "required sm_80, found sm_75 (T4)")
    assert ev.suggestions[0] == ("needs sm_80; this host has 2x T4 (sm_75). Run on a host with "
                                 "A100/H100, or relax gpu_compute_capability")


def test_memory_need_comes_from_request_or_spec() -> None:
    ev = evaluate(requirement(gpus=1, min_memory_mib=100 * 1024, facts=ClientFacts()), MIXED)
    assert ev.eligible == (MAX1550.uuid,) and ev.satisfiable
    assert lines_of(ev, A100.uuid, "GPU memory")[0].level == "ERROR"
    huge = evaluate(requirement("required_features: [{min_memory: 1TiB}]"), MIXED)
    assert not huge.satisfiable and "GPU memory" in huge.reason


def test_kernel_image_ptx_jit_is_a_warning() -> None:
    cu118 = replace(CUDA_FACTS, torch_version="2.1.0+cu118", torch_runtime_version="11.8",
                    kernel_archs=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86"),
                    ptx_archs=("compute_86",))
    h100 = replace(A100, uuid="GPU-h100", name="NVIDIA H100 80GB HBM3", arch="sm_90",
                   compute_capability="9.0")
    ev = evaluate(requirement(facts=cu118), [h100])
    line = lines_of(ev, h100.uuid, "Kernel image")[0]
    assert line.level == "WARN"
    assert line.message == ("torch 2.1.0+cu118 carries sm_50..sm_86 and PTX compute_86; H100 is "
                            "sm_90: kernels would JIT from PTX compute_86 (slow first run)")
    assert ev.eligible == (h100.uuid,) and ev.satisfiable
    assert line in ev.warnings_for([h100.uuid])


def test_kernel_image_missing_is_a_refusal() -> None:
    rtx = replace(A100, uuid="GPU-5090", name="NVIDIA GeForce RTX 5090", arch="sm_120",
                  compute_capability="12.0", memory_mib=32607)
    facts = replace(CUDA_FACTS, ptx_archs=())
    ev = evaluate(requirement(ANY, facts=facts), [rtx])
    line = lines_of(ev, rtx.uuid, "Kernel image")[0]
    assert line.level == "ERROR"
    assert line.message.startswith("no kernels for sm_120 (RTX 5090): torch 2.1.0+cu121 carries")
    assert "compiled for sm_120" in line.suggestion
    assert not ev.satisfiable and "no kernels for sm_120" in ev.reason


def test_binary_compatible_minor_is_ok() -> None:
    a40 = replace(A100, uuid="GPU-a40", name="NVIDIA A40", arch="sm_86")
    facts = replace(CUDA_FACTS, kernel_archs=("sm_70", "sm_80"), ptx_archs=())
    line = lines_of(evaluate(requirement(facts=facts), [a40]), a40.uuid, "Kernel image")[0]
    assert line.level == "OK" and "runs its sm_80 kernels on sm_86" in line.message


def test_cpu_only_torch_asking_for_a_gpu() -> None:
    cpu_facts = ClientFacts(python_version="3.11.2", torch_version="2.13.0+cpu",
                            torch_backend="", distributed_available=True,
                            distributed_backends=("gloo",))
    ev = evaluate(requirement(ANY, facts=cpu_facts), MIXED)
    assert ev.eligible == () and not ev.satisfiable
    line = lines_of(ev, A100.uuid, "PyTorch build")[0]
    assert line.level == "ERROR"
    assert line.message == "torch 2.13.0+cpu is a CPU-only build; it cannot use A100 (cuda)"
    cpu = replace(A100, uuid="cpu", vendor="cpu", name="CPU", backend="cpu", arch="cpu",
                  driver_version="", memory_bandwidth_gbps=0)
    assert evaluate(requirement(ANY, facts=cpu_facts), [cpu]).eligible == ("cpu",)


def test_torch_mismatch_only_warns_without_a_contract() -> None:
    cpu_facts = ClientFacts(python_version="3.11.2", torch_version="2.13.0+cpu")
    ev = evaluate(requirement(facts=cpu_facts), MIXED)
    assert ev.satisfiable and len(ev.eligible) == len(MIXED)
    line = lines_of(ev, A100.uuid, "PyTorch build")[0]
    assert line.level == "WARN" and line.message.endswith(
        "(not enforced: no runtime contract given)")
    assert line in ev.warnings_for([A100.uuid])


def test_torch_built_for_another_backend() -> None:
    ev = evaluate(requirement(ANY), [MI250X])
    line = lines_of(ev, MI250X.uuid, "PyTorch build")[0]
    assert line.message == "torch 2.1.0+cu121 is built for cuda; MI250X needs a build for rocm"
    rocm = replace(CUDA_FACTS, torch_version="2.5.1+rocm6.2", torch_backend="rocm",
                   torch_runtime_version="6.2", kernel_archs=("gfx908", "gfx90a", "gfx942"),
                   ptx_archs=())
    ok = evaluate(requirement(ANY, facts=rocm), [MI250X])
    assert ok.eligible == (MI250X.uuid,)
    assert lines_of(ok, MI250X.uuid, "Kernel image")[0].message == \
        "torch 2.5.1+rocm6.2 carries gfx90a (MI250X)"


def test_dependency_mismatch_is_a_host_error() -> None:
    facts = replace(CUDA_FACTS, torch_version="2.3.0+cu121", packages={})
    ev = evaluate(requirement(EXAMPLE_SPEC, facts=facts), MIXED)
    host = {ln.name: ln for ln in ev.host_checks}
    assert host["PyTorch version"].level == "ERROR"
    assert host["PyTorch version"].message.startswith("2.3.0+cu121 does not match 2.1.0,2.2.0")
    assert host["PyTorch version"].suggestion == \
        "pip install 'torch<2.2.0,>=2.1.0', or widen version_range"
    assert host["torchvision version"].message == "not installed in the client's environment"
    assert not ev.satisfiable
    assert ev.reason.startswith("PyTorch version: 2.3.0+cu121 does not match")


def test_no_client_facts_skips_environment_checks() -> None:
    ev = evaluate(requirement(EXAMPLE_SPEC, facts=ClientFacts()), MIXED)
    assert ev.satisfiable and ev.eligible == (A100.uuid,)
    assert [ln.level for ln in ev.host_checks] == ["WARN"]
    assert all(ln.name != "Kernel image" for ln in ev.per_device[A100.uuid])


def test_config_backend_restricts_devices() -> None:
    ev = evaluate(requirement(config="backend: rocm", facts=ClientFacts()), MIXED)
    assert ev.eligible == (MI250X.uuid,)
    line = lines_of(ev, A100.uuid, "Backend")[0]
    assert (line.level, line.message) == ("ERROR", "required rocm, found cuda (A100)")
    intel = evaluate(requirement(config="backend: oneapi", facts=ClientFacts()), MIXED)
    assert intel.eligible == (MAX1550.uuid,)


def test_multi_device_needs_enough_on_one_backend() -> None:
    few = evaluate(requirement(SM80, gpus=2), MIXED)
    assert not few.satisfiable
    assert few.reason == ("asks for 2 devices meeting the contract; this host has only 1 "
                          "(A100 (sm_80))")
    split = evaluate(requirement(gpus=2, facts=ClientFacts()), [A100, MI250X])
    assert not split.satisfiable and "split across backends (1 cuda, 1 rocm)" in split.reason
    both = evaluate(requirement(gpus=2), [A100, gpu(A100, 5)])
    assert both.satisfiable


def test_distributed_checks() -> None:
    no_nccl = replace(CUDA_FACTS, distributed_backends=("gloo",))
    pair = [A100, gpu(A100, 5)]
    warn = evaluate(requirement(gpus=2, facts=no_nccl), pair)
    line = lines_of(warn, A100.uuid, "torch.distributed")[0]
    assert (line.level, line.message) == ("WARN", "backend nccl missing (has gloo)")
    assert warn.satisfiable
    required = evaluate(requirement("required_features: [{distributed: true}]", gpus=2,
                                    facts=no_nccl), pair)
    assert not required.satisfiable
    assert lines_of(evaluate(requirement(gpus=2), pair), A100.uuid,
                    "torch.distributed")[0].level == "OK"


def test_unknown_device_facts_warn_rather_than_refuse() -> None:
    bare = replace(A100, driver_version="", memory_bandwidth_gbps=0)
    ev = evaluate(requirement(EXAMPLE_SPEC), [bare])
    assert ev.eligible == (bare.uuid,)
    assert {ln.name for ln in ev.per_device[bare.uuid] if ln.level == "WARN"} == {
        "Memory bandwidth", "Driver version"}


def test_runtime_newer_than_driver() -> None:
    old_driver = replace(A100, runtime_version="11.8")
    ev = evaluate(requirement(ANY), [old_driver])
    line = lines_of(ev, A100.uuid, "Runtime version")[0]
    assert line.level == "ERROR" and "supports up to 11.8" in line.message
    assert lines_of(evaluate(requirement(), [T4]), T4.uuid, "Runtime version")[0].level == "WARN"


def test_amp_warning_and_short_names() -> None:
    ev = evaluate(requirement(config="amp_config: {dtype: bfloat16, grad_scaler: true}"), [A100])
    assert [ln.name for ln in ev.host_checks if ln.level == "WARN"] == ["AMP"]
    assert [short_name(d) for d in MIXED] == ["A100", "T4", "MI250X", "Max 1550"]


def test_every_device_is_evaluated_even_unhealthy_ones() -> None:
    sick = replace(A100, healthy=False, health_reason="Xid 79")
    assert evaluate(requirement(SM80), [sick]).eligible == (sick.uuid,)

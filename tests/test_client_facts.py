"""Client facts from the real torch installed here (2.13 CPU build): the daemon learns
that this build is CPU-only. The VACCEL_FAKE_TORCH_ARCHS hook stands in for a GPU build."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from vaccel.accelerator.introspect import backend_for_archs, split_arch_list
from vaccel.contract.facts import FAKE_ARCHS_ENV, FAKE_BACKEND_ENV, gather_facts

from brokerd.contract import evaluate
from brokerd.contract.convert import facts_from_proto, requirement_from_request
from tests.mixed_host import A100, MIXED

torch = pytest.importorskip("torch")
ANY = "required_features: []"  # a contract: makes the torch-build checks binding
pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def _no_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_ARCHS_ENV, raising=False)
    monkeypatch.delenv(FAKE_BACKEND_ENV, raising=False)


def test_real_cpu_torch_reports_a_cpu_only_build() -> None:
    facts = gather_facts(["pytorch", "pyyaml", "no-such-package-here"])
    assert facts.python_version == ".".join(map(str, sys.version_info[:3]))
    assert facts.torch_version == torch.__version__
    if torch.version.cuda or torch.version.hip:
        pytest.skip("this torch is a GPU build")
    assert facts.torch_backend == ""
    assert list(facts.kernel_archs) == [] and list(facts.ptx_archs) == []
    assert facts.distributed_available is torch.distributed.is_available()
    assert "gloo" in facts.distributed_backends
    assert facts.packages["pytorch"] == torch.__version__
    assert facts.packages["pyyaml"]
    assert "no-such-package-here" not in facts.packages


def test_cpu_only_build_is_refused_for_a_gpu_end_to_end() -> None:
    req = requirement_from_request(1, 0, ANY, "spec.yaml", "", "", gather_facts())
    if req.facts.torch_backend:
        pytest.skip("this torch is a GPU build")
    ev = evaluate(req, MIXED)
    assert not ev.satisfiable
    assert "is a CPU-only build" in ev.reason


def test_gathering_starts_no_device_runtime() -> None:
    gather_facts()
    assert not torch.cuda.is_initialized()


def test_without_torch_inspection_torch_is_not_imported() -> None:
    code = ("import sys; from vaccel.contract.facts import gather_facts; f = gather_facts(['pyyaml'], "
            "inspect_torch=False); assert 'torch' not in sys.modules, 'imported torch'; "
            "assert f.torch_version == '' and f.packages['pyyaml']; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_fake_arch_list_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_ARCHS_ENV, "sm_50, sm_80,sm_90,compute_90")
    facts = gather_facts()
    assert list(facts.kernel_archs) == ["sm_50", "sm_80", "sm_90"]
    assert list(facts.ptx_archs) == ["compute_90"]
    assert facts.torch_backend == "cuda"
    assert facts.torch_version == torch.__version__
    monkeypatch.setenv(FAKE_ARCHS_ENV, "gfx90a")
    monkeypatch.setenv(FAKE_BACKEND_ENV, "rocm")
    assert gather_facts().torch_backend == "rocm"


def test_fake_arch_list_drives_the_kernel_image_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_ARCHS_ENV, "sm_50,sm_60,sm_70,sm_75,sm_80,sm_86")
    blackwell = replace(A100, uuid="GPU-sm120", name="NVIDIA RTX PRO 6000", arch="sm_120",
                        runtime_version="")
    req = requirement_from_request(1, 0, ANY, "spec.yaml", "", "", gather_facts())
    ev = evaluate(req, [A100, blackwell])
    assert ev.eligible == (A100.uuid,)
    refusal = [ln for ln in ev.per_device[blackwell.uuid] if ln.level == "ERROR"]
    assert refusal[0].message.startswith(
        f"no kernels for sm_120 (RTX PRO): torch {torch.__version__} carries sm_50..sm_86")


def test_facts_round_trip_through_the_message() -> None:
    msg = gather_facts(["pyyaml"])
    facts = facts_from_proto(msg)
    assert facts.torch_version == msg.torch_version
    assert facts.distributed_backends == tuple(msg.distributed_backends)
    assert dict(facts.packages) == dict(msg.packages)
    assert facts_from_proto(None).torch_version == ""


def test_arch_list_helpers() -> None:
    assert split_arch_list(["sm_80", "compute_80", " ", "sm_90"]) == (
        ("sm_80", "sm_90"), ("compute_80",))
    assert backend_for_archs(["compute_90"]) == "cuda"
    assert backend_for_archs(["gfx942"]) == "rocm"
    assert backend_for_archs(["pvc"]) == "xpu"
    assert backend_for_archs([]) == ""

"""`vaccel check` rendering of a CheckReply."""

from __future__ import annotations

from pathlib import Path

from vaccel.contract.report import check_exit_code, render_check, render_line

from brokerd.contract import evaluate
from brokerd.contract.convert import check_line_to_proto
from tests.mixed_host import A100, MI250X, MIXED, requirement
from vaccel_common.v1 import broker_pb2 as pb

EXAMPLE_SPEC = (Path(__file__).resolve().parent / "fixtures" / "pinned-runtime-spec.yaml").read_text()


def reply_for(spec: str, devices) -> pb.CheckReply:  # type: ignore[no-untyped-def]
    """What the servicer builds from an Evaluation."""
    ev = evaluate(requirement(spec), devices)
    reply = pb.CheckReply(satisfiable=ev.satisfiable, summary=ev.reason)
    reply.host_checks.extend(check_line_to_proto(ln) for ln in ev.host_checks)
    for d in devices:
        reply.devices.append(pb.DeviceCheck(
            device=pb.Device(index=d.index, uuid=d.uuid, name=d.name, arch=d.arch),
            eligible=d.uuid in ev.eligible,
            checks=[check_line_to_proto(ln) for ln in ev.per_device[d.uuid]],
        ))
    reply.suggestions.extend(ev.suggestions)
    return reply


def test_line_formats() -> None:
    ok = pb.CheckLine(level="OK", name="GPU compute capability", message="sm_80 (A100)")
    assert render_line(ok) == "[CHECK] GPU compute capability: sm_80 (A100) - OK"
    warn = pb.CheckLine(level="WARN", name="Kernel image", message="kernels would JIT from PTX")
    assert render_line(warn) == "[WARN] Kernel image: kernels would JIT from PTX"
    err = pb.CheckLine(level="ERROR", name="GPU compute capability",
                       message="required sm_80, found gfx90a (MI250X)",
                       suggestion="relax gpu_compute_capability")
    assert render_line(err) == ("[ERROR] GPU compute capability: required sm_80, found gfx90a "
                                "(MI250X) — suggestion: relax gpu_compute_capability")


def test_report_of_the_mixed_host() -> None:
    reply = reply_for(EXAMPLE_SPEC, MIXED)
    text = render_check(reply)
    lines = text.splitlines()
    assert lines[0] == "[CHECK] Python: 3.11.9 - OK"
    assert "[CHECK] PyTorch version: 2.1.0+cu121 (matches 2.1.0,2.2.0) - OK" in lines
    assert "GPU 0  NVIDIA A100-SXM4-80GB  eligible" in lines
    assert "GPU 2  AMD Instinct MI250X  not eligible" in lines
    assert "[CHECK] GPU compute capability: sm_80 (A100) - OK" in lines
    assert ("[ERROR] GPU compute capability: required sm_80, found gfx90a (MI250X) — suggestion: "
            "run on a host with A100/H100, or relax gpu_compute_capability") in lines
    assert lines[-1] == "Result: satisfiable (1 of 4 device(s) eligible)"
    assert check_exit_code(reply) == 0


def test_report_of_an_unsatisfiable_contract() -> None:
    reply = reply_for("required_features: [{gpu_compute_capability: sm_90}]", [A100, MI250X])
    text = render_check(reply)
    assert check_exit_code(reply) == 1
    assert "Result: NOT satisfiable: no device on this host meets the contract" in text
    suggestions = [ln for ln in text.splitlines() if ln.startswith("Suggestion: ")]
    assert suggestions[0] == (
        "Suggestion: needs sm_90; this host has A100 (sm_80), MI250X (gfx90a). Run on a host "
        "with H100/B200, or relax gpu_compute_capability")


def test_empty_reply() -> None:
    assert render_check(pb.CheckReply()) == "Result: NOT satisfiable"
    assert check_exit_code(pb.CheckReply(satisfiable=True)) == 0

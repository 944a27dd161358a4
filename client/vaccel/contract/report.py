"""`vaccel check` output: the daemon's CheckReply as one line per check.

    [CHECK] PyTorch version: 2.1.0 (matches 2.1.0,2.2.0) - OK
    GPU 0  <device name>  eligible
    [CHECK] GPU compute capability: <arch> - OK
    GPU 2  <device name>  not eligible
    [ERROR] GPU compute capability: required <arch>, found <other arch> — suggestion: ...
    [INFO] <section>: not applicable to <backend> (<device>): ...
    Result: satisfiable (1 of 4 device(s) eligible)
    Suggestion: ...
    [SUCCESS] All checks passed. Environment is compatible.

The last line, in the article's runtime-checker shape, comes only when the host can
satisfy the contract and no line is an ERROR. (docs/contracts.md shows real output; the
lines come from the daemon as they are.)
"""

from __future__ import annotations

from vaccel_common.v1 import broker_pb2


def render_line(line: broker_pb2.CheckLine) -> str:
    if line.level == "OK":
        return f"[CHECK] {line.name}: {line.message} - OK"
    tag = {"WARN": "[WARN]", "INFO": "[INFO]"}.get(line.level, "[ERROR]")
    text = f"{tag} {line.name}: {line.message}"
    return f"{text} — suggestion: {line.suggestion}" if line.suggestion else text


def render_check(reply: broker_pb2.CheckReply) -> str:
    """The whole report: host checks, each device's checks, then the verdict."""
    out = [render_line(ln) for ln in reply.host_checks]
    for dc in reply.devices:
        d = dc.device
        state = "eligible" if dc.eligible else "not eligible"
        number = d.label.removeprefix("gpu") if d.label else d.index  # 1.0: instance 0 of GPU 1 (MIG)
        out.append(f"GPU {number}  {d.name}  {state}")
        out.extend(render_line(ln) for ln in dc.checks)
    if reply.satisfiable:
        eligible = sum(1 for dc in reply.devices if dc.eligible)
        out.append(f"Result: satisfiable ({eligible} of {len(reply.devices)} device(s) "
                   "eligible)")
    else:
        out.append(f"Result: NOT satisfiable: {reply.summary}" if reply.summary
                   else "Result: NOT satisfiable")
    out.extend(f"Suggestion: {s}" for s in reply.suggestions)
    lines = [*reply.host_checks, *(ln for dc in reply.devices for ln in dc.checks)]
    if reply.satisfiable and lines and not any(ln.level == "ERROR" for ln in lines):
        warnings = sum(1 for ln in lines if ln.level == "WARN")
        noted = f" ({warnings} warning(s) above)" if warnings else ""
        out.append(f"[SUCCESS] All checks passed. Environment is compatible{noted}.")
    return "\n".join(out)


def check_exit_code(reply: broker_pb2.CheckReply) -> int:
    """0 when this host can satisfy the contract, 1 when it cannot."""
    return 0 if reply.satisfiable else 1

"""runtime-spec.yaml's `vendor_agnostic_wheel: true`: the client's torch is an upstream
PyTorch build that drives the leased device's backend.

Two facts the client reports decide it (ClientFacts): `torch_version` and `torch_backend`.
The version's local label (after "+") must be one upstream PyTorch publishes wheels under
(the vendor table's UPSTREAM_TORCH_LABELS, or none), and a pre-release must be a nightly
(".dev"): "2.1.0a0+32f93b1" and "+nv24.03" are a vendor's container build or a source
build, made to drive one vendor's devices. The build's backend must be the device's (a
simulated device computes on the CPU, which every build drives). The kernel-image check
next to it says whether the build carries the device's architecture.
"""

from __future__ import annotations

import re

from brokerd.contract.model import CheckLine, ClientFacts
from brokerd.devices.model import Device
from brokerd.devices.vendors import UPSTREAM_TORCH_LABELS

WHEEL = "PyTorch wheel"
_PRE_RELEASE = re.compile(r"\d(a|b|rc)\d+$")


def upstream_problem(version: str) -> str:
    """Why `version` is not an upstream PyTorch release or nightly, "" when it is one."""
    release, _, label = version.partition("+")
    if label and not any(re.fullmatch(p, label) for p in UPSTREAM_TORCH_LABELS.values()):
        return (f"its local version '+{label}' is none of the labels upstream PyTorch "
                f"publishes its {', '.join(UPSTREAM_TORCH_LABELS)} wheels under: a vendor's "
                "fork or a source build")
    if _PRE_RELEASE.search(release) and ".dev" not in release:
        return f"{release} is a pre-release no upstream wheel carries: a source build"
    return ""


def wheel_line(device: Device, name: str, facts: ClientFacts) -> CheckLine:
    """The vendor_agnostic_wheel line of one device."""
    torch = f"torch {facts.torch_version}"
    wanted = "cpu" if device.simulated or device.vendor == "cpu" else device.backend
    problem = upstream_problem(facts.torch_version)
    if problem:
        return CheckLine("ERROR", WHEEL, f"{torch} is not an upstream PyTorch build: {problem}",
                         device.uuid, f"install the upstream torch wheel for {wanted} "
                         "(download.pytorch.org/whl), or drop vendor_agnostic_wheel")
    drives = facts.torch_backend or "cpu"
    if wanted != "cpu" and drives != wanted:
        return CheckLine("ERROR", WHEEL, f"{torch} drives {drives} only; {name} needs a build "
                         f"that drives {wanted}", device.uuid,
                         f"install the upstream torch wheel for {wanted} "
                         "(download.pytorch.org/whl)")
    how = ", simulated: computes on the CPU" if device.simulated else ""
    return CheckLine("OK", WHEEL, f"{torch} is an upstream build that drives {wanted} "
                     f"({name}{how})", device.uuid)

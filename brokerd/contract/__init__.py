"""Runtime contracts: what a job needs (gpus, memory, runtime-spec.yaml,
accelerator-config.yaml, the client's own torch build) checked against each device.

The lease manager sees only `Requirement`, `evaluate` and `select`; parsing of the
contract files and the individual checks live in the modules of this package. A bad
contract file raises `ContractError` (a ValueError naming file, line and key).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from brokerd.contract.located import ContractError
from brokerd.devices import Device

__all__ = ["CheckLine", "ClientFacts", "ContractError", "Evaluation", "Requirement", "evaluate",
           "select"]


@dataclass(frozen=True)
class ClientFacts:
    """What the client process reports about its own environment (see ClientFacts in the proto)."""

    python_version: str = ""
    torch_version: str = ""
    torch_backend: str = ""
    torch_runtime_version: str = ""
    kernel_archs: tuple[str, ...] = ()
    ptx_archs: tuple[str, ...] = ()
    distributed_available: bool = False
    distributed_backends: tuple[str, ...] = ()
    packages: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckLine:
    level: str  # OK | WARN | ERROR
    name: str
    message: str
    device_uuid: str = ""
    suggestion: str = ""


@dataclass(frozen=True)
class Requirement:
    """One validated request. `spec` and `config` are the parsed contract files or None."""

    gpus: int
    min_memory_mib: int = 0
    spec: object | None = None
    config: object | None = None
    facts: ClientFacts = field(default_factory=ClientFacts)


@dataclass(frozen=True)
class Evaluation:
    eligible: tuple[str, ...]  # uuids of devices that pass every ERROR-level check
    per_device: Mapping[str, tuple[CheckLine, ...]]
    host_checks: tuple[CheckLine, ...] = ()
    suggestions: tuple[str, ...] = ()
    satisfiable: bool = False  # enough eligible devices exist (free or not)
    reason: str = ""  # when not satisfiable: why, in one sentence a user can act on

    def warnings_for(self, uuids: Sequence[str]) -> tuple[CheckLine, ...]:
        lines = [ln for u in uuids for ln in self.per_device.get(u, ()) if ln.level == "WARN"]
        return (*[ln for ln in self.host_checks if ln.level == "WARN"], *lines)


def evaluate(requirement: Requirement, devices: Sequence[Device]) -> Evaluation:
    """Check `requirement` against every device (healthy or not: health is the lease
    manager's business, so a sick device still counts as 'could satisfy later')."""
    from brokerd.contract.checks import evaluate_devices

    return evaluate_devices(requirement, devices)


def select(
    requirement: Requirement,
    free: Sequence[Device],
    last_used: Mapping[str, float],
    evaluation: Evaluation | None = None,
) -> list[Device] | None:
    """Pick `requirement.gpus` devices among the free eligible ones, or None. Pass the
    requirement's `evaluation` when there is one: it is not recomputed then."""
    from brokerd.policy import select_devices

    return select_devices(requirement, free, last_used, evaluation)

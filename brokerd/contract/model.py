"""The contract's data: what a request requires, what the client reports about itself,
and what checking one against the host's devices found."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from brokerd.contract.accel_config import AcceleratorConfig
from brokerd.contract.spec import RuntimeSpec


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
    python_executable: str = ""  # the interpreter the facts describe (the job's), named in the lines


@dataclass(frozen=True)
class CheckLine:
    level: str  # OK | INFO | WARN | ERROR (INFO: a setting that does not apply here)
    name: str
    message: str
    device_uuid: str = ""
    suggestion: str = ""


@dataclass(frozen=True)
class Requirement:
    """One validated request. `spec` and `config` are the parsed contract files, None
    where the request gave none."""

    gpus: int
    min_memory_mib: int = 0
    spec: RuntimeSpec | None = None
    config: AcceleratorConfig | None = None
    facts: ClientFacts = field(default_factory=ClientFacts)
    # The last evaluation of this requirement and the devices it was made against: the
    # daemon evaluates off its event loop (brokerd/edge/work_guard.py), and the loop's own
    # `evaluate` calls then find the answer here instead of computing it again.
    memo: list[tuple[object, Evaluation]] = field(default_factory=list, init=False, compare=False, repr=False)


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

"""accelerator-config.yaml: which backend a job wants, how to rank devices, and the
settings the client's accelerator applies (AMP, the memory pool).

    backend: auto                      # or a backend of the table, or an alias of one
    device_selection_policy:
      - priority: 1
        criteria:
          - {type: gpu_compute_capability, min: ARCH}
          - {type: driver_version, min: 535.54.03}
      - priority: 2
        criteria: [{type: gpu_vendor, equals: VENDOR}]
    runtime_contract: ./runtime-spec.yaml
    MEMORY_POOL_SECTION: {memory_pool_size_mb: 16384, use_unified_memory: false}
    amp_config: {backend: native, dtype: bfloat16, grad_scaler: false}

ARCH, VENDOR and the memory pool section's key come from the vendor table
(brokerd/devices/vendors.py). The schema, with every name spelled out, is in docs/contracts.md.
Every error names the file, line and key.
"""

from __future__ import annotations

from dataclasses import dataclass

from brokerd.contract.located import (
    ContractError,
    Located,
    Source,
    expect_bool,
    expect_list,
    expect_mapping,
    expect_number,
    expect_text,
    load_located,
)
from brokerd.contract.spec import parse_min_memory
from brokerd.contract.versions import (
    Capability,
    at_least,
    at_most,
    compare_capabilities,
    compare_driver_versions,
    parse_capability,
    parse_driver_version,
    same_capability,
    try_capability,
)
from brokerd.devices.model import Device
from brokerd.devices.vendors import DEVICE_VENDORS, EXAMPLE_VENDOR, MEMORY_POOL_SECTION
from vaccel_common.backends import BACKEND_ALIASES, BACKENDS

__all__ = ["AcceleratorConfig", "ContractError", "Criterion", "Priority",
           "parse_accelerator_config"]

TOP_LEVEL_KEYS = ("backend", "device_selection_policy", "runtime_contract", MEMORY_POOL_SECTION,
                  "amp_config")
# Users may write a vendor's name for a backend (an alias); the backend it means is the table's.
BACKEND_WORDS = ("auto", *BACKENDS, *BACKEND_ALIASES)
AMP_DTYPES = ("float16", "bfloat16", "none")
AMP_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}
# amp_config.backend: the AMP implementation; torch's own (torch.amp) is the only one.
AMP_BACKENDS = ("native",)
# criterion type -> the comparison keys it takes
CRITERIA: dict[str, tuple[str, ...]] = {
    "gpu_compute_capability": ("min", "max", "equals"),
    "driver_version": ("min", "max", "equals"),
    "gpu_vendor": ("equals",),
    "gpu_name": ("equals", "contains"),
    "memory": ("min", "max"),
    "memory_bandwidth_gbps": ("min", "max"),
    "numa_node": ("equals",),
}


@dataclass(frozen=True)
class Criterion:
    """One condition on a device. Values are already parsed: capabilities as
    Capability, memory in MiB, driver versions as text checked parseable."""

    type: str
    min: object = None
    max: object = None
    equals: object = None
    contains: str = ""
    line: int = 0

    def matches(self, device: Device) -> bool:
        """Whether `device` meets this criterion (a device lacking the fact does not)."""
        if self.type == "gpu_compute_capability":
            cap = try_capability(device.arch)
            return cap is not None and all((
                self.min is None or at_least(cap, self.min),  # type: ignore[arg-type]
                self.max is None or at_most(cap, self.max),  # type: ignore[arg-type]
                self.equals is None or same_capability(cap, self.equals),  # type: ignore[arg-type]
            ))
        if self.type == "driver_version":
            return _driver_matches(device.driver_version, self)
        if self.type == "gpu_vendor":
            return device.vendor == self.equals
        if self.type == "gpu_name":
            name = device.name.lower()
            return (self.equals is None or name == str(self.equals).lower()) and (
                not self.contains or self.contains.lower() in name)
        if self.type in ("memory", "memory_bandwidth_gbps"):
            value = device.memory_mib if self.type == "memory" else device.memory_bandwidth_gbps
            return (self.min is None or value >= self.min) and (  # type: ignore[operator]
                self.max is None or value <= self.max)  # type: ignore[operator]
        if self.type == "numa_node":
            return device.numa_node == self.equals
        return False

    def describe(self) -> str:
        parts = [f"{op} {_show(getattr(self, op))}" for op in ("min", "max", "equals")
                 if getattr(self, op) is not None]
        if self.contains:
            parts.append(f"contains {self.contains!r}")
        return f"{self.type} {', '.join(parts)}"


def _show(value: object) -> str:
    return value.canonical if isinstance(value, Capability) else str(value)


def _driver_matches(version: str, criterion: Criterion) -> bool:
    try:
        parse_driver_version(version)
    except ValueError:
        return False
    return all((
        criterion.min is None or compare_driver_versions(version, str(criterion.min)) >= 0,
        criterion.max is None or compare_driver_versions(version, str(criterion.max)) <= 0,
        criterion.equals is None or compare_driver_versions(version, str(criterion.equals)) == 0,
    ))


@dataclass(frozen=True)
class Priority:
    """Devices meeting every criterion rank at `priority` (1 is tried first)."""

    priority: int
    criteria: tuple[Criterion, ...]
    line: int = 0

    def matches(self, device: Device) -> bool:
        return all(c.matches(device) for c in self.criteria)


@dataclass(frozen=True)
class AcceleratorConfig:
    name: str = "accelerator-config.yaml"
    backend: str = "auto"  # "auto" or a backend table name (an alias already resolved)
    backend_as_written: str = "auto"
    priorities: tuple[Priority, ...] = ()  # sorted by priority
    runtime_contract: str = ""  # as written; the client resolves it against the file
    memory_pool_size_mb: int = 0
    use_unified_memory: bool | None = None  # None when not given
    amp_dtype: str = ""  # float16 | bfloat16 | none; "" when not given
    grad_scaler: bool | None = None

    def rank(self, device: Device) -> int:
        """The first priority whose criteria `device` meets; devices meeting none rank
        after every priority (they are still usable)."""
        for p in self.priorities:
            if p.matches(device):
                return p.priority
        return (self.priorities[-1].priority + 1) if self.priorities else 0


def parse_accelerator_config(text: str, name: str = "accelerator-config.yaml") -> AcceleratorConfig:
    """Parse accelerator-config.yaml text; raises ContractError naming `name`, line and key."""
    source = Source(name)
    root = load_located(text, source)
    if root is None:
        return AcceleratorConfig(name=name)
    top = expect_mapping(source, root, "", TOP_LEVEL_KEYS)
    values: dict[str, object] = {"name": name}
    if "backend" in top:
        word = expect_text(source, top["backend"], "backend").lower()
        if word not in BACKEND_WORDS:
            raise source.unknown_key(top["backend"].line, "backend", word, BACKEND_WORDS,
                                     "backend")
        values["backend_as_written"] = word
        values["backend"] = BACKEND_ALIASES.get(word, word)
    if "device_selection_policy" in top and top["device_selection_policy"].value is not None:
        values["priorities"] = _policy(source, top["device_selection_policy"])
    if "runtime_contract" in top:
        values["runtime_contract"] = expect_text(source, top["runtime_contract"],
                                                 "runtime_contract")
    if MEMORY_POOL_SECTION in top:
        values.update(_memory_section(source, top[MEMORY_POOL_SECTION]))
    if "amp_config" in top:
        values.update(_amp(source, top["amp_config"]))
    return AcceleratorConfig(**values)  # type: ignore[arg-type]


def _memory_section(source: Source, node: Located) -> dict[str, object]:
    pool = expect_mapping(source, node, MEMORY_POOL_SECTION,
                          ("memory_pool_size_mb", "use_unified_memory"))
    out: dict[str, object] = {}
    if "memory_pool_size_mb" in pool:
        size_node = pool["memory_pool_size_mb"]
        key = f"{MEMORY_POOL_SECTION}.memory_pool_size_mb"
        size = expect_number(source, size_node, key)
        if size != int(size):
            raise source.error(size_node.line, key, f"expected a whole number of MB, got {size_node.raw}")
        out["memory_pool_size_mb"] = int(size)
    if "use_unified_memory" in pool:
        out["use_unified_memory"] = expect_bool(source, pool["use_unified_memory"],
                                                f"{MEMORY_POOL_SECTION}.use_unified_memory")
    return out


def _amp(source: Source, node: Located) -> dict[str, object]:
    amp = expect_mapping(source, node, "amp_config", ("backend", "dtype", "grad_scaler"))
    out: dict[str, object] = {}
    if "backend" in amp:
        word = expect_text(source, amp["backend"], "amp_config.backend").lower()
        if word not in AMP_BACKENDS:
            raise source.error(amp["backend"].line, "amp_config.backend",
                               f"only 'native' (torch.amp autocast and GradScaler) is "
                               f"supported, got {word!r}")
    if "dtype" in amp:
        dtype_node = amp["dtype"]
        # YAML reads a bare `none` as text but `null`/`~` as nothing: both mean no AMP.
        dtype = "none" if dtype_node.value is None else expect_text(
            source, dtype_node, "amp_config.dtype").lower()
        dtype = AMP_ALIASES.get(dtype, dtype)
        if dtype not in AMP_DTYPES:
            raise source.unknown_key(dtype_node.line, "amp_config.dtype", dtype, AMP_DTYPES,
                                     "dtype")
        out["amp_dtype"] = dtype
    if "grad_scaler" in amp:
        out["grad_scaler"] = expect_bool(source, amp["grad_scaler"], "amp_config.grad_scaler")
    return out


def _policy(source: Source, node: Located) -> tuple[Priority, ...]:
    priorities: list[Priority] = []
    for i, entry in enumerate(expect_list(source, node, "device_selection_policy")):
        where = f"device_selection_policy[{i}]"
        mapping = expect_mapping(source, entry, where, ("priority", "criteria"))
        if "priority" not in mapping:
            raise source.error(entry.line, where, "missing 'priority' (1 is tried first)")
        prio_node = mapping["priority"]
        prio = prio_node.value
        if isinstance(prio, bool) or not isinstance(prio, int) or prio < 1:
            raise source.error(prio_node.line, f"{where}.priority",
                               f"expected a whole number >= 1, got {prio_node.raw!r}")
        criteria_node = mapping.get("criteria")
        if criteria_node is None or criteria_node.value is None:
            raise source.error(entry.line, where, "missing 'criteria'")
        criteria = tuple(
            _criterion(source, c, f"{where}.criteria[{j}]")
            for j, c in enumerate(expect_list(source, criteria_node, f"{where}.criteria"))
        )
        if not criteria:
            raise source.error(criteria_node.line, f"{where}.criteria", "empty list")
        priorities.append(Priority(prio, criteria, entry.line))
    return tuple(sorted(priorities, key=lambda p: p.priority))


def _criterion(source: Source, node: Located, where: str) -> Criterion:
    if not node.is_mapping:
        raise source.error(node.line, where, "expected a mapping with 'type' and a comparison "
                           f"(e.g. {{type: gpu_vendor, equals: {EXAMPLE_VENDOR}}})")
    if "type" not in node.value:
        raise source.error(node.line, where, f"missing 'type' (one of {', '.join(CRITERIA)})")
    type_node = node.value["type"]
    kind = expect_text(source, type_node, f"{where}.type")
    if kind not in CRITERIA:
        raise source.unknown_key(type_node.line, f"{where}.type", kind, CRITERIA,
                                 "criterion type")
    ops = CRITERIA[kind]
    items = expect_mapping(source, node, where, ("type", *ops))
    given = {op: items[op] for op in ops if op in items}
    if not given:
        raise source.error(node.line, where, f"{kind} needs one of: {', '.join(ops)}")
    parsed = {op: _criterion_value(source, kind, op, v, f"{where}.{op}") for op, v in given.items()}
    _check_bounds(source, node, where, kind, parsed)
    return Criterion(kind, line=node.line, **parsed)  # type: ignore[arg-type]


def _criterion_value(source: Source, kind: str, op: str, node: Located, key: str) -> object:
    if kind == "gpu_compute_capability":
        try:
            return parse_capability(expect_text(source, node, key))
        except ValueError as exc:
            raise source.error(node.line, key, str(exc)) from None
    if kind == "driver_version":
        text = expect_text(source, node, key)
        try:
            parse_driver_version(text)
        except ValueError as exc:
            raise source.error(node.line, key, str(exc)) from None
        return text
    if kind == "gpu_vendor":
        vendor = expect_text(source, node, key).lower()
        if vendor not in DEVICE_VENDORS:
            raise source.unknown_key(node.line, key, vendor, DEVICE_VENDORS, "vendor")
        return vendor
    if kind == "memory":
        return parse_min_memory(source, node, key)
    if kind == "memory_bandwidth_gbps":
        return expect_number(source, node, key)
    if kind == "numa_node":
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise source.error(node.line, key, f"expected a NUMA node number, got {node.raw!r}")
        return value
    return expect_text(source, node, key)  # gpu_name


def _check_bounds(source: Source, node: Located, where: str, kind: str,
                  parsed: dict[str, object]) -> None:
    low, high = parsed.get("min"), parsed.get("max")
    if low is None or high is None:
        return
    if kind == "gpu_compute_capability":
        cmp = compare_capabilities(low, high)  # type: ignore[arg-type]
        if cmp is None:
            raise source.error(node.line, where, f"min {_show(low)} and max {_show(high)} are "
                               "different vendors' architectures")
    elif kind == "driver_version":
        cmp = compare_driver_versions(str(low), str(high))
    else:
        cmp = (low > high) - (low < high)  # type: ignore[operator]
    if cmp > 0:
        raise source.error(node.line, where, f"impossible range: min {_show(low)} is above "
                           f"max {_show(high)}")

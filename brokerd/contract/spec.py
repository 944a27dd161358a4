"""runtime-spec.yaml: what a job needs from a device and from its Python environment.

    required_features:
      - gpu_compute_capability: ARCH       # or a list, one per vendor
      - memory_bandwidth_gbps: 2000
      - driver_version_min: 535.54.03
      - min_memory: 20GiB
    dependencies:
      - name: pytorch
        version_range: "2.1.0,2.2.0"       # >=2.1.0,<2.2.0
        vendor_agnostic_wheel: true        # an upstream torch build for the leased backend
        full_distribution: true            # torch.distributed with the backend's collective

ARCH is an architecture as the vendor table (brokerd/devices/vendors.py) spells it. The full
schema is in docs/contracts.md. Every error names the file, line and key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
from brokerd.contract.versions import (
    Capability,
    VersionRange,
    parse_capability,
    parse_driver_version,
    parse_version_range,
)
from brokerd.devices.vendors import GPU_VENDORS, VENDOR_TITLES
from vaccel_common.units import parse_size_mib

__all__ = ["ContractError", "Dependency", "RuntimeSpec", "parse_min_memory", "parse_runtime_spec"]

TORCH_NAMES = ("pytorch", "torch")
TOP_LEVEL_KEYS = ("required_features", "dependencies", "name", "description")
FEATURE_KEYS = (
    "gpu_compute_capability", "memory_bandwidth_gbps", "driver_version_min", "min_memory",
    "distributed",
)
DEPENDENCY_KEYS = ("name", "version_range", "vendor_agnostic_wheel", "full_distribution")
# Keys the client can answer for torch only: it reports torch's build, not other packages'.
TORCH_ONLY_KEYS = ("vendor_agnostic_wheel", "full_distribution")


@dataclass(frozen=True)
class Dependency:
    name: str
    version_range: VersionRange | None  # None: any installed version
    line: int = 0
    vendor_agnostic_wheel: bool = False  # torch only: an upstream build for the leased backend
    full_distribution: bool = False  # torch only: torch.distributed with the backend's collective


@dataclass(frozen=True)
class RuntimeSpec:
    """A parsed runtime-spec.yaml. Empty fields mean "no requirement"."""

    name: str = "runtime-spec.yaml"
    description: str = ""
    compute_capabilities: tuple[Capability, ...] = ()  # minimum per vendor; any one may match
    memory_bandwidth_gbps: float = 0.0
    driver_version_min: str = ""  # every GPU vendor
    driver_version_min_by_vendor: dict[str, str] = field(default_factory=dict)
    min_memory_mib: int = 0
    distributed: bool = False
    dependencies: tuple[Dependency, ...] = ()

    def driver_minimum(self, vendor: str) -> str:
        """The driver minimum for `vendor`'s devices, "" for none. A plain
        driver_version_min is one vendor's numbering, so when gpu_compute_capability
        names vendors it applies to those only."""
        if vendor in self.driver_version_min_by_vendor:
            return self.driver_version_min_by_vendor[vendor]
        named = {c.vendor for c in self.compute_capabilities}
        return self.driver_version_min if not named or vendor in named else ""

    @property
    def vendor_agnostic_wheel(self) -> bool:
        return any(d.vendor_agnostic_wheel for d in self.dependencies)

    @property
    def full_distribution(self) -> bool:
        return any(d.full_distribution for d in self.dependencies)

    def capability_for(self, vendor: str) -> Capability | None:
        return next((c for c in self.compute_capabilities if c.vendor == vendor), None)


def parse_runtime_spec(text: str, name: str = "runtime-spec.yaml") -> RuntimeSpec:
    """Parse runtime-spec.yaml text; raises ContractError naming `name`, the line and key."""
    source = Source(name)
    root = load_located(text, source)
    if root is None:
        return RuntimeSpec(name=name)
    top = expect_mapping(source, root, "", TOP_LEVEL_KEYS)
    values: dict[str, object] = {"name": name}
    if "description" in top:
        values["description"] = expect_text(source, top["description"], "description")
    if "name" in top:
        expect_text(source, top["name"], "name")
    if "required_features" in top and top["required_features"].value is not None:
        values.update(_features(source, top["required_features"]))
    if "dependencies" in top and top["dependencies"].value is not None:
        values["dependencies"] = _dependencies(source, top["dependencies"])
    return RuntimeSpec(**values)  # type: ignore[arg-type]


def _feature_items(source: Source, node: Located) -> list[tuple[str, Located, int]]:
    """(key, value, key path) of every feature, from the list-of-one-key-mappings form
    or from a plain mapping."""
    if node.is_mapping:
        entries = [node]
    else:
        entries = expect_list(source, node, "required_features")
    items: list[tuple[str, Located, int]] = []
    for i, entry in enumerate(entries):
        where = f"required_features[{i}]" if node.is_sequence else "required_features"
        mapping = expect_mapping(source, entry, where, FEATURE_KEYS)
        items.extend((key, value, f"{where}.{key}") for key, value in mapping.items())
    return items


def _features(source: Source, node: Located) -> dict[str, object]:
    out: dict[str, object] = {}
    capabilities: list[Capability] = []
    seen: dict[str, int] = {}
    for key, value, path in _feature_items(source, node):
        if key in seen and key != "gpu_compute_capability":
            raise source.error(value.line, path, f"given twice (first on line {seen[key]})")
        seen[key] = value.line
        if key == "gpu_compute_capability":
            capabilities.extend(_capabilities(source, value, path, capabilities))
        elif key == "memory_bandwidth_gbps":
            out[key] = expect_number(source, value, path)
        elif key == "driver_version_min":
            if value.is_mapping:
                out["driver_version_min_by_vendor"] = {
                    vendor: _driver(source, v, f"{path}.{vendor}")
                    for vendor, v in expect_mapping(source, value, path, GPU_VENDORS).items()
                }
            else:
                out[key] = _driver(source, value, path)
        elif key == "min_memory":
            out["min_memory_mib"] = parse_min_memory(source, value, path)
        elif key == "distributed":
            out[key] = expect_bool(source, value, path)
    if capabilities:
        out["compute_capabilities"] = tuple(capabilities)
    return out


def _capabilities(
    source: Source, node: Located, key: str, earlier: list[Capability]
) -> list[Capability]:
    nodes = node.value if node.is_sequence else [node]
    found: list[Capability] = []
    for item in nodes:
        cap = _capability(source, item, key)
        clash = next((c for c in (*earlier, *found) if c.vendor == cap.vendor), None)
        if clash:
            raise source.error(item.line, key, f"two minimums for {VENDOR_TITLES[cap.vendor]} "
                               f"({clash.canonical} and {cap.canonical}); give one per vendor")
        found.append(cap)
    return found


def _capability(source: Source, node: Located, key: str) -> Capability:
    text = expect_text(source, node, key)
    try:
        return parse_capability(text)
    except ValueError as exc:
        raise source.error(node.line, key, str(exc)) from None


def _driver(source: Source, node: Located, key: str) -> str:
    text = expect_text(source, node, key)
    try:
        parse_driver_version(text)
    except ValueError as exc:
        raise source.error(node.line, key, str(exc)) from None
    return text


def parse_min_memory(source: Source, node: Located, key: str) -> int:
    """A size with a unit ("20GiB", "512MiB"); a bare number is refused because nobody
    means 20 bytes."""
    text = expect_text(source, node, key)
    if text.replace(".", "", 1).isdigit():
        raise source.error(node.line, key, f"give a unit: {text}GiB or {text}MiB")
    try:
        mib = parse_size_mib(text)
    except ValueError as exc:
        raise source.error(node.line, key, str(exc)) from None
    if mib <= 0:
        raise source.error(node.line, key, f"must be positive, got {text}")
    return mib


def _dependencies(source: Source, node: Located) -> tuple[Dependency, ...]:
    deps: list[Dependency] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(expect_list(source, node, "dependencies")):
        where = f"dependencies[{i}]"
        mapping = expect_mapping(source, entry, where, DEPENDENCY_KEYS)
        if "name" not in mapping:
            raise source.error(entry.line, where, "missing 'name'")
        dep_name = expect_text(source, mapping["name"], f"{where}.name")
        canonical = dep_name.lower()
        if canonical in seen:
            raise source.error(mapping["name"].line, f"{where}.name",
                               f"{dep_name} listed twice (first on line {seen[canonical]})")
        seen[canonical] = mapping["name"].line
        version_range = None
        if "version_range" in mapping:
            range_node = mapping["version_range"]
            text = expect_text(source, range_node, f"{where}.version_range")
            try:
                version_range = parse_version_range(text)
            except ValueError as exc:
                raise source.error(range_node.line, f"{where}.version_range", str(exc)) from None
        flags = {key: expect_bool(source, mapping[key], f"{where}.{key}")
                 for key in TORCH_ONLY_KEYS if key in mapping}
        if canonical not in TORCH_NAMES and any(flags.values()):
            key = next(k for k, v in flags.items() if v)
            raise source.error(mapping[key].line, f"{where}.{key}",
                               f"applies to pytorch only (the client reports torch's build, "
                               f"not {dep_name}'s); move it to the pytorch entry")
        deps.append(Dependency(dep_name, version_range, entry.line, **flags))
    return tuple(deps)

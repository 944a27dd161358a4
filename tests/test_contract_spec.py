"""runtime-spec.yaml and accelerator-config.yaml parsing: the examples load as written,
and every bad file becomes one ContractError naming the file, the line and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from brokerd.contract import ContractError
from brokerd.contract.accel_config import parse_accelerator_config
from brokerd.contract.convert import requirement_from_request
from brokerd.contract.spec import parse_runtime_spec
from brokerd.devices.model import Device

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ISSUE_SPEC = """\
required_features: [{gpu_compute_capability: sm_80}, {memory_bandwidth_gbps: 2000}, {driver_version_min: 535.54.03}]
dependencies: [{name: pytorch, version_range: "2.1.0,2.2.0"}, {name: torchvision, version_range: "0.16.0,0.17.0"}]
"""
ISSUE_CONFIG = """\
backend: auto
device_selection_policy: [{priority: 1, criteria: [{type: gpu_compute_capability, min: sm_80}, {type: driver_version, min: 535.54.03}]}, {priority: 2, criteria: [{type: gpu_vendor, equals: amd}]}]
runtime_contract: ./runtime-spec.yaml
rocm_config: {memory_pool_size_mb: 16384}
amp_config: {dtype: float16, grad_scaler: true}
"""  # noqa: E501


def test_example_spec_loads_as_written() -> None:
    spec = parse_runtime_spec((EXAMPLES / "runtime-spec.yaml").read_text(), "runtime-spec.yaml")
    assert [c.canonical for c in spec.compute_capabilities] == ["sm_80"]
    assert spec.memory_bandwidth_gbps == 2000
    assert spec.driver_version_min == "535.54.03"
    assert spec.min_memory_mib == 20 * 1024
    assert [(d.name, str(d.version_range)) for d in spec.dependencies] == [("pytorch", "2.4.0,3.0.0")]


def test_example_config_loads_as_written() -> None:
    config = parse_accelerator_config((EXAMPLES / "accelerator-config.yaml").read_text())
    assert config.backend == "auto"
    assert [p.priority for p in config.priorities] == [1, 2]
    assert [c.type for c in config.priorities[0].criteria] == ["gpu_compute_capability",
                                                                "driver_version"]
    assert config.runtime_contract == "./runtime-spec.yaml"
    assert config.memory_pool_size_mb == 16384
    assert (config.amp_dtype, config.grad_scaler) == ("bfloat16", False)


def test_issue_flow_style_loads() -> None:
    spec = parse_runtime_spec(ISSUE_SPEC, "runtime-spec.yaml")
    assert spec.driver_version_min == "535.54.03" and len(spec.dependencies) == 2
    config = parse_accelerator_config(ISSUE_CONFIG, "accelerator-config.yaml")
    assert config.priorities[1].criteria[0].equals == "amd"
    assert (config.amp_dtype, config.grad_scaler) == ("float16", True)


def test_versions_stay_text() -> None:
    # YAML would read 2.10 as the float 2.1; a version must stay as written.
    spec = parse_runtime_spec("dependencies: [{name: torch, version_range: 2.10}]")
    assert str(spec.dependencies[0].version_range) == "2.10"
    assert spec.dependencies[0].version_range.contains("2.10.1")
    assert not spec.dependencies[0].version_range.contains("2.9.0")


def test_per_vendor_capabilities_and_driver_minimums() -> None:
    spec = parse_runtime_spec("""\
required_features:
  - gpu_compute_capability: [sm_80, gfx90a, Xe_HPG]
  - driver_version_min: {nvidia: 535.54.03, amd: 6.7.0}
  - min_memory: 40GiB
  - distributed: true
""")
    assert spec.capability_for("amd").canonical == "gfx90a"
    assert spec.driver_minimum("nvidia") == "535.54.03"
    assert spec.driver_minimum("amd") == "6.7.0"
    assert spec.driver_minimum("intel") == ""
    assert spec.min_memory_mib == 40960 and spec.distributed


def test_plain_driver_minimum_applies_to_the_named_vendor_only() -> None:
    spec = parse_runtime_spec("required_features: [{gpu_compute_capability: sm_80}, "
                              "{driver_version_min: 535.54.03}]")
    assert spec.driver_minimum("nvidia") == "535.54.03"
    assert spec.driver_minimum("amd") == ""
    anyone = parse_runtime_spec("required_features: [{driver_version_min: 535.54.03}]")
    assert anyone.driver_minimum("amd") == "535.54.03"


def test_empty_files_are_empty_contracts() -> None:
    assert parse_runtime_spec("", "x.yaml").compute_capabilities == ()
    assert parse_runtime_spec("# nothing yet\n", "x.yaml").dependencies == ()
    assert parse_accelerator_config("").backend == "auto"


@pytest.mark.parametrize(("text", "expected"), [
    ("required_features:\n  - gpu_compute_capabilty: sm_80\n",
     "spec.yaml:2: required_features[0].gpu_compute_capabilty: unknown key "
     "'gpu_compute_capabilty'; did you mean 'gpu_compute_capability'?"),
    ("requird_features: []\n",
     "spec.yaml:1: requird_features: unknown key 'requird_features'; did you mean "
     "'required_features'?"),
    ("dependencies:\n  - name: torch\n    version_range: \"2.2.0,2.1.0\"\n",
     "spec.yaml:3: dependencies[0].version_range: impossible version range"),
    ("dependencies:\n  - name: torch\n    versoin_range: \"2.1,2.2\"\n",
     "spec.yaml:3: dependencies[0].versoin_range: unknown key 'versoin_range'; did you mean "
     "'version_range'?"),
    ("dependencies:\n  - version_range: \"2.1,2.2\"\n", "spec.yaml:2: dependencies[0]: missing 'name'"),
    ("dependencies: {name: torch}\n", "spec.yaml:1: dependencies: expected a list"),
    ("required_features:\n  - memory_bandwidth_gbps: fast\n",
     "spec.yaml:2: required_features[0].memory_bandwidth_gbps: expected a number, got str 'fast'"),
    ("required_features:\n  - memory_bandwidth_gbps: -5\n",
     "spec.yaml:2: required_features[0].memory_bandwidth_gbps: must be positive"),
    ("required_features:\n  - gpu_compute_capability: hopper\n",
     "spec.yaml:2: required_features[0].gpu_compute_capability: not an architecture"),
    ("required_features:\n  - gpu_compute_capability: [sm_80, sm_90]\n",
     "spec.yaml:2: required_features[0].gpu_compute_capability: two minimums for NVIDIA"),
    ("required_features:\n  - min_memory: 20\n",
     "spec.yaml:2: required_features[0].min_memory: give a unit: 20GiB or 20MiB"),
    ("required_features:\n  - min_memory: 20 potatoes\n",
     "spec.yaml:2: required_features[0].min_memory: not a size"),
    ("required_features:\n  - driver_version_min: latest\n",
     "spec.yaml:2: required_features[0].driver_version_min: not a driver version"),
    ("required_features:\n  - driver_version_min: {nvidai: 535.54.03}\n",
     "spec.yaml:2: required_features[0].driver_version_min.nvidai: unknown key 'nvidai'; "
     "did you mean 'nvidia'?"),
    ("required_features:\n  - min_memory: 20GiB\n  - min_memory: 30GiB\n",
     "spec.yaml:3: required_features[1].min_memory: given twice (first on line 2)"),
    ("dependencies:\n  - name: torch\n  - name: torch\n",
     "spec.yaml:3: dependencies[1].name: torch listed twice (first on line 2)"),
    ("required_features: [\n", "spec.yaml:2: not valid YAML"),
    ("dependencies: []\ndependencies: []\n", "spec.yaml:2: dependencies: duplicate key (first on line 1)"),
    ("- just a list\n", "spec.yaml:1: expected a mapping"),
    ("required_features:\n  - distributed: yes please\n",
     "spec.yaml:2: required_features[0].distributed: expected true or false"),
])
def test_bad_spec_names_file_line_and_key(text: str, expected: str) -> None:
    with pytest.raises(ContractError) as info:
        parse_runtime_spec(text, "spec.yaml")
    assert str(info.value).startswith(expected), str(info.value)


@pytest.mark.parametrize(("text", "expected"), [
    ("backend: cudaa\n", "cfg.yaml:1: backend: unknown backend 'cudaa'; did you mean 'cuda'?"),
    ("backend: [cuda]\n", "cfg.yaml:1: backend: expected text, got a list"),
    ("backnd: auto\n", "cfg.yaml:1: backnd: unknown key 'backnd'; did you mean 'backend'?"),
    ("device_selection_policy:\n  - priority: 1\n    criteria:\n      - type: gpu_vender\n"
     "        equals: amd\n",
     "cfg.yaml:4: device_selection_policy[0].criteria[0].type: unknown criterion type "
     "'gpu_vender'; did you mean 'gpu_vendor'?"),
    ("device_selection_policy:\n  - priority: 1\n    criteria:\n      - type: gpu_compute_capability\n"
     "        min: sm_90\n        max: sm_80\n",
     "cfg.yaml:4: device_selection_policy[0].criteria[0]: impossible range: min sm_90 is above "
     "max sm_80"),
    ("device_selection_policy:\n  - priority: 1\n    criteria:\n      - type: memory\n"
     "        min: 80GiB\n        max: 40GiB\n",
     "cfg.yaml:4: device_selection_policy[0].criteria[0]: impossible range"),
    ("device_selection_policy:\n  - priority: 1\n    criteria:\n      - type: driver_version\n"
     "        minimum: 535\n",
     "cfg.yaml:5: device_selection_policy[0].criteria[0].minimum: unknown key 'minimum'"),
    ("device_selection_policy:\n  - priority: 1\n    criteria:\n      - type: gpu_compute_capability\n"
     "        min: sm_80\n        max: gfx90a\n",
     "cfg.yaml:4: device_selection_policy[0].criteria[0]: min sm_80 and max gfx90a are "
     "different vendors'"),
    ("device_selection_policy:\n  - priority: 0\n    criteria: [{type: gpu_vendor, equals: amd}]\n",
     "cfg.yaml:2: device_selection_policy[0].priority: expected a whole number >= 1"),
    ("device_selection_policy:\n  - criteria: [{type: gpu_vendor, equals: amd}]\n",
     "cfg.yaml:2: device_selection_policy[0]: missing 'priority'"),
    ("device_selection_policy:\n  - priority: 1\n    criteria: [{type: gpu_vendor, equals: amdd}]\n",
     "cfg.yaml:3: device_selection_policy[0].criteria[0].equals: unknown vendor 'amdd'; did you "
     "mean 'amd'?"),
    ("device_selection_policy:\n  - priority: 1\n    criteria: [{type: gpu_vendor}]\n",
     "cfg.yaml:3: device_selection_policy[0].criteria[0]: gpu_vendor needs one of: equals"),
    ("rocm_config: {memory_pool_size_mb: lots}\n",
     "cfg.yaml:1: rocm_config.memory_pool_size_mb: expected a number"),
    ("rocm_config: {memory_pool_size: 1}\n",
     "cfg.yaml:1: rocm_config.memory_pool_size: unknown key 'memory_pool_size'; did you mean "
     "'memory_pool_size_mb'?"),
    ("amp_config:\n  dtype: float61\n",
     "cfg.yaml:2: amp_config.dtype: unknown dtype 'float61'; did you mean 'float16'?"),
    ("amp_config:\n  grad_scaler: maybe\n", "cfg.yaml:2: amp_config.grad_scaler: expected true or false"),
])
def test_bad_config_names_file_line_and_key(text: str, expected: str) -> None:
    with pytest.raises(ContractError) as info:
        parse_accelerator_config(text, "cfg.yaml")
    assert str(info.value).startswith(expected), str(info.value)


def test_config_aliases() -> None:
    assert parse_accelerator_config("backend: oneapi").backend == parse_accelerator_config(
        "backend: xpu").backend
    assert parse_accelerator_config("backend: oneapi").backend_as_written == "oneapi"
    assert parse_accelerator_config("amp_config: {dtype: bf16}").amp_dtype == "bfloat16"
    assert parse_accelerator_config("amp_config: {dtype: none}").amp_dtype == "none"
    assert parse_accelerator_config("amp_config: {dtype: null}").amp_dtype == "none"


def _dev(**kw: object) -> Device:
    base: dict[str, object] = dict(index=0, uuid="u", vendor="nvidia", name="NVIDIA A100",
                                   memory_mib=40960, backend="cuda", arch="sm_80",
                                   driver_version="535.104.05", memory_bandwidth_gbps=1555)
    base.update(kw)
    return Device(**base)  # type: ignore[arg-type]


def test_criteria_match_devices() -> None:
    config = parse_accelerator_config("""\
device_selection_policy:
  - priority: 1
    criteria:
      - {type: gpu_compute_capability, min: sm_80, max: sm_89}
      - {type: driver_version, min: 535.54.03}
      - {type: memory, min: 40GiB}
      - {type: gpu_name, contains: a100}
  - priority: 2
    criteria: [{type: gpu_vendor, equals: amd}, {type: numa_node, equals: 1}]
  - priority: 3
    criteria: [{type: memory_bandwidth_gbps, min: 3000}]
""")
    assert config.rank(_dev()) == 1
    assert config.rank(_dev(arch="sm_90")) == 4  # above max, no other priority: last
    assert config.rank(_dev(driver_version="525.60.13")) == 4
    assert config.rank(_dev(driver_version="")) == 4  # unknown driver does not match a min
    assert config.rank(_dev(vendor="amd", arch="gfx90a", numa_node=1)) == 2
    assert config.rank(_dev(vendor="amd", arch="gfx90a", numa_node=0)) == 4
    assert config.rank(_dev(arch="sm_90", memory_bandwidth_gbps=3350)) == 3


def test_requirement_from_request_parses_both_files() -> None:
    req = requirement_from_request(
        2, 1024, (EXAMPLES / "runtime-spec.yaml").read_text(), "runtime-spec.yaml",
        (EXAMPLES / "accelerator-config.yaml").read_text(), "accelerator-config.yaml", None)
    assert req.gpus == 2 and req.min_memory_mib == 20480  # the spec's min_memory wins
    assert req.spec is not None and req.config is not None
    empty = requirement_from_request(1, 0, "", "", "", "", None)
    assert empty.spec is None and empty.config is None
    with pytest.raises(ContractError, match=r"^my-spec.yaml:1: "):
        requirement_from_request(1, 0, "bogus: 1", "my-spec.yaml", "", "", None)

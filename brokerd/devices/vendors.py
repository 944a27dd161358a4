"""Vendor facts: the one table of what the daemon knows about GPU vendors beyond what
the probes report and what the backend table (vaccel_common.backends) says about torch
backends.

The contract reads everything vendor-specific from here and stays vendor-neutral itself:
how each vendor names its architectures and which of them meet which, which compiled
kernels run where, the marketing words in front of a device's model name, and a few
well-known devices per architecture for suggestions. Only the daemon needs these facts
(the client learns its backend from the lease), so the table lives in the daemon, not
in the shared layer. tests/test_project_rules.py greps the daemon to keep it that way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NumberedArchs:
    """Architectures named by a prefix, a major number and one minor digit, optionally
    followed by a variant letter for code that runs on that architecture only. Compiled
    code runs on later minors of its major; a virtual architecture (the PTX a torch
    build carries) runs on any later architecture after a JIT compile."""

    prefix: str  # the canonical spelling's prefix, joined to the digits by "_"
    other_prefixes: tuple[str, ...]  # also accepted, e.g. the virtual architectures' prefix
    virtual_prefix: str  # how a virtual architecture is written: prefix + major + minor
    variants: str  # the variant letters
    dotted: bool  # whether "major.minor" means this vendor's architecture


@dataclass(frozen=True)
class SteppedArchs:
    """Architectures named by a prefix, a major number and two hexadecimal digits.
    They compare only within one major; a generic target's code runs on the concrete
    targets it lists."""

    prefix: str
    generic_targets: Mapping[str, frozenset[str]]


@dataclass(frozen=True)
class OrderedArchs:
    """Architectures named from a list in capability order (a later one meets a minimum
    of an earlier one); `aliases` maps the prefixes of torch's ahead-of-time target
    names to them."""

    names: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...]


ArchScheme = NumberedArchs | SteppedArchs | OrderedArchs


@dataclass(frozen=True)
class Vendor:
    """One GPU vendor's facts."""

    name: str  # the inventory's and the probes' `vendor` value
    title: str  # how a message writes the vendor
    archs: ArchScheme
    arch_hint: str  # the accepted architecture spellings, for a parse error
    example_devices: Mapping[str, str] = field(default_factory=dict)  # arch -> a known device


NVIDIA = Vendor(
    name="nvidia",
    title="NVIDIA",
    archs=NumberedArchs(prefix="sm", other_prefixes=("compute",), virtual_prefix="compute_",
                        variants="af", dotted=True),
    arch_hint="sm_80 or 8.0",
    example_devices={"sm_60": "P100", "sm_70": "V100", "sm_75": "T4", "sm_80": "A100",
                     "sm_90": "H100", "sm_100": "B200"},
)

AMD = Vendor(
    name="amd",
    title="AMD",
    archs=SteppedArchs(prefix="gfx", generic_targets={
        "gfx9-generic": frozenset({"gfx900", "gfx902", "gfx904", "gfx906", "gfx909", "gfx90c"}),
        "gfx9-4-generic": frozenset({"gfx940", "gfx941", "gfx942", "gfx950"}),
        "gfx10-1-generic": frozenset({"gfx1010", "gfx1011", "gfx1012", "gfx1013"}),
        "gfx10-3-generic": frozenset({f"gfx103{i}" for i in range(7)}),
        "gfx11-generic": frozenset({"gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150",
                                    "gfx1151", "gfx1152", "gfx1153"}),
        "gfx12-generic": frozenset({"gfx1200", "gfx1201"}),
    }),
    arch_hint="gfx90a",
    example_devices={"gfx906": "MI50", "gfx908": "MI100", "gfx90a": "MI250X",
                     "gfx942": "MI300X", "gfx950": "MI355X", "gfx1100": "RX 7900 XTX"},
)

# Intel architectures in capability order; a later entry satisfies a minimum of an earlier one.
XE_ORDER: tuple[str, ...] = ("Xe_LP", "Xe_LPG", "Xe_HPG", "Xe_HPC", "Xe2_LPG", "Xe2_HPG", "Xe3_LPG")
INTEL = Vendor(
    name="intel",
    title="Intel",
    archs=OrderedArchs(names=XE_ORDER, aliases=(
        ("pvc", "Xe_HPC"), ("bmg", "Xe2_HPG"), ("dg2", "Xe_HPG"), ("acm", "Xe_HPG"),
        ("ats-m", "Xe_HPG"), ("lnl", "Xe2_LPG"), ("mtl", "Xe_LPG"), ("arl", "Xe_LPG"),
        ("ptl", "Xe3_LPG"), ("tgl", "Xe_LP"), ("dg1", "Xe_LP"),
    )),
    arch_hint=f"one of {', '.join(XE_ORDER)}",
    example_devices={"Xe_HPG": "Flex 170", "Xe_HPC": "Max 1550", "Xe2_HPG": "Arc B580"},
)

# Every GPU vendor, in the order messages list them and architecture names are tried.
VENDORS: tuple[Vendor, ...] = (NVIDIA, AMD, INTEL)
GPU_VENDORS: tuple[str, ...] = tuple(v.name for v in VENDORS)
# The vendor values a device may carry: the GPU vendors and the host's CPU.
DEVICE_VENDORS: tuple[str, ...] = (*GPU_VENDORS, "cpu")
VENDOR_TITLES: dict[str, str] = {v.name: v.title for v in VENDORS}
# The vendor a message shows in an example ({type: gpu_vendor, equals: ...}).
EXAMPLE_VENDOR = AMD.name

# Words in front of a device's model in its marketing name ("<vendor> <series> <model>").
NAME_PREFIX_WORDS = frozenset({"nvidia", "amd", "intel", "intel(r)", "tesla", "instinct",
                               "geforce", "data", "center", "gpu", "radeon"})
# Series words that belong to the model they precede ("RTX 4090", "Max 1550").
SERIES_WORDS = frozenset({"rtx", "gtx", "max", "flex", "arc", "pro", "quadro", "rx"})

# accelerator-config.yaml's section for the memory pool, named after the runtime that
# introduced it; users write this key.
MEMORY_POOL_SECTION = "rocm_config"

# The local version labels ("2.1.0+cu121") upstream PyTorch publishes its wheels under, per
# backend. A label outside these ("2.1.0a0+32f93b1" from a vendor's container, "+nv24.03")
# marks a vendor's fork or a source build.
UPSTREAM_TORCH_LABELS: dict[str, str] = {
    "cuda": r"cu\d{2,3}",
    "rocm": r"rocm\d+(?:\.\d+){0,2}",
    "xpu": r"xpu",
    "cpu": r"cpu(?:\.cxx11\.abi)?",
}

# Architectures whose unified memory pages on demand once XNACK is on (the memory pool
# section's use_unified_memory); on others the runtime cannot confirm it.
UNIFIED_MEMORY_ARCHS = frozenset({"gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"})

"""Comparison of software versions, driver versions and GPU architectures.

Three different orders, kept apart on purpose:
- package versions (torch, torchvision) follow PEP 440 via `packaging`;
- driver versions ("535.54.03", "6.7.0") compare numerically component by component;
- architectures compare only within one family: NVIDIA sm_XY by (major, minor), AMD
  gfx targets within one major family (gfx908 < gfx90a < gfx942, but gfx1100 is not
  "more" than gfx90a), Intel Xe names by a small ordered table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

# --- package versions --------------------------------------------------------------------


def parse_version(text: str) -> Version:
    """A PEP 440 version; raises ValueError naming the text."""
    try:
        return Version(str(text).strip())
    except InvalidVersion:
        raise ValueError(f"not a version: {text!r} (expected e.g. 2.1.0)") from None


@dataclass(frozen=True)
class VersionRange:
    """A dependency's accepted versions. `"2.1.0,2.2.0"` means >=2.1.0,<2.2.0 (pip-like:
    lower bound inclusive, upper bound exclusive)."""

    text: str
    specifier: SpecifierSet

    def contains(self, version: str) -> bool:
        """Whether `version` is in range. Local labels (+cu121) are ignored; pre-releases
        count (a nightly inside the range matches), except pre-releases of an exclusive
        upper bound, as in pip."""
        try:
            parsed = parse_version(version)
        except ValueError:
            return False
        return self.specifier.contains(parsed, prereleases=True)

    def __str__(self) -> str:
        return self.text


_OPERATOR_CHARS = set("<>=!~")


def parse_version_range(text: str) -> VersionRange:
    """Parse "low,high" ([low, high)), "low," or a bare "low" (at least low), ",high"
    (below high), or a PEP 440 specifier set (">=2.1,<2.3"). Raises ValueError for a bad
    version or a range no version can satisfy."""
    text = str(text).strip()
    if not text:
        raise ValueError("empty version range (expected e.g. \"2.1.0,2.2.0\")")
    if _OPERATOR_CHARS & set(text):
        try:
            spec = SpecifierSet(text)
        except InvalidSpecifier:
            raise ValueError(f"not a version range: {text!r} (expected e.g. \"2.1.0,2.2.0\" "
                             "or \">=2.1,<2.2\")") from None
        _check_not_empty(text, spec)
        return VersionRange(text, spec)
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 2:
        raise ValueError(f"not a version range: {text!r} (expected \"low,high\")")
    low = parts[0]
    high = parts[1] if len(parts) == 2 else ""
    if not low and not high:
        raise ValueError(f"not a version range: {text!r} (expected \"low,high\")")
    clauses = []
    if low:
        clauses.append(f">={parse_version(low)}")
    if high:
        clauses.append(f"<{parse_version(high)}")
    if low and high and parse_version(low) >= parse_version(high):
        raise ValueError(f"impossible version range {text!r}: lower bound {low} is not below "
                         f"upper bound {high} (the upper bound is exclusive)")
    return VersionRange(text, SpecifierSet(",".join(clauses)))


def _check_not_empty(text: str, spec: SpecifierSet) -> None:
    """Catch the obvious empty specifier sets (>=2.3,<2.1); exotic ones pass."""
    lows = [Version(s.version) for s in spec if s.operator in (">=", ">", "==")
            and "*" not in s.version]
    highs = [(Version(s.version), s.operator) for s in spec if s.operator in ("<", "<=", "==")
             and "*" not in s.version]
    if not lows or not highs:
        return
    low = max(lows)
    for high, op in highs:
        if low > high or (low == high and op == "<"):
            raise ValueError(f"impossible version range {text!r}: nothing is at least {low} "
                             f"and {op}{high}")


# --- driver versions ---------------------------------------------------------------------

_LEADING_DIGITS = re.compile(r"^(\d+)")


def parse_driver_version(text: str) -> tuple[int, ...]:
    """"535.54.03" -> (535, 54, 3). Dot-separated numbers, read up to the first
    character that is not a digit or a dot ("550.54.14-1ubuntu" is 550.54.14); raises
    ValueError when it does not start with a number."""
    parts: list[int] = []
    for piece in str(text).strip().split("."):
        match = _LEADING_DIGITS.match(piece)
        if not match:
            break
        parts.append(int(match.group(1)))
        if match.end() < len(piece):  # a packaging suffix: the version ended here
            break
    if not parts:
        raise ValueError(f"not a driver version: {text!r} (expected e.g. 535.54.03)")
    return tuple(parts)


def compare_driver_versions(a: str, b: str) -> int:
    """-1, 0 or 1; missing trailing components count as 0 (535.54 == 535.54.0)."""
    pa, pb = parse_driver_version(a), parse_driver_version(b)
    width = max(len(pa), len(pb))
    pa += (0,) * (width - len(pa))
    pb += (0,) * (width - len(pb))
    return (pa > pb) - (pa < pb)


# --- architectures -----------------------------------------------------------------------

# Intel architectures in capability order; a later entry satisfies a minimum of an earlier one.
XE_ORDER: tuple[str, ...] = ("Xe_LP", "Xe_LPG", "Xe_HPG", "Xe_HPC", "Xe2_LPG", "Xe2_HPG", "Xe3_LPG")
_XE_BY_LOWER = {name.lower(): name for name in XE_ORDER}
# torch's ahead-of-time target names for Intel GPUs (its arch list), by prefix.
_INTEL_TARGETS: tuple[tuple[str, str], ...] = (
    ("pvc", "Xe_HPC"), ("bmg", "Xe2_HPG"), ("dg2", "Xe_HPG"), ("acm", "Xe_HPG"),
    ("ats-m", "Xe_HPG"), ("lnl", "Xe2_LPG"), ("mtl", "Xe_LPG"), ("arl", "Xe_LPG"),
    ("ptl", "Xe3_LPG"), ("tgl", "Xe_LP"), ("dg1", "Xe_LP"),
)
# AMD's generic targets and the concrete targets their code objects run on.
_AMD_GENERIC: dict[str, frozenset[str]] = {
    "gfx9-generic": frozenset({"gfx900", "gfx902", "gfx904", "gfx906", "gfx909", "gfx90c"}),
    "gfx9-4-generic": frozenset({"gfx940", "gfx941", "gfx942", "gfx950"}),
    "gfx10-1-generic": frozenset({"gfx1010", "gfx1011", "gfx1012", "gfx1013"}),
    "gfx10-3-generic": frozenset({f"gfx103{i}" for i in range(7)}),
    "gfx11-generic": frozenset({"gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150",
                                "gfx1151", "gfx1152", "gfx1153"}),
    "gfx12-generic": frozenset({"gfx1200", "gfx1201"}),
}
FAMILY_VENDOR = {"sm": "nvidia", "xe": "intel"}  # gfxN families are all "amd"

_SM = re.compile(r"^(?:sm|compute)_?(\d+)([af]?)$", re.IGNORECASE)
_DOTTED = re.compile(r"^(\d+)\.(\d+)$")
_GFX = re.compile(r"^gfx(\d+)([0-9a-f])([0-9a-f])$", re.IGNORECASE)

# A few well-known devices per architecture, for suggestions ("run on a host with A100/H100").
EXAMPLE_DEVICES: dict[str, str] = {
    "sm_60": "P100", "sm_70": "V100", "sm_75": "T4", "sm_80": "A100", "sm_90": "H100",
    "sm_100": "B200",
    "gfx906": "MI50", "gfx908": "MI100", "gfx90a": "MI250X", "gfx942": "MI300X",
    "gfx950": "MI355X", "gfx1100": "RX 7900 XTX",
    "Xe_HPG": "Flex 170", "Xe_HPC": "Max 1550", "Xe2_HPG": "Arc B580",
}


@dataclass(frozen=True, order=False)
class Capability:
    """A parsed architecture. Two capabilities are comparable only in the same family."""

    family: str  # "sm", "gfx9", "gfx11", ..., "xe"
    key: tuple[int, ...]
    canonical: str  # sm_80, gfx90a, Xe_HPG
    variant: str = ""  # "a"/"f" for NVIDIA's architecture-specific targets (sm_90a)

    @property
    def vendor(self) -> str:
        return FAMILY_VENDOR.get(self.family, "amd")


def parse_capability(text: str) -> Capability:
    """Parse sm_80 / "8.0" / compute_90 (NVIDIA), gfx90a[:xnack-] (AMD), Xe_HPG or a torch
    Intel target name such as pvc (Intel). Raises ValueError with the accepted forms."""
    raw = str(text).strip()
    dotted = _DOTTED.match(raw)
    if dotted:
        raw = f"sm_{dotted.group(1)}{dotted.group(2)}"
    sm = _SM.match(raw)
    if sm:
        digits, variant = sm.group(1), sm.group(2).lower()
        if len(digits) < 2:
            raise ValueError(f"not an architecture: {text!r} (expected e.g. sm_80)")
        major, minor = int(digits[:-1]), int(digits[-1])
        return Capability("sm", (major, minor), f"sm_{major}{minor}{variant}", variant)
    gfx = _GFX.match(raw.split(":", 1)[0])
    if gfx:
        major = int(gfx.group(1))
        key = (major, int(gfx.group(2), 16), int(gfx.group(3), 16))
        return Capability(f"gfx{major}", key, raw.split(":", 1)[0].lower())
    xe = _XE_BY_LOWER.get(raw.lower()) or _intel_target(raw)
    if xe:
        return Capability("xe", (XE_ORDER.index(xe),), xe)
    raise ValueError(f"not an architecture: {text!r} (expected sm_80 or 8.0 for NVIDIA, "
                     f"gfx90a for AMD, one of {', '.join(XE_ORDER)} for Intel)")


def _intel_target(name: str) -> str | None:
    lowered = name.lower()
    return next((xe for prefix, xe in _INTEL_TARGETS if lowered.startswith(prefix)), None)


def try_capability(text: str) -> Capability | None:
    try:
        return parse_capability(text)
    except ValueError:
        return None


def compare_capabilities(a: Capability, b: Capability) -> int | None:
    """-1, 0 or 1 within one family; None when the two cannot be compared."""
    if a.family != b.family:
        return None
    return (a.key > b.key) - (a.key < b.key)


def at_least(device: Capability, minimum: Capability) -> bool:
    """Whether `device` meets `minimum` (False across families)."""
    cmp = compare_capabilities(device, minimum)
    return cmp is not None and cmp >= 0


def at_most(device: Capability, maximum: Capability) -> bool:
    cmp = compare_capabilities(device, maximum)
    return cmp is not None and cmp <= 0


def same_capability(device: Capability, other: Capability) -> bool:
    return compare_capabilities(device, other) == 0


def examples_meeting(minimum: Capability, limit: int = 2) -> list[str]:
    """Well-known devices that meet `minimum`, oldest first, for suggestions."""
    found = []
    for arch, name in EXAMPLE_DEVICES.items():
        cap = parse_capability(arch)
        if at_least(cap, minimum):
            found.append((cap.key, name))
    return [name for _, name in sorted(found)[:limit]]


# --- kernel images -----------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSupport:
    """How a torch build would run on a device: `status` is exact | compatible | ptx |
    none | unknown; `via` names the kernel or PTX architecture that would be used."""

    status: str
    via: str = ""


def kernel_support(device_arch: str, kernel_archs: list[str] | tuple[str, ...],
                   ptx_archs: list[str] | tuple[str, ...]) -> KernelSupport:
    """Whether compiled kernels (or PTX to JIT from) exist for `device_arch`.

    NVIDIA machine code runs on later minors of the same major (sm_80 code on sm_86),
    except architecture-specific targets (sm_90a); PTX runs on any later architecture
    after a JIT compile. AMD code objects need the exact target or a generic target that
    covers it. Intel targets match by architecture.
    """
    device = try_capability(device_arch)
    if device is None:
        return KernelSupport("unknown")
    kernels = [k for k in (try_capability(a) for a in kernel_archs) if k is not None]
    # A name we cannot read might be the one that fits: say "unknown", never "none".
    unreadable = any(try_capability(a) is None and a.lower() not in _AMD_GENERIC
                     for a in kernel_archs)
    for k in kernels:
        if k.family == device.family and k.key == device.key:
            return KernelSupport("exact", k.canonical)
    if device.family == "sm":
        same_major = [k for k in kernels if k.family == "sm" and not k.variant
                      and k.key[0] == device.key[0] and k.key < device.key]
        if same_major:
            return KernelSupport("compatible", max(same_major, key=lambda c: c.key).canonical)
        ptx = [p for p in (try_capability(a) for a in ptx_archs)
               if p is not None and p.family == "sm" and not p.variant and p.key <= device.key]
        if ptx:
            best = max(ptx, key=lambda c: c.key)
            return KernelSupport("ptx", f"compute_{best.key[0]}{best.key[1]}")
    if device.family.startswith("gfx"):
        generic = [a for a in kernel_archs if device.canonical in _AMD_GENERIC.get(a.lower(), ())]
        if generic:
            return KernelSupport("compatible", generic[0])
    return KernelSupport("unknown" if unreadable else "none")


def describe_arch_list(kernel_archs: list[str] | tuple[str, ...],
                       ptx_archs: list[str] | tuple[str, ...]) -> str:
    """"sm_50..sm_86 and PTX compute_86" — a short form of a torch build's arch list."""
    kernels = list(kernel_archs)
    if len(kernels) > 2:
        text = f"{kernels[0]}..{kernels[-1]}"
    else:
        text = ", ".join(kernels) or "no kernels"
    if ptx_archs:
        text += f" and PTX {', '.join(ptx_archs)}"
    return text

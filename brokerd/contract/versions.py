"""Comparison of software versions, driver versions and GPU architectures.

Three different orders, kept apart on purpose:
- package versions (torch, torchvision) follow PEP 440 via `packaging`;
- driver versions ("535.54.03", "6.7.0") compare numerically component by component;
- architectures compare only within one family, in the numbering scheme the vendor table
  (brokerd/devices/vendors.py) gives each vendor: numbered ones by (major, minor), stepped ones
  within one major only, named ones by their place in an ordered list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from brokerd.devices.vendors import VENDORS, NumberedArchs, OrderedArchs, SteppedArchs, Vendor

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

_DOTTED = re.compile(r"^(\d+)\.(\d+)$")
_BY_NAME: dict[str, Vendor] = {v.name: v for v in VENDORS}
# Generic targets of every stepped scheme: names a build may carry that are no architecture.
_GENERIC_TARGETS: dict[str, frozenset[str]] = {
    name: targets for v in VENDORS if isinstance(v.archs, SteppedArchs)
    for name, targets in v.archs.generic_targets.items()
}
# A few well-known devices per architecture, for suggestions ("run on a host with A100/H100").
_EXAMPLE_DEVICES: dict[str, str] = {arch: name for v in VENDORS for arch, name in v.example_devices.items()}


@dataclass(frozen=True, order=False)
class Capability:
    """A parsed architecture. Two capabilities are comparable only in the same family."""

    family: str  # one numbering: a numbered prefix, a stepped prefix with its major, a vendor
    key: tuple[int, ...]
    canonical: str  # the name as the vendor writes it
    variant: str = ""  # the letter of an architecture-specific target ("" for portable code)
    vendor: str = ""  # the vendor table's name of the vendor


def parse_capability(text: str) -> Capability:
    """Parse an architecture in any spelling the vendor table accepts (a numbered name, its
    dotted "major.minor" form or its virtual architecture; a stepped target with target
    features; an ordered name or a torch target name). Raises ValueError with the
    accepted forms."""
    raw = str(text).strip()
    for vendor in VENDORS:
        cap = _parse_with(vendor, text, raw)
        if cap is not None:
            return cap
    hints = ", ".join(f"{v.arch_hint} for {v.title}" for v in VENDORS)
    raise ValueError(f"not an architecture: {text!r} (expected {hints})")


def _parse_with(vendor: Vendor, text: str, raw: str) -> Capability | None:
    scheme = vendor.archs
    if isinstance(scheme, NumberedArchs):
        return _numbered(vendor.name, scheme, text, raw)
    if isinstance(scheme, SteppedArchs):
        return _stepped(vendor.name, scheme, raw)
    return _named(vendor.name, scheme, raw)


def _numbered(vendor: str, scheme: NumberedArchs, text: str, raw: str) -> Capability | None:
    dotted = _DOTTED.match(raw) if scheme.dotted else None
    if dotted:
        raw = f"{scheme.prefix}_{dotted.group(1)}{dotted.group(2)}"
    prefixes = "|".join(re.escape(p) for p in (scheme.prefix, *scheme.other_prefixes))
    match = re.match(rf"^(?:{prefixes})_?(\d+)([{scheme.variants}]?)$", raw, re.IGNORECASE)
    if not match:
        return None
    digits, variant = match.group(1), match.group(2).lower()
    if len(digits) < 2:
        raise ValueError(f"not an architecture: {text!r} (expected e.g. {scheme.prefix}_80)")
    major, minor = int(digits[:-1]), int(digits[-1])
    return Capability(scheme.prefix, (major, minor), f"{scheme.prefix}_{major}{minor}{variant}",
                      variant, vendor)


def _stepped(vendor: str, scheme: SteppedArchs, raw: str) -> Capability | None:
    target = raw.split(":", 1)[0]  # target features (":xnack-") leave the architecture alone
    match = re.match(rf"^{re.escape(scheme.prefix)}(\d+)([0-9a-f])([0-9a-f])$", target, re.IGNORECASE)
    if not match:
        return None
    major = int(match.group(1))
    key = (major, int(match.group(2), 16), int(match.group(3), 16))
    return Capability(f"{scheme.prefix}{major}", key, target.lower(), vendor=vendor)


def _named(vendor: str, scheme: OrderedArchs, raw: str) -> Capability | None:
    lowered = raw.lower()
    name = next((n for n in scheme.names if n.lower() == lowered), None) or next(
        (n for prefix, n in scheme.aliases if lowered.startswith(prefix)), None)
    if name is None:
        return None
    return Capability(vendor, (scheme.names.index(name),), name, vendor=vendor)


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
    for arch, name in _EXAMPLE_DEVICES.items():
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

    The device's numbering scheme decides: numbered machine code runs on later minors of
    the same major, except architecture-specific (variant) targets, and PTX runs on any
    later architecture after a JIT compile; stepped code objects need the exact target
    or a generic target that covers it; named targets match by architecture.
    """
    device = try_capability(device_arch)
    if device is None:
        return KernelSupport("unknown")
    kernels = [k for k in (try_capability(a) for a in kernel_archs) if k is not None]
    # A name we cannot read might be the one that fits: say "unknown", never "none".
    unreadable = any(try_capability(a) is None and a.lower() not in _GENERIC_TARGETS
                     for a in kernel_archs)
    for k in kernels:
        if k.family == device.family and k.key == device.key:
            return KernelSupport("exact", k.canonical)
    scheme = _BY_NAME[device.vendor].archs
    if isinstance(scheme, NumberedArchs):
        same_major = [k for k in kernels if k.family == device.family and not k.variant
                      and k.key[0] == device.key[0] and k.key < device.key]
        if same_major:
            return KernelSupport("compatible", max(same_major, key=lambda c: c.key).canonical)
        ptx = [p for p in (try_capability(a) for a in ptx_archs)
               if p is not None and p.family == device.family and not p.variant
               and p.key <= device.key]
        if ptx:
            best = max(ptx, key=lambda c: c.key)
            return KernelSupport("ptx", f"{scheme.virtual_prefix}{best.key[0]}{best.key[1]}")
    if isinstance(scheme, SteppedArchs):
        generic = [a for a in kernel_archs
                   if device.canonical in scheme.generic_targets.get(a.lower(), ())]
        if generic:
            return KernelSupport("compatible", generic[0])
    return KernelSupport("unknown" if unreadable else "none")


def describe_arch_list(kernel_archs: list[str] | tuple[str, ...],
                       ptx_archs: list[str] | tuple[str, ...]) -> str:
    """A short form of a torch build's arch list: "<first>..<last> and PTX <virtual>"."""
    kernels = list(kernel_archs)
    if len(kernels) > 2:
        text = f"{kernels[0]}..{kernels[-1]}"
    else:
        text = ", ".join(kernels) or "no kernels"
    if ptx_archs:
        text += f" and PTX {', '.join(ptx_archs)}"
    return text

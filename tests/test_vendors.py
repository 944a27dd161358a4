"""The vendor table (brokerd/devices/vendors.py) is consistent with itself and with the probes."""

from __future__ import annotations

from brokerd.contract.versions import parse_capability, try_capability
from brokerd.devices.probes import default_probes
from brokerd.devices.probes.cpu import CpuProbe
from brokerd.devices.vendors import (
    DEVICE_VENDORS,
    EXAMPLE_VENDOR,
    GPU_VENDORS,
    NAME_PREFIX_WORDS,
    SERIES_WORDS,
    VENDOR_TITLES,
    VENDORS,
    NumberedArchs,
    OrderedArchs,
    SteppedArchs,
)


def test_the_table_names_exactly_the_vendors_the_probes_report() -> None:
    probed = [p.vendor for p in default_probes()]
    assert probed == list(GPU_VENDORS)
    assert DEVICE_VENDORS == (*GPU_VENDORS, CpuProbe.vendor)
    assert len(set(DEVICE_VENDORS)) == len(DEVICE_VENDORS)
    assert set(VENDOR_TITLES) == set(GPU_VENDORS)
    assert EXAMPLE_VENDOR in GPU_VENDORS


def test_every_example_device_is_named_by_its_vendors_canonical_architecture() -> None:
    for vendor in VENDORS:
        assert vendor.example_devices, vendor.name
        for arch in vendor.example_devices:
            cap = parse_capability(arch)
            assert (cap.vendor, cap.canonical) == (vendor.name, arch)


def test_every_scheme_parses_as_its_own_vendor() -> None:
    for vendor in VENDORS:
        scheme = vendor.archs
        if isinstance(scheme, NumberedArchs):
            names = [f"{scheme.prefix}_80", f"{scheme.prefix}_90{scheme.variants[0]}",
                     *(f"{p}_80" for p in scheme.other_prefixes)]
            assert not scheme.dotted or parse_capability("8.0").vendor == vendor.name
        elif isinstance(scheme, SteppedArchs):
            names = [t for targets in scheme.generic_targets.values() for t in targets]
            # A generic target is no architecture: builds carry it, devices never are one.
            assert all(try_capability(g) is None for g in scheme.generic_targets)
        else:
            assert isinstance(scheme, OrderedArchs)
            assert {name for _, name in scheme.aliases} <= set(scheme.names)
            names = [*scheme.names, *(prefix for prefix, _ in scheme.aliases)]
        assert {parse_capability(n).vendor for n in names} == {vendor.name}, vendor.name


def test_an_unknown_architecture_lists_every_vendors_spellings() -> None:
    try:
        parse_capability("no-such-arch")
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("parsed an unknown architecture")
    for vendor in VENDORS:
        assert f"{vendor.arch_hint} for {vendor.title}" in message


def test_name_words_are_lower_case_because_names_are_compared_lowered() -> None:
    for word in (*NAME_PREFIX_WORDS, *SERIES_WORDS):
        assert word == word.lower()
    assert not NAME_PREFIX_WORDS & SERIES_WORDS

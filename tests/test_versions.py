"""Version-range, driver-version and architecture comparison, with property tests."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from brokerd.contract.versions import (
    at_least,
    compare_capabilities,
    compare_driver_versions,
    kernel_support,
    parse_capability,
    parse_version,
    parse_version_range,
)
from brokerd.devices.vendors import XE_ORDER

release = st.tuples(*[st.integers(0, 30)] * 3).map(lambda t: ".".join(map(str, t)))
local = st.sampled_from(["", "+cu121", "+cpu", "+rocm6.2"])
sm = st.tuples(st.integers(1, 15), st.integers(0, 9)).map(lambda t: f"sm_{t[0]}{t[1]}")
gfx9 = st.tuples(st.integers(0, 5), st.integers(0, 15)).map(lambda t: f"gfx9{t[0]}{t[1]:x}")
xe = st.sampled_from(XE_ORDER)
capability = st.one_of(sm, gfx9, xe)


@given(low=release, high=release, version=release, suffix=local)
def test_range_is_low_inclusive_high_exclusive(low: str, high: str, version: str,
                                              suffix: str) -> None:
    assume(parse_version(low) < parse_version(high))
    expected = parse_version(low) <= parse_version(version) < parse_version(high)
    assert parse_version_range(f"{low},{high}").contains(version + suffix) is expected


@given(low=release, high=release)
def test_inverted_or_empty_range_is_refused(low: str, high: str) -> None:
    assume(parse_version(low) >= parse_version(high))
    with pytest.raises(ValueError, match="impossible version range"):
        parse_version_range(f"{low},{high}")


@given(low=release, version=release)
def test_open_ranges(low: str, version: str) -> None:
    at_least_low = parse_version(version) >= parse_version(low)
    assert parse_version_range(low).contains(version) is at_least_low
    assert parse_version_range(f"{low},").contains(version) is at_least_low
    assert parse_version_range(f",{low}").contains(version) is (not at_least_low)


def test_range_forms_and_prereleases() -> None:
    r = parse_version_range("2.1.0,2.2.0")
    assert r.contains("2.1.0+cu121") and r.contains("2.1.2") and r.contains("2.1.5rc1")
    assert not r.contains("2.2.0") and not r.contains("2.2.0.dev20240101")
    assert not r.contains("not-a-version")
    spec = parse_version_range(">=2.1,<2.3")
    assert spec.contains("2.2.9") and not spec.contains("2.3.0")
    with pytest.raises(ValueError, match="impossible"):
        parse_version_range(">=2.3,<2.1")
    for bad in ("", ",", "a,b", "1,2,3", ">=>2"):
        with pytest.raises(ValueError):
            parse_version_range(bad)


@given(a=st.lists(st.integers(0, 999), min_size=1, max_size=4),
       b=st.lists(st.integers(0, 999), min_size=1, max_size=4))
def test_driver_versions_compare_numerically(a: list[int], b: list[int]) -> None:
    width = max(len(a), len(b))
    pad_a, pad_b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
    expected = (pad_a > pad_b) - (pad_a < pad_b)
    text_a, text_b = ".".join(f"{n:02d}" for n in a), ".".join(map(str, b))
    assert compare_driver_versions(text_a, text_b) == expected
    assert compare_driver_versions(text_b, text_a) == -expected


def test_driver_version_examples() -> None:
    assert compare_driver_versions("535.104.05", "535.54.03") == 1  # not a string compare
    assert compare_driver_versions("535.54", "535.54.0") == 0
    assert compare_driver_versions("550.54.14-1ubuntu", "550.54.14") == 0
    with pytest.raises(ValueError):
        compare_driver_versions("unknown", "1.0")


@given(a=capability, b=capability, c=capability)
def test_capability_order_is_a_total_order_within_a_family(a: str, b: str, c: str) -> None:
    ca, cb, cc = parse_capability(a), parse_capability(b), parse_capability(c)
    ab, ba = compare_capabilities(ca, cb), compare_capabilities(cb, ca)
    if ca.family != cb.family:
        assert ab is None and ba is None
        assert not at_least(ca, cb) and not at_least(cb, ca)
        return
    assert ab == -ba  # type: ignore[operator]
    assert compare_capabilities(ca, ca) == 0
    if ab is not None and ab <= 0 and compare_capabilities(cb, cc) in (-1, 0):
        assert compare_capabilities(ca, cc) in (-1, 0)  # transitive


@given(major=st.integers(1, 15), minor=st.integers(0, 9))
def test_sm_spellings_agree(major: int, minor: int) -> None:
    assert parse_capability(f"{major}.{minor}") == parse_capability(f"sm_{major}{minor}")
    assert parse_capability(f"sm_{major}{minor}").key == (major, minor)


def test_capability_examples() -> None:
    assert at_least(parse_capability("sm_90"), parse_capability("sm_80"))
    assert at_least(parse_capability("sm_100"), parse_capability("sm_90"))  # not a string compare
    assert not at_least(parse_capability("sm_75"), parse_capability("sm_80"))
    assert at_least(parse_capability("gfx942"), parse_capability("gfx90a"))
    assert at_least(parse_capability("gfx90a"), parse_capability("gfx908"))
    assert not at_least(parse_capability("gfx1100"), parse_capability("gfx90a"))  # other family
    assert at_least(parse_capability("Xe_HPC"), parse_capability("Xe_HPG"))
    assert parse_capability("gfx90a:xnack-").canonical == "gfx90a"
    assert parse_capability("xe_hpg").canonical == "Xe_HPG"
    assert parse_capability("pvc").canonical == "Xe_HPC"
    for bad in ("sm_8", "gfx", "hopper", ""):
        with pytest.raises(ValueError, match="not an architecture"):
            parse_capability(bad)


@pytest.mark.parametrize(("device", "kernels", "ptx", "status", "via"), [
    ("sm_80", ["sm_75", "sm_80"], [], "exact", "sm_80"),
    ("sm_86", ["sm_70", "sm_80"], [], "compatible", "sm_80"),  # same major, older minor
    ("sm_90", ["sm_80", "sm_86"], ["compute_86"], "ptx", "compute_86"),
    ("sm_120", ["sm_50", "sm_90"], [], "none", ""),
    ("sm_75", ["sm_80"], ["compute_80"], "none", ""),  # PTX never runs on an older arch
    ("gfx90a", ["gfx908", "gfx90a"], [], "exact", "gfx90a"),
    ("gfx942", ["gfx90a"], [], "none", ""),
    ("gfx1100", ["gfx11-generic"], [], "compatible", "gfx11-generic"),
    ("Xe_HPC", ["pvc"], [], "exact", "Xe_HPC"),
    ("Xe_HPG", ["pvc"], [], "none", ""),
    ("Xe_HPG", ["some-new-target"], [], "unknown", ""),
])
def test_kernel_support(device: str, kernels: list[str], ptx: list[str], status: str,
                        via: str) -> None:
    support = kernel_support(device, kernels, ptx)
    assert (support.status, support.via) == (status, via)


def test_sm_90a_kernel_matches_sm_90_exactly() -> None:
    assert kernel_support("sm_90", ["sm_90a"], []).status == "exact"

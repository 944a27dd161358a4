"""Device selection: config priorities, locality, best fit, least recently used; all or
nothing; one backend per grant."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from brokerd.contract import ClientFacts
from brokerd.leasing.selection import select_devices as select
from tests.mixed_host import A100, MAX1550, MI250X, MIXED, T4, gpu, requirement

NO_FACTS = ClientFacts()
PRIORITY_CONFIG = """\
device_selection_policy:
  - priority: 1
    criteria: [{type: gpu_compute_capability, min: sm_80}, {type: driver_version, min: 535.54.03}]
  - priority: 2
    criteria: [{type: gpu_vendor, equals: amd}]
"""


def uuids(devices):  # type: ignore[no-untyped-def]
    return None if devices is None else [d.uuid for d in devices]


def test_best_fit_prefers_the_smallest_device_that_fits() -> None:
    assert uuids(select(requirement(facts=NO_FACTS), MIXED, {})) == [T4.uuid]
    need_20g = requirement(min_memory_mib=20 * 1024, facts=NO_FACTS)
    assert uuids(select(need_20g, MIXED, {})) == [MI250X.uuid]
    need_100g = requirement(min_memory_mib=100 * 1024, facts=NO_FACTS)
    assert uuids(select(need_100g, MIXED, {})) == [MAX1550.uuid]


def test_config_priorities_come_before_best_fit() -> None:
    req = requirement(config=PRIORITY_CONFIG, facts=NO_FACTS)
    assert uuids(select(req, MIXED, {})) == [A100.uuid]
    without_a100 = [T4, MI250X, MAX1550]
    assert uuids(select(req, without_a100, {})) == [MI250X.uuid]
    # Devices meeting no priority remain usable, after every priority.
    assert uuids(select(req, [T4, MAX1550], {})) == [T4.uuid]


def test_least_recently_used_among_equals() -> None:
    twins = [T4, gpu(T4, 4), gpu(T4, 5)]
    recent = {T4.uuid: 300.0, twins[1].uuid: 100.0}  # twins[2] never used
    assert uuids(select(requirement(facts=NO_FACTS), twins, recent)) == [twins[2].uuid]
    recent[twins[2].uuid] = 200.0
    assert uuids(select(requirement(facts=NO_FACTS), twins, recent)) == [twins[1].uuid]


def test_ineligible_devices_are_never_selected() -> None:
    sm80 = requirement("required_features: [{gpu_compute_capability: sm_80}]")
    assert uuids(select(sm80, MIXED, {})) == [A100.uuid]
    assert select(sm80, [T4, MI250X], {}) is None


def test_all_or_nothing_and_one_backend() -> None:
    assert select(requirement(gpus=3, facts=NO_FACTS), [A100, T4, MI250X], {}) is None
    pair = select(requirement(gpus=2, facts=NO_FACTS), MIXED, {})
    assert pair is not None and len(pair) == 2
    assert len({d.backend for d in pair}) == 1
    assert select(requirement(gpus=0), MIXED, {}) == []


def test_multi_gpu_prefers_interconnect_then_numa() -> None:
    a = [gpu(A100, i, numa_node=i % 2, interconnect_group="") for i in range(4)]
    # 0 and 2 share NUMA node 0, 1 and 3 share node 1; no interconnect known.
    picked = uuids(select(requirement(gpus=2), a, {}))
    assert picked in ([a[0].uuid, a[2].uuid], [a[1].uuid, a[3].uuid])
    linked = [replace(a[1], interconnect_group="nvl-x"), replace(a[2], interconnect_group="nvl-x")]
    host = [a[0], *linked, a[3]]
    assert sorted(uuids(select(requirement(gpus=2), host, {}))) == sorted(d.uuid for d in linked)


def test_locality_beats_best_fit_but_not_priority() -> None:
    small_apart = [gpu(A100, 1, memory_mib=40960, numa_node=0, interconnect_group=""),
                   gpu(A100, 2, memory_mib=40960, numa_node=1, interconnect_group="")]
    big_together = [gpu(A100, 3, numa_node=2, interconnect_group=""),
                    gpu(A100, 4, numa_node=2, interconnect_group="")]
    chosen = uuids(select(requirement(gpus=2), [*small_apart, *big_together], {}))
    assert sorted(chosen) == sorted(d.uuid for d in big_together)
    prefer_small = """\
device_selection_policy:
  - priority: 1
    criteria: [{type: memory, max: 40GiB}]
"""
    chosen = uuids(select(requirement(config=prefer_small, gpus=2),
                          [*small_apart, *big_together], {}))
    assert sorted(chosen) == sorted(d.uuid for d in small_apart)


def test_host_error_selects_nothing() -> None:
    spec = "dependencies: [{name: torch, version_range: '3.0,4.0'}]"
    assert select(requirement(spec), MIXED, {}) is None


@settings(max_examples=60)
@given(
    memories=st.lists(st.sampled_from([16384, 40960, 81920]), min_size=1, max_size=6),
    numas=st.lists(st.integers(-1, 1), min_size=6, max_size=6),
    need=st.integers(1, 4),
    used=st.lists(st.floats(0, 1000), min_size=6, max_size=6),
)
def test_selection_is_exact_distinct_and_drawn_from_free(
        memories: list[int], numas: list[int], need: int, used: list[float]) -> None:
    free = [gpu(A100, i, memory_mib=m, numa_node=numas[i]) for i, m in enumerate(memories)]
    last_used = {d.uuid: used[i] for i, d in enumerate(free)}
    chosen = select(requirement(gpus=need), free, last_used)
    if need > len(free):
        assert chosen is None
        return
    assert chosen is not None and len(chosen) == need
    assert len({d.uuid for d in chosen}) == need
    assert all(d in free for d in chosen)


@given(
    picks=st.lists(st.sampled_from([A100, T4, MI250X, MAX1550]), min_size=1, max_size=8),
    used=st.lists(st.floats(0, 1000), min_size=8, max_size=8),
)
def test_one_device_is_the_best_fit_least_recently_used_of_any_backend(picks: list, used: list[float]) -> None:
    # The rule stated on its own: the smallest device that fits, then the least recently
    # used, then the lowest index, whichever vendor (no priorities configured).
    free = [gpu(device, i) for i, device in enumerate(picks)]
    last_used = {d.uuid: used[i] for i, d in enumerate(free)}
    best = min(free, key=lambda d: (d.memory_mib, last_used[d.uuid], d.index))
    assert uuids(select(requirement(facts=NO_FACTS), free, last_used)) == [best.uuid]

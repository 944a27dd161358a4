"""Which free devices a request gets.

Order of preference, each only breaking ties of the one before:
1. the accelerator config's `device_selection_policy` (priority 1 before priority 2;
   devices meeting no priority come last but remain usable);
2. for multi-device requests, one model: all the same card (name, memory, architecture)
   whenever enough of one model are free; a mix only when the host has no such set;
3. for multi-device requests, locality: all in one interconnect group (NVLink/xGMI),
   else all on one NUMA node, else anywhere;
4. the fit rule (`best_fit`: the smallest devices that satisfy the memory need, so large
   devices stay free for jobs that need them), the one place that says which of several
   fitting devices a request prefers: a setting, or the lab benchmark (bench/lab), may
   pass another as `prefer`;
5. least recently used, so wear and heat spread over equal devices; then index.

All devices of one grant share a backend (a process drives one), and a grant is all or
nothing: exactly `requirement.gpus` devices, or None, in index order (the runtime numbers
them as listed: device 0 of the job is the lowest index).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from brokerd.contract import Evaluation, Requirement, evaluate
from brokerd.devices.model import Device

# Locality levels of a multi-device set, best first.
_SAME_LINK, _SAME_NUMA, _ANYWHERE = 0, 1, 2


def best_fit(device: Device) -> float:
    """The fit rule: less memory is better, so big devices stay free for big jobs."""
    return device.memory_mib


def _model(device: Device) -> tuple[str, str, int, str]:
    return device.vendor, device.name, device.memory_mib, device.arch


def select_devices(
    requirement: Requirement,
    free: Sequence[Device],
    last_used: Mapping[str, float],
    evaluation: Evaluation | None = None,
    prefer: Callable[[Device], float] = best_fit,
) -> list[Device] | None:
    """Pick exactly `requirement.gpus` devices among `free`, in index order, or None.

    Devices failing the requirement's checks are dropped here too, so a caller passing
    every free device cannot hand out an ineligible one; a caller that already evaluated
    the requirement passes that `evaluation` to skip doing it again on every grant
    attempt. `last_used` maps uuid to the unix time the device was last released
    (absent: never used). `prefer` is the fit rule (lower first).
    """
    need = requirement.gpus
    if need <= 0:
        return []
    if evaluation is None:
        evaluation = evaluate(requirement, free)
    if evaluation.host_checks and any(ln.level == "ERROR" for ln in evaluation.host_checks):
        return None
    eligible = set(evaluation.eligible)
    candidates = [d for d in free if d.uuid in eligible]
    config = requirement.config

    def score(d: Device) -> tuple[int, float, float, int]:
        rank = config.rank(d) if config is not None else 0
        return (rank, prefer(d), last_used.get(d.uuid, 0.0), d.index)

    by_backend: dict[str, list[Device]] = defaultdict(list)
    for d in candidates:
        by_backend[d.backend].append(d)
    if need == 1:  # no set to weigh: each backend's best device (sorting 64 scores was most of a grant's choice)
        options = [(_ANYWHERE, (min(group, key=score),)) for group in by_backend.values()]
    else:
        options = []
        for group in by_backend.values():
            ranked = sorted(group, key=score)
            options += _options(ranked, need)
            by_model: dict[tuple[str, str, int, str], list[Device]] = defaultdict(list)
            for d in ranked:
                by_model[_model(d)].append(d)
            if len(by_model) > 1:  # each model with enough free devices: its own sets too
                options += [o for members in by_model.values() for o in _options(members, need)]
    if not options:
        return None
    best = min(options, key=lambda o: _set_key(o, score))
    return sorted(best[1], key=lambda d: d.index)


def _options(ranked: list[Device], need: int) -> list[tuple[int, tuple[Device, ...]]]:
    """Candidate sets with their locality: the best `need` devices of every interconnect
    group and NUMA node that has enough, and the best `need` overall."""
    if len(ranked) < need:
        return []
    options = [(_ANYWHERE, tuple(ranked[:need]))]
    if need == 1:
        return options
    for level, key in ((_SAME_LINK, lambda d: d.interconnect_group),
                       (_SAME_NUMA, lambda d: d.numa_node)):
        options.extend(_local_options(ranked, need, level, key))
    return options


def _local_options(ranked: list[Device], need: int, level: int,
                   key: Callable[[Device], object]) -> list[tuple[int, tuple[Device, ...]]]:
    groups: dict[object, list[Device]] = defaultdict(list)
    for d in ranked:
        value = key(d)
        if value not in ("", -1):  # unknown locality groups nothing
            groups[value].append(d)
    return [(level, tuple(members[:need])) for members in groups.values() if len(members) >= need]


def _set_key(option: tuple[int, tuple[Device, ...]],
             score: Callable[[Device], tuple[int, float, float, int]]) -> tuple[object, ...]:
    level, devices = option
    scores = [score(d) for d in devices]
    return (
        max(s[0] for s in scores),  # the worst priority in the set
        len({_model(d) for d in devices}) > 1,  # one model before a mix
        level,
        sum(s[1] for s in scores),  # the fit rule, summed: best fit is the least memory in total
        max(s[2] for s in scores),  # least recently used
        sorted(s[3] for s in scores),
    )

"""Memory shares of a shared device: the lease manager's rules for a request that asks for
memory (`Ask.memory_mib`, `vaccel run --memory 20GiB`) instead of whole devices.

A device the admin marks shared (`[sharing] devices`) is leased by memory: each share
lease holds part of its memory, beside other shares, and the shares on one device never
add up to more than its memory (Holdings.check_invariants). Such a device is given whole
only while it has no share, and a share never goes to a device held whole. A share is of
one device: the request asks for one GPU.

A request for whole devices gets unshared devices when they suffice (select_whole), so
shared ones stay for shares. Which shared device a share gets: the config's
device_selection_policy first, then best fit (the device its share fills most, so large
rooms stay for large shares), then least recently used, then index. Fair order, limits
and backfill treat a share as its weight, its part of the device's memory (Lease.weight,
brokerd/leasing/reservations.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from brokerd.contract import Evaluation, Requirement
from brokerd.devices.model import Device
from brokerd.leasing.holdings import Holdings
from brokerd.leasing.model import Request
from brokerd.leasing.reservations import NEVER, Reservations
from brokerd.leasing.selection import select_devices
from vaccel_common.units import format_duration, format_mib


def share_problem(request: Request, holdings: Holdings) -> str:
    """Why a share request can never be granted here, "" when it can."""
    need, least = request.ask.memory_mib, request.limits.min_share_mib
    if least and need < least:
        return (f"a share of {format_mib(need)} is under the smallest share granted here, {format_mib(least)} "
                f"(min_share for {request.limits.policy}): ask for at least that")
    if request.requirement.gpus != 1:
        return (f"a memory share is of one device: ask for {format_mib(need)} of one GPU (--memory alone), "
                f"or for whole devices (--gpus {request.requirement.gpus} without --memory)")
    shared = [holdings.devices[u] for u in sorted(holdings.shared) if u in holdings.devices]
    if not shared:
        return "no device on this host is shared by memory ([sharing] devices): ask for whole devices (--gpus)"
    eligible = set(request.evaluation.eligible)
    if not any(d.uuid in eligible and d.memory_mib >= need for d in shared):
        largest = max(shared, key=lambda d: d.memory_mib)
        if need > largest.memory_mib:
            return (f"a share of {format_mib(need)} is more than any shared device holds "
                    f"(the largest, {largest.label}, has {format_mib(largest.memory_mib)})")
        return "no shared device satisfies the request's contract"
    return ""


def request_weight(request: Request, devices: Mapping[str, Device]) -> float:
    """How many devices a request counts as before it is granted: its GPUs, or for a share
    its part of the largest eligible device (the least it could weigh; which device it may
    then have within the limit is pick_share_device's)."""
    if not request.ask.memory_mib:
        return float(request.requirement.gpus)
    sizes = [devices[u].memory_mib for u in request.evaluation.eligible if u in devices]
    return request.ask.memory_mib / max(sizes) if sizes else 1.0


def select_whole(requirement: Requirement, free: list[Device], holdings: Holdings,
                 evaluation: Evaluation) -> list[Device] | None:
    """The whole devices a request gets among `free` (brokerd/leasing/selection.py):
    unshared ones when they suffice, so that shared devices stay for shares."""
    if holdings.shared:
        unshared = [d for d in free if d.uuid not in holdings.shared]
        if len(unshared) >= requirement.gpus:
            chosen = select_devices(requirement, unshared, holdings.last_used, evaluation)
            if chosen:
                return chosen
    return select_devices(requirement, free, holdings.last_used, evaluation)


def pick_share_device(request: Request, holdings: Holdings, reserved: Reservations) -> Device | None:
    """The shared device a share request gets now, or None when none has room for it that
    the requests ahead leave it."""
    if any(ln.level == "ERROR" for ln in request.evaluation.host_checks):
        return None
    need, eligible = request.ask.memory_mib, set(request.evaluation.eligible)
    # A share weighs its part of the device it gets: on a small device it may not fit what
    # max_devices leaves its user, where on a large one it does.
    allowed = _allowed(request, reserved)
    candidates = [d for d in holdings.shareable() if d.uuid in eligible and holdings.room(d.uuid) >= need
                  and need / d.memory_mib <= allowed
                  and (reserved.keeps_nothing or reserved.permits(d.uuid, request))]
    if not candidates:
        return None
    config = request.requirement.config

    def score(d: Device) -> tuple[int, int, float, int, int]:
        rank = config.rank(d) if config is not None else 0
        return (rank, holdings.room(d.uuid) - need, holdings.last_used.get(d.uuid, 0.0), d.index, d.mig_index)

    return min(candidates, key=score)


def _allowed(request: Request, reserved: Reservations) -> float:
    """How much of a device max_devices still lets the request's user take."""
    limits = request.limits
    return limits.max_devices - reserved.weight_of(request.holder.uid) + 1e-9 if limits.max_devices else float("inf")


def share_wait_reason(request: Request, holdings: Holdings, reserved: Reservations, users_ahead: int) -> str:
    """Why a share request waits, in words a student can act on."""
    need, eligible = request.ask.memory_mib, set(request.evaluation.eligible)
    open_now = [d for d in holdings.shareable() if d.uuid in eligible]
    fits = [d for d in open_now if holdings.room(d.uuid) >= need]
    if fits and all(need / d.memory_mib > _allowed(request, reserved) for d in fits):
        limits, first = request.limits, fits[0]
        return (f"limit max_devices={limits.max_devices} for {limits.policy}: you hold "
                f"{reserved.weight_of(request.holder.uid):.3g}, and a {format_mib(need)} share of {first.label} "
                f"counts as {need / first.memory_mib:.2g} of a device")
    kept = [d for d in fits if not reserved.permits(d.uuid, request)]
    if kept:
        until = min(reserved.kept_until(d.uuid) or NEVER for d in kept)
        if until != NEVER:
            window = format_duration(max(0.0, until - reserved.now))
            return (f"backfill window: the memory is kept for a request ahead; with --time under {window} "
                    "this would start now")
    if users_ahead:
        return f"fair share, {users_ahead} user{'s' if users_ahead != 1 else ''} ahead"
    if not open_now:
        return "waiting for a shared device to come free"
    most = max(open_now, key=lambda d: holdings.room(d.uuid))
    return (f"waiting for {format_mib(need)} of shared memory to come free "
            f"(most free now: {most.label}, {format_mib(max(0, holdings.room(most.uuid)))})")

"""Who is using which GPU, and is it covered by a lease? Pure logic over probe output.

A device is busy (not grantable: allocation fails closed) when a process that belongs to
no lease covering that device uses it, or when its memory is in use with no process to
account for it (zombie memory after a crash). A process belongs to a lease when it or
one of its ancestors is a lease pid, so torchrun ranks and `vaccel run` children match.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace

from brokerd.base.procinfo import ProcInfo
from brokerd.devices.model import Device, GpuProcess

DEFAULT_ZOMBIE_THRESHOLD_MIB = 512


@dataclass(frozen=True)
class Occupancy:
    """The classification of one probe's processes.

    unleased: GPU processes not covered by a lease on that device, with uid/user/command
        filled in where /proc knows them. A lease member using a device outside its
        lease appears here for that device (and in `matched`).
    busy: device uuid -> why it must not be granted, in words for `vaccel status`.
    matched: pid -> lease id for every GPU process that belongs to a lease.
    """

    unleased: tuple[GpuProcess, ...] = ()
    busy: Mapping[str, str] = field(default_factory=dict)
    matched: Mapping[int, str] = field(default_factory=dict)


def _lease_of(
    pid: int,
    owners: Mapping[int, str],
    ancestry: Callable[[int], Sequence[int]],
) -> str | None:
    """The lease of the nearest process in pid's chain (itself first) that holds one."""
    if pid in owners:
        return owners[pid]
    for ancestor in ancestry(pid):
        if ancestor in owners:
            return owners[ancestor]
    return None


def _filled(proc: GpuProcess, info: ProcInfo | None) -> GpuProcess:
    """`proc` with owner and command from /proc; what the probe gave is kept when /proc
    has nothing (the process is gone, or lives in another pid namespace). Kept exact:
    whatever shows it to a person escapes it there (vaccel_common/text.py)."""
    if info is None:
        return proc
    return replace(proc, uid=info.uid, user=info.user, command=info.command)


def _describe(proc: GpuProcess, lease: str | None) -> str:
    who = proc.user or (str(proc.uid) if proc.uid >= 0 else "an unknown user")
    program = proc.command.split()[0] if proc.command else "?"
    text = f"pid {proc.pid} {program}, {proc.used_memory_mib} MiB"
    if lease:
        text += f" (a member of lease {lease}, which does not hold this device)"
    return f"{who}: {text}"


def classify(
    processes: Sequence[GpuProcess],
    lease_pids: Mapping[str, Set[int]],
    lease_devices: Mapping[str, Set[str]],
    devices: Sequence[Device],
    *,
    ancestry: Callable[[int], Sequence[int]],
    info: Callable[[int], ProcInfo | None],
    zombie_threshold_mib: int = DEFAULT_ZOMBIE_THRESHOLD_MIB,
    reserved: Mapping[str, Mapping[int, str]] | None = None,
) -> Occupancy:
    """Match GPU processes to leases and say which devices are busy without a lease.

    lease_pids: lease id -> pids registered to it (holder, joined members).
    lease_devices: lease id -> uuids of the devices it holds.
    ancestry: pid -> its ancestors, nearest first (procinfo.ancestors).
    info: pid -> ProcInfo or None (procinfo.process_info).
    reserved: device uuid -> {uid: lease id} of the reservations holding it (several: memory
        shares of one device): a reservation is held by its user, not a process, so any
        process of that user on it is covered.
    """
    owners: dict[int, str] = {}
    for lease_id, pids in sorted(lease_pids.items()):
        for pid in pids:
            owners.setdefault(pid, lease_id)
    matched: dict[int, str] = {}
    unleased: list[GpuProcess] = []
    offenders: dict[str, list[str]] = {}
    infos: dict[int, ProcInfo | None] = {}
    for proc in processes:
        lease = _lease_of(proc.pid, owners, ancestry)
        if lease is not None:
            matched[proc.pid] = lease
            if proc.device_uuid in lease_devices.get(lease, frozenset()):
                continue
        if proc.pid not in infos:
            infos[proc.pid] = info(proc.pid)
        filled = _filled(proc, infos[proc.pid])
        booked = (reserved or {}).get(proc.device_uuid, {}).get(filled.uid)
        if lease is None and booked is not None:
            matched[proc.pid] = booked
            continue
        unleased.append(filled)
        offenders.setdefault(proc.device_uuid, []).append(_describe(filled, lease))

    busy: dict[str, str] = {}
    for uuid, lines in offenders.items():
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        busy[uuid] = f"IN USE WITHOUT LEASE by {lines[0]}{more}"
    with_process = {p.device_uuid for p in processes}
    for device in devices:
        if device.uuid in busy or device.uuid in with_process:
            continue
        if device.memory_used_mib > zombie_threshold_mib:
            busy[device.uuid] = (
                f"zombie memory: {device.memory_used_mib} MiB used by no process"
            )
    return Occupancy(tuple(unleased), busy, matched)


def to_signal(
    occupancy: Occupancy,
    first_seen: Mapping[int, float],
    now: float,
    grace_s: float,
    *,
    protected: Set[int] = frozenset(),
) -> list[int]:
    """Pids of unleased GPU processes first seen at least `grace_s` ago, for the optional
    "signal after grace" policy. Never pid 0/1, root's processes (system services that
    use a GPU are the admin's call, not the broker's), a process /proc could not name
    (uid unknown: another pid namespace or a simulated pid, where the number may mean a
    different process here), a pid in `protected` (the daemon itself), or a pid whose
    first sighting is unknown."""
    pids: set[int] = set()
    for proc in occupancy.unleased:
        seen = first_seen.get(proc.pid)
        if seen is None or proc.pid <= 1 or proc.uid <= 0 or proc.pid in protected:
            continue
        if now - seen >= grace_s:
            pids.add(proc.pid)
    return sorted(pids)

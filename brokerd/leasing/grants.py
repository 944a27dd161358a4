"""What a grant makes: the lease a request gets on the devices chosen for it (whole, or a
memory share of one shared device: brokerd/leasing/shares.py). The manager decides who
gets what and records it (brokerd/leasing/manager.py); this only builds the lease."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from brokerd.devices.model import Device
from brokerd.leasing import endings
from brokerd.leasing.model import Lease, Request


def lease_for(request: Request, devices: Sequence[Device], lease_id: str, now: float, max_duration_s: float) -> Lease:
    uuids = tuple(d.uuid for d in devices)
    share = request.ask.memory_mib
    terms = request.terms
    if share:  # the client caps its allocator to the share (or the config's cap, if smaller)
        terms = replace(terms, memory_cap_mib=min(terms.memory_cap_mib or share, share))
    return Lease(
        id=lease_id,
        holder=request.holder,
        devices=uuids,
        backend=devices[0].backend,
        granted_at=now,
        expires_at=endings.end_of(now, request.ask.time_limit_s, max_duration_s),
        terms=terms,
        warnings=request.evaluation.warnings_for(uuids),
        simulated=any(d.simulated for d in devices),
        last_heartbeat=now,
        requested_at=request.since,
        reservation=request.ask.reservation,
        time_limit_s=request.ask.time_limit_s,
        share_mib=share,
        share_of_mib=devices[0].memory_mib if share else 0,
    )

"""Limits that do not idle devices: `[policy] lend_idle` (docs/policy.md, "Lending idle
devices"). Plain Python, the manager's clock, run by the manager after each pump.

A request that a limit holds back (max_devices, max_device_hours) may start on devices no
request within limits can use now: after the pump has granted what it could, the requests
within limits that still wait keep what they will start on (the queue's own rule,
brokerd/leasing/reservations.py), and what is left, free and not kept, is lent to the
limited requests, in the queue's order. Such a lease is `borrowed`: it counts against its
user's limits like any lease (they stay over them, and their other requests stay limited).

The rule that makes it safe: a borrowed lease never keeps a device from a request within
limits for longer than its notice (`lend_notice`). After every pump the queue is planned
as if the borrowed leases without notice had ended: every request within limits that
would then start on a borrowed device has that lease told to end (the ending-notice
machinery of a revoke with grace: REVOKED at now + lend_notice). Planned again until no
such request is left, this is the pump the daemon would run if those leases had ended,
so after it none of them stands in the way of a request within limits
(tests/test_lease_properties.py checks that against such a pump).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from brokerd.devices.model import Device
from brokerd.leasing.grants import lease_for
from brokerd.leasing.holdings import Holdings
from brokerd.leasing.model import REVOKED, Grant, Lease, Request
from brokerd.leasing.queue import LeaseQueue
from brokerd.leasing.reservations import Reservations
from brokerd.leasing.shares import select_whole

TryGrant = Callable[[Request, Reservations, list[Device]], "Lease | None"]
EndEarly = Callable[[str, float, str, str], Lease]


def whole_devices_for(request: Request, reserved: Reservations, free: list[Device],
                      holdings: Holdings) -> list[Device] | None:
    """The whole devices `request` would start on among `free`, by what those ahead leave
    it (backfill included); None when it cannot start."""
    eligible = set(request.evaluation.eligible)
    free = [d for d in free if d.uuid in eligible]
    if not reserved.keeps_nothing:
        free = [d for d in free if reserved.permits(d.uuid, request)]
    if len(free) < request.requirement.gpus:
        return None
    return select_whole(request.requirement, free, holdings, request.evaluation) or None


class Lending:
    def __init__(self, holdings: Holdings, waiting: LeaseQueue, clock: Callable[[], float],
                 max_duration_s: Callable[[], float]) -> None:
        self.holdings = holdings
        self.waiting = waiting
        self._clock = clock
        self._max_duration_s = max_duration_s
        self.enabled = False  # [policy] lend_idle
        self.notice_s = 300.0  # [policy] lend_notice
        # The borrowed leases the last pass told to end: the daemon records and announces
        # each (brokerd/core/ledger.py), as an admin's revoke with grace.
        self.recalled: list[Lease] = []

    def after_pump(self, try_grant: TryGrant, end_early: EndEarly) -> list[Grant]:
        """Tell the borrowed leases a request within limits needs to end, then lend what
        is left idle; the grants (borrowed leases) the lending made."""
        self.recalled = []
        if not self.waiting.requests:
            return []
        if any(lease.borrowed for lease in self.holdings.leases.values()):
            self._recall(end_early)
        return self._lend(try_grant) if self.enabled else []

    def _lent_out(self) -> dict[str, Lease]:
        """The borrowed leases nobody has told to end yet."""
        return {lease.id: lease for lease in self.holdings.leases.values() if lease.borrowed and not lease.notice}

    def _recall(self, end_early: EndEarly) -> None:
        while lent_out := self._lent_out():
            needed = self._needed(lent_out)
            if not needed:
                return
            now = self._clock()
            at = now + self.notice_s
            for lease_id, uuids in needed.items():
                labels = ", ".join(self.holdings.devices[u].label for u in sorted(uuids) if u in self.holdings.devices)
                notice = (f"lent while idle: a request within its limits needs {labels} "
                          f"(ends at {time.strftime('%H:%M:%S', time.localtime(at))})")
                self.recalled.append(end_early(lease_id, at, REVOKED, notice))

    def _needed(self, lent_out: dict[str, Lease]) -> dict[str, set[str]]:
        """The pump's pass over the queue as if the leases `lent_out` had ended: which of
        them (with the devices wanted of each) a request within limits would start on."""
        holdings = self.holdings
        owner = holdings.owner
        real = self.waiting.reservations()  # who is within limits: judged with every lease held
        reserved = self.waiting.reservations(frozenset(lent_out))
        free = holdings.free() + [d for lease in lent_out.values() for u in lease.devices
                                  if (d := holdings.devices.get(u)) is not None and d.healthy
                                  and u not in holdings.drained and u not in holdings.unavailable]
        needed: dict[str, set[str]] = {}
        for request in self.waiting.ordered():
            if self.waiting.limit(request, real):
                continue  # lent to the limited: what they want is no claim on what is lent
            if request.ask.memory_mib:  # a device lent whole and shared since: the share may want it
                for lease in lent_out.values():
                    if any(u in holdings.shared and u in request.evaluation.eligible
                           and holdings.devices[u].memory_mib >= request.ask.memory_mib
                           for u in lease.devices if u in holdings.devices):
                        needed.setdefault(lease.id, set()).update(u for u in lease.devices if u in holdings.shared)
                continue
            chosen = whole_devices_for(request, reserved, free, holdings)
            if chosen is None:
                reserved.add(request)
                continue
            for device in chosen:
                if owner.get(device.uuid) in lent_out:
                    needed.setdefault(owner[device.uuid], set()).add(device.uuid)
            # As the pump's grant would: later requests see it held, until its end.
            reserved.granted(lease_for(request, chosen, "planned", self._clock(), self._max_duration_s()))
            taken = {d.uuid for d in chosen}
            free = [d for d in free if d.uuid not in taken]
        return needed

    def _lend(self, try_grant: TryGrant) -> list[Grant]:
        # Shared devices stay for the shares: lending is of whole devices, and never of those.
        free = [d for d in self.holdings.free() if d.uuid not in self.holdings.shared]
        if not free:
            return []
        reserved = self.waiting.reservations()
        limited: list[Request] = []
        for request in self.waiting.requests:  # in fair order: the pump left it so
            if request.ask.memory_mib:
                reserved.add(request)
            elif self.waiting.limit(request, reserved):
                limited.append(request)
            else:
                reserved.add(request)  # within limits, waiting: it keeps what it will start on
        grants: list[Grant] = []
        for request in limited:
            if not free:
                break
            if self.waiting.limit(request, reserved) and (lease := try_grant(request, reserved, free)) is not None:
                lease.borrowed = True
                grants.append(Grant(request, lease))
                reserved.granted(lease)
                free = [d for d in free if d.uuid not in lease.devices]
        if grants:
            self.waiting.remove_all([g.request for g in grants])
        return grants

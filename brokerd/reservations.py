"""Which free devices the waiting requests keep for themselves: the lease manager's FIFO
rule, with the one exception that stops a user from hogging the head of the queue."""

from __future__ import annotations

from collections.abc import Iterable

from brokerd.lease_model import Lease, Request


class Reservations:
    """The free devices that waiting requests keep for themselves (FIFO: a request may
    take only free devices that no request ahead of it could use), built in queue order.

    A request that its own user's leases block (it could only be granted once that user
    releases one of them) reserves nothing: else a user holding 1 of 2 devices and asking
    for 2 would keep the free one from everyone, for as long as they like.

    A grant later in the same pass never turns an earlier request into a blocked one: it
    can only take devices that no earlier reserving request could use, and blocking counts
    only a request's own eligible devices. So what is reserved only ever grows."""

    def __init__(self, leases: Iterable[Lease]) -> None:
        self._own: dict[int, set[str]] = {}
        for lease in leases:
            self._own.setdefault(lease.holder.uid, set()).update(lease.devices)
        self._reserved: set[str] = set()

    def blocked(self, request: Request) -> bool:
        own = self._own.get(request.holder.uid, set())
        usable = sum(1 for u in request.evaluation.eligible if u not in own)
        return usable < request.requirement.gpus

    def add(self, request: Request) -> None:
        """`request` waits: it keeps what it could use, unless its own leases block it."""
        if not self.blocked(request):
            self._reserved.update(request.evaluation.eligible)

    def granted(self, lease: Lease) -> None:
        """Later requests of the same user see this lease among their own."""
        self._own.setdefault(lease.holder.uid, set()).update(lease.devices)

    def __contains__(self, uuid: object) -> bool:
        return uuid in self._reserved

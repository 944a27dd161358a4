"""Asking for devices: the manager's decision under the asker's policy, and the two ways
a client hears it: the unary fast path (`acquire_now`, TryAcquire) for a request granted
at once, and the stream (`acquire`) that carries a waiter's queue updates, takes a waiter
cut off by a restart back to its place, or hands the request to an outside allocator
(Slurm, brokerd/core/plugins.py). Who may ask is the service's to check before (brokerd/
core/service.py); waiting itself is brokerd/core/queueing.py.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

from brokerd.base.journal import log_event
from brokerd.base.process import Holder, Identity
from brokerd.config.loader import Config
from brokerd.contract import Requirement
from brokerd.core.governing import Governance
from brokerd.core.ledger import LEFT, Ledger
from brokerd.core.plugins import Allocator
from brokerd.core.queueing import DurableQueue, lease_terms
from brokerd.core.tasks import Tasks
from brokerd.core.views import find_device
from brokerd.core.waiting import QueuedUpdate
from brokerd.leasing.errors import Busy, LeaseError
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import RELEASED, Ask, Lease, Request
from brokerd.state.queue_record import WaitRecords
from brokerd.state.store import LeaseStore

# Each waiting request holds a pidfd and a stream: bound what one user can pile up, even
# where the policy sets no limit (max_waiting = 0).
MAX_QUEUED_PER_USER = 1024


class Acquisition:
    def __init__(self, manager: LeaseManager, store: LeaseStore, *, config: Callable[[], Config], ledger: Ledger,
                 queue: DurableQueue, governance: Governance, records: WaitRecords, tasks: Tasks,
                 allocator: Callable[[], Allocator | None]) -> None:
        self.manager = manager
        self.store = store
        self._config = config
        self.ledger = ledger
        self.queue = queue
        self.governance = governance
        self.records = records
        self.tasks = tasks
        self._allocator = allocator  # plugged in after the service is built, or never

    async def acquire(
        self,
        identity: Identity,
        holder: Holder,
        requirement: Requirement,
        *,
        wait: bool,
        max_wait_s: float | None,
        key: str = "",
        spec: bytes = b"",
        **asked: Any,
    ) -> AsyncIterator[QueuedUpdate | Lease]:
        """Yield QueuedUpdate while waiting, then the granted Lease (already durable).
        Leaving the iteration early (the client cancelled) removes the request. `key` is
        the client's name for the request: the same process asking again under it (its
        stream broke, the broker restarted) takes up its old place. `spec` is what the
        store keeps to rebuild the request after a restart. `asked` is `_submit`'s."""
        allocator = self._allocator()
        if allocator is not None:  # an outside allocator decides (brokerd/addons/slurm/delegate.py)
            steps = allocator.acquire(holder, requirement, wait=wait, max_wait_s=max_wait_s, **asked)
        else:
            steps = self._acquire_here(identity, holder, requirement, wait=wait, max_wait_s=max_wait_s, key=key,
                                       spec=spec, **asked)
        try:
            async for item in steps:
                yield item
        finally:
            await steps.aclose()

    async def _acquire_here(self, identity: Identity, holder: Holder, requirement: Requirement, *, wait: bool,
                            max_wait_s: float | None, key: str, spec: bytes,
                            **asked: Any) -> AsyncIterator[QueuedUpdate | Lease]:
        record = self.records.find(key, identity)
        resumed = self.queue.resume(record) if record is not None else None
        if resumed is not None:
            try:
                async for item in resumed:
                    yield item
            finally:
                await resumed.aclose()
            return
        outcome: Lease | Request | None = await self._granted_before(key, holder)
        if outcome is None:
            outcome = self._submit(holder, requirement, wait=wait, **asked)
            if isinstance(outcome, Lease):
                outcome.request_key = key
                await self.ledger.persist_grant(outcome)
        if isinstance(outcome, Lease):
            try:
                yield outcome
            except GeneratorExit:
                if not self.tasks.stopping:
                    self.ledger.end(outcome.id, RELEASED, LEFT)
                raise
            return
        waiting = self.queue.enter(outcome, holder, key, max_wait_s, spec)
        try:
            async for item in waiting:
                yield item
        finally:
            await waiting.aclose()

    async def acquire_now(self, identity: Identity, holder: Holder, requirement: Requirement, *,
                          key: str = "", may_wait: bool = False, **asked: Any) -> Lease:
        """The unary fast path: the granted Lease (already durable), or Busy when the
        request would have to wait (nothing is queued; a client that `may_wait` then waits
        with `acquire`, so its Busy is no refusal for the journal). A request that already
        has a place under `key` is Busy too: its waiter belongs on the stream that resumes it."""
        if key and self.records.find(key, identity) is not None:
            raise Busy("this request already waits in the queue")
        allocator = self._allocator()
        if allocator is not None:  # an outside allocator decides
            return await allocator.acquire_now(holder, requirement, **asked)
        again = await self._granted_before(key, holder)
        if again is not None:
            return again
        outcome = self._submit(holder, requirement, wait=False, log_busy=not may_wait, **asked)
        assert isinstance(outcome, Lease), "a request that may not wait is granted or refused"
        outcome.request_key = key
        await self.ledger.persist_grant(outcome)
        return outcome

    async def _granted_before(self, key: str, holder: Holder) -> Lease | None:
        """The active lease this very process was granted under `key`, once it is durable.
        A client whose reply was lost (the broker died between the grant's commit and its
        answer, or the connection dropped) asks again under the same key: it gets the lease
        it holds, not a second one that would sit on another device until it exits. Proven
        as a queue record is (WaitRecords.find): the same process, and still the same user."""
        if not key:
            return None
        lease = next((lease for lease in self.manager.leases.values() if lease.request_key == key
                      and lease.holder.process == holder.process and lease.holder.uid == holder.uid), None)
        if lease is None:
            return None
        await self.store.committed()  # the first answer may still wait for the grant's commit
        if self.manager.leases.get(lease.id) is not lease:  # its commit failed, or it ended meanwhile
            return None
        log_event("reattach", f"{holder.user} (pid {holder.pid}) asked again for lease {lease.id}",
                  lease_id=lease.id, user=holder.user, pid=holder.pid)
        return lease

    def _submit(self, holder: Holder, requirement: Requirement, *, wait: bool,
                accelerator_config_yaml: str = "", cache_key: Hashable | None = None,
                time_limit_s: float = 0.0, devices: tuple[str, ...] = (),
                reservation: bool = False, log_busy: bool = True) -> Lease | Request:
        """The manager's decision on a new request: a grant (not yet durable), a queued
        Request (wait=True), or a refusal (raised, and logged)."""
        terms = lease_terms(self._config(), accelerator_config_yaml)
        try:
            limits = self.governance.limits_for(holder)
            ask = Ask(self.governance.time_limit(limits, time_limit_s),
                      tuple(find_device(self.manager, name).uuid for name in devices), reservation)
            if wait:  # (an ask that may not wait never joins the queue: no need to count it)
                waiting = sum(1 for r in self.manager.queue if r.holder.uid == holder.uid)
                cap = min(limits.max_waiting or MAX_QUEUED_PER_USER, MAX_QUEUED_PER_USER)
                if waiting >= cap:
                    raise Busy(f"limit max_waiting={cap} for {limits.name}: {holder.user} already has {waiting} "
                               "requests waiting; let some finish or cancel them")
            return self.manager.submit(holder, requirement, wait=wait, terms=terms, cache_key=cache_key,
                                       ask=ask, limits=limits.user_limits())
        except LeaseError as exc:
            if log_busy or not isinstance(exc, Busy):
                log_event("refuse", f"refused {requirement.gpus} device(s) to {holder.user}: {exc}",
                          user=holder.user, pid=holder.pid, level=logging.INFO)
            self.ledger.forget_if_idle(holder.process)
            raise

"""Asking for devices, as part of BrokerService: who asks (kernel identity, permission,
the pidfd watch from now on), the manager's decision under the asker's policy, and the
two ways a client hears it: the unary fast path (`acquire_now`, TryAcquire) for a request
granted at once, and the stream (`acquire`) that carries a waiter's queue updates, takes
a waiter cut off by a restart back to its place, or hands the request to Slurm
([slurm] mode = "delegate", brokerd/addons/slurm/). Waiting itself is brokerd/core/queueing.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Hashable
from typing import TYPE_CHECKING, Any

from brokerd.base.journal import log_event
from brokerd.base.process import Holder, Identity
from brokerd.contract import Requirement
from brokerd.core.queueing import LEFT
from brokerd.core.views import find_device
from brokerd.core.waiting import QueuedUpdate
from brokerd.leasing.errors import Busy, LeaseError
from brokerd.leasing.model import RELEASED, Ask, Lease, LeaseTerms, Request
from brokerd.state.queue_record import WaitRecord

if TYPE_CHECKING:
    from brokerd.core.service import BrokerService

# Each waiting request holds a pidfd and a stream: bound what one user can pile up, even
# where the policy sets no limit (max_waiting = 0).
MAX_QUEUED_PER_USER = 1024


class Acquiring:
    """BrokerService's acquire half (a mixin: `self` is the service)."""


    async def acquire(
        self: BrokerService,
        identity: Identity,
        requirement: Requirement,
        *,
        wait: bool,
        max_wait_s: float | None,
        command: str = "",
        key: str = "",
        spec: bytes = b"",
        **asked: Any,
    ) -> AsyncIterator[QueuedUpdate | Lease]:
        """Yield QueuedUpdate while waiting, then the granted Lease (already durable).
        Leaving the iteration early (the client cancelled) removes the request. `key` is
        the client's name for the request: the same process asking again under it (its
        stream broke, the broker restarted) takes up its old place. `spec` is what the
        store keeps to rebuild the request after a restart. `asked` is `_submit`'s."""
        holder = self._admit(identity, command)
        if self.slurm is not None:  # Slurm allocates: the delegate asks it (brokerd/addons/slurm/delegate.py)
            delegated = self.slurm.acquire(holder, requirement, wait=wait, max_wait_s=max_wait_s, **asked)
            try:
                async for item in delegated:
                    yield item
            finally:
                await delegated.aclose()
            return
        record = self.records.find(key, identity)
        resumed = self._resume(record) if record is not None else None
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
                await self._persist_grant(outcome)
        if isinstance(outcome, Lease):
            try:
                yield outcome
            except GeneratorExit:
                if not self.stopping:
                    self._end(outcome.id, RELEASED, LEFT)
                raise
            return
        box = self.waiting.open(outcome.id)
        deadline = 0.0 if max_wait_s is None else time.time() + max_wait_s
        record = WaitRecord(outcome.id, key, holder, time.time(), deadline, spec)
        self.records.add(record)
        # On disk before the waiter hears its place (the commit is awaited in the wait).
        saved = self.store.save_queued(record)
        log_event("queue", f"{holder.user} (pid {holder.pid}) waits for {requirement.gpus} device(s)",
                  user=holder.user, pid=holder.pid, request_id=outcome.id)
        waiting = self._wait_in_queue(record, box, saved)
        try:
            async for item in waiting:
                yield item
        finally:
            await waiting.aclose()

    async def acquire_now(self: BrokerService, identity: Identity, requirement: Requirement, *, command: str = "",
                          key: str = "", may_wait: bool = False, **asked: Any) -> Lease:
        """The unary fast path: the granted Lease (already durable), or Busy when the
        request would have to wait (nothing is queued; a client that `may_wait` then waits
        with `acquire`, so its Busy is no refusal for the journal). A request that already
        has a place under `key` is Busy too: its waiter belongs on the stream that resumes it."""
        holder = self._admit(identity, command)
        if key and self.records.find(key, identity) is not None:
            raise Busy("this request already waits in the queue")
        if self.slurm is not None:  # Slurm allocates (brokerd/addons/slurm/delegate.py)
            return await self.slurm.acquire_now(holder, requirement, **asked)
        again = await self._granted_before(key, holder)
        if again is not None:
            return again
        outcome = self._submit(holder, requirement, wait=False, log_busy=not may_wait, **asked)
        assert isinstance(outcome, Lease), "a request that may not wait is granted or refused"
        outcome.request_key = key
        await self._persist_grant(outcome)
        return outcome

    async def _granted_before(self: BrokerService, key: str, holder: Holder) -> Lease | None:
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

    def _submit(self: BrokerService, holder: Holder, requirement: Requirement, *, wait: bool,
                accelerator_config_yaml: str = "", cache_key: Hashable | None = None,
                time_limit_s: float = 0.0, devices: tuple[str, ...] = (),
                reservation: bool = False, log_busy: bool = True) -> Lease | Request:
        """The manager's decision on a new request: a grant (not yet durable), a queued
        Request (wait=True), or a refusal (raised, and logged)."""
        terms = LeaseTerms(
            allocator_config=self.config.allocator_config,
            memory_cap_mib=self.config.memory_cap_mib,
            accelerator_config_yaml=accelerator_config_yaml,
        )
        try:
            limits = self.config.policy.for_user(holder.user, holder.gid)
            ask = Ask(self._time_limit(limits, time_limit_s),
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
            self._forget_if_idle(holder.process)
            raise

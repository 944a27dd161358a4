"""The durable queue, as part of BrokerService: a waiting request is on disk before its
client hears its place; grants are committed before their waiters hear of them; after a
restart the queue comes back in order and a waiter cut off by it takes up its own place
again (proven by its kernel identity, brokerd/state/queue_record.py).

Grants that a pump makes are queued for commit together, in order, the moment the
manager makes them, like ends are: an end that happens while an earlier grant commits is
then committed after the grant it ends, so no device holding outlives its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from brokerd.base.journal import log_event
from brokerd.contract import Requirement, evaluate
from brokerd.core.views import find_device
from brokerd.core.waiting import Mailbox, QueuedUpdate
from brokerd.leasing.errors import DeadlineExceeded, Internal
from brokerd.leasing.model import RELEASED, Ask, Grant, Lease, LeaseTerms, Request
from brokerd.state.queue_record import WaitRecord, WaitRecords

if TYPE_CHECKING:
    from brokerd.core.service import BrokerService

log = logging.getLogger("vaccel.brokerd")

# How long a request restored at start-up waits for its client to come back to it. A
# client reconnects within seconds of the broker's return (client/vaccel/session.py).
REATTACH_GRACE_S = 60.0
class Rebuilt(NamedTuple):
    """A recorded request, rebuilt (brokerd/edge/servicer.py rebuild_request)."""

    requirement: Requirement
    accelerator_config_yaml: str
    time_limit_s: float = 0.0
    devices: tuple[str, ...] = ()  # as the client named them
    reservation: bool = False


Rebuild = Callable[[bytes], Rebuilt]
LEFT = "the client left before the grant reached it"


class DurableQueue:
    """The queue side of BrokerService (a mixin: it uses the service's manager, store,
    waiting room and helpers)."""

    records: WaitRecords
    stopping: bool

    def restore_queue(self: BrokerService, records: list[WaitRecord], rebuild: Rebuild) -> None:
        """Put back the recorded queue, in order, after restore(): requests whose process
        died meanwhile are dropped, grants made for an absent waiter are kept for it."""
        assert self._watcher is not None, "restore() first"
        for record in records:
            holder = record.holder
            why = ""
            if not self._watcher.watch(holder.process):
                why = f"pid {holder.pid} exited while the broker was down"
            elif record.lease_id:
                if record.lease_id in self.manager.leases:
                    self.records.add(record)
                    continue
                why = "its grant has ended"
            else:
                try:
                    rebuilt = rebuild(record.spec)
                    requirement = rebuilt.requirement
                    limits = self.config.policy.for_user(holder.user, holder.gid)
                    ask = Ask(self._time_limit(limits, rebuilt.time_limit_s),
                              tuple(find_device(self.manager, name).uuid for name in rebuilt.devices),
                              rebuilt.reservation)
                except Exception as exc:  # parsed once already; a newer parser or policy may refuse it
                    why = f"it can no longer be read or granted ({exc})"
                else:
                    evaluation = evaluate(requirement, list(self.manager.devices.values()))
                    if not evaluation.satisfiable:
                        why = evaluation.reason or "no device here satisfies it any more"
                    elif ask.only:
                        evaluation = replace(evaluation, eligible=tuple(
                            u for u in evaluation.eligible if u in ask.only))
            if why:
                log_event("dequeue", f"queued request {record.request_id} of {holder.user} dropped: {why}",
                          user=holder.user, pid=holder.pid, request_id=record.request_id)
                self._unrecord(record.request_id)
                self._forget_if_idle(holder.process)
                continue
            terms = LeaseTerms(allocator_config=self.config.allocator_config,
                               memory_cap_mib=self.config.memory_cap_mib,
                               accelerator_config_yaml=rebuilt.accelerator_config_yaml)
            self.manager.queue.append(Request(record.request_id, holder, requirement, evaluation, terms,
                                              record.since, ask, limits.user_limits()))
            self.records.add(record)
            self._spawn(self._drop_if_unclaimed(record))
        if self.manager.queue:
            log_event("restore", f"{len(self.manager.queue)} queued request(s) restored")
            self._spawn(self._pump())

    def _resume(self: BrokerService, record: WaitRecord) -> AsyncIterator[QueuedUpdate | Lease] | None:
        """The stream of a waiter that came back to its own request, or None when there is
        nothing left to come back to (its grant ended meanwhile)."""
        holder = record.holder
        log_event("reattach", f"{holder.user} (pid {holder.pid}) is back for request {record.request_id}",
                  user=holder.user, pid=holder.pid, request_id=record.request_id)
        if record.lease_id:
            lease = self.manager.leases.get(record.lease_id)
            return None if lease is None else self._deliver_kept(record, lease)
        return self._wait_in_queue(record, self.waiting.open(record.request_id))

    async def _deliver_kept(self: BrokerService, record: WaitRecord, lease: Lease) -> AsyncIterator[Lease]:
        self.manager.heartbeat(lease.id)  # its TTL counts from the moment its holder has it
        yield lease
        self._delivered(record)

    def _unrecord(self: BrokerService, request_id: str) -> None:
        """Take the request off the queue on disk; nobody waits for that commit."""
        self._spawn(self._logged(self.store.save_dequeued(request_id), "a change of the queue"))

    def _delivered(self: BrokerService, record: WaitRecord) -> None:
        self.records.drop(record.request_id)
        self._unrecord(record.request_id)

    async def _wait_in_queue(
        self: BrokerService, record: WaitRecord, box: Mailbox, saved: asyncio.Future[None] | None = None
    ) -> AsyncIterator[QueuedUpdate | Lease]:
        """Yield the waiter's queue updates, then its grant; `saved` is the commit of the
        request itself, awaited before the waiter hears anything."""
        delivered = False
        lease: Lease | None = None
        try:
            if saved is not None:
                try:
                    await asyncio.shield(saved)
                except Exception as exc:  # CancelledError (the client left) is no Exception: it passes
                    raise Internal(f"the broker could not record the request durably: {exc}") from exc
            self.waiting.tell(self.manager, record.request_id)  # its own place at once
            self.waiting.announce(self.manager)  # everyone else's total changed
            self.on_change()
            while True:
                timeout = None if not record.deadline else max(0.0, record.deadline - time.time())
                try:
                    update = await box.receive(timeout)
                except TimeoutError:
                    raise DeadlineExceeded(f"gave up after waiting {record.deadline - record.since:.0f}s; "
                                           f"{self.manager.holders_summary()}") from None
                if isinstance(update, Lease):
                    lease = update
                    yield lease
                    delivered = True
                    self._delivered(record)
                    return
                yield update
        finally:
            # A stream that a newer one of the same waiter replaced leaves the request to it.
            if self.waiting.close(record.request_id, box=box) and not delivered and not self.stopping:
                self._waiter_left(record, box, lease)

    def _waiter_left(self: BrokerService, record: WaitRecord, box: Mailbox, lease: Lease | None) -> None:
        holder = record.holder
        self.records.drop(record.request_id)
        if self.manager.cancel(record.request_id):
            self._waiter_gone(record, f"{holder.user} (pid {holder.pid}) left")
            return
        # Granted while the client was leaving (cancelled, gave up): the grant may be in
        # hand or still in the mailbox; one still being committed is found by the pump.
        for grant in ([lease] if lease is not None else []) + box.unread_grants():
            if grant.active:
                self._end(grant.id, RELEASED, LEFT)

    async def _drop_if_unclaimed(self: BrokerService, record: WaitRecord) -> None:
        """A restored request whose client does not come back in time leaves the queue."""
        wait = REATTACH_GRACE_S
        if record.deadline:
            wait = min(wait, record.deadline - time.time())
        await asyncio.sleep(max(0.0, wait))
        current = self.records.get(record.request_id)
        if current is None or current.lease_id or self.waiting.attached(record.request_id):
            return
        if self.manager.cancel(record.request_id):
            self.records.drop(record.request_id)
            self._waiter_gone(record, "its client did not come back after the restart")

    def _waiter_gone(self: BrokerService, record: WaitRecord, why: str) -> None:
        holder = record.holder
        log_event("dequeue", f"request {record.request_id} of {holder.user} left the queue: {why}",
                  user=holder.user, pid=holder.pid, request_id=record.request_id)
        self._unrecord(record.request_id)
        self._forget_if_idle(holder.process)
        self.waiting.announce(self.manager)
        self._spawn(self._pump())
        self.on_change()

    async def _pump(self: BrokerService) -> None:
        """Grant what the queue can now have; each grant is durable before its waiter hears."""
        self._grant_now()

    def _grant_now(self: BrokerService) -> None:
        """The pump's grants, made in memory and queued for commit (no await: a caller that
        holds the store's writes, LeaseStore.hold, gets them into its own transaction). Each
        waiter hears from the commit itself (_granted_durably)."""
        for grant in self.manager.pump():
            self.store.save_grant_then(grant.lease, grant.request.id,
                                       lambda error, grant=grant: self._granted_durably(grant, error))

    def _granted_durably(self: BrokerService, grant: Grant, error: BaseException | None) -> None:
        """A pump's grant has committed (`error` None) or failed to: tell its waiter now, in
        the commit's own turn of the loop. That is ahead of the releaser's reply and of
        whatever else the commit wakes, and two turns sooner than a task awaiting the
        commit would: a hand-over is the latency a queued student sees (issue 16)."""
        request_id = grant.request.id
        self.waiting.announce(self.manager)  # the queue moved up (or the head heard it failed)
        try:
            if error is not None:
                self._grant_not_recorded(grant.lease, error)
            self._grant_recorded(grant.lease)
        except Internal as exc:
            if not self.waiting.post(request_id, exc):  # the waiter hears of it rather than waiting forever
                self.records.drop(request_id)
                self._unrecord(request_id)
            return
        # Posted after the commit: a waiter that left meanwhile gets its devices handed
        # back; one away because of a restart finds its grant when it comes back.
        if self.waiting.post(request_id, grant.lease):
            return
        if self.records.get(request_id) is not None and grant.lease.active:
            self.records.granted(request_id, grant.lease.id)
        else:
            self._end(grant.lease.id, RELEASED, LEFT)

    async def _persist_grant(self: BrokerService, lease: Lease) -> None:
        """Commit a grant made outside the pump (granted at once) before its client hears."""
        saved = self.store.save_grant(lease)
        try:
            await asyncio.shield(saved)
        except asyncio.CancelledError:
            # The client left while its grant was being recorded: once it is on disk, end it.
            self._spawn(self._hand_back_when_saved(saved, lease))
            raise
        except Exception as exc:
            self._grant_not_recorded(lease, exc)
        self._grant_recorded(lease)

    def _grant_not_recorded(self: BrokerService, lease: Lease, exc: BaseException) -> NoReturn:
        self.manager.rollback(lease.id)
        log.error("could not record grant %s: %s", lease.id, exc)
        raise Internal(f"the broker could not record the grant durably: {exc}") from exc

    def _grant_recorded(self: BrokerService, lease: Lease) -> None:
        """A grant is on disk: make it real (the hooks, Internal if one refuses), say so."""
        refusal = self._refused_by_hooks(lease)
        if refusal:
            raise Internal(f"the broker could not make the grant real: {refusal}")
        user = lease.holder.user
        log_event("grant", f"granted {', '.join(lease.devices)} to {user} (pid {lease.holder.pid})",
                  lease_id=lease.id, user=user, device_uuids=lease.devices, pid=lease.holder.pid)
        self._expire_by(self.manager.deadline(lease))
        self.on_change()

    async def _hand_back_when_saved(self: BrokerService, saved: asyncio.Future[None], lease: Lease) -> None:
        try:
            await saved
        except Exception:  # not recorded: nothing to hand back but the memory
            self.manager.rollback(lease.id)
            return
        if lease.active and not self.stopping:
            self._end(lease.id, RELEASED, LEFT)

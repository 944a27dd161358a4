"""The durable queue: a waiting request is on disk before its client hears its place;
its client hears each change of its place, then its grant; after a restart the queue
comes back in order and a waiter cut off by it takes up its own place again (proven by
its kernel identity, brokerd/state/queue_record.py). Grants themselves are the ledger's
(brokerd/core/ledger.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import replace
from typing import NamedTuple

from brokerd.base.clock import wall
from brokerd.base.journal import log_event
from brokerd.base.process import Holder, ProcessId
from brokerd.config.loader import Config
from brokerd.contract import Requirement, evaluate
from brokerd.core.changes import ChangeFeed
from brokerd.core.governing import Governance
from brokerd.core.ledger import LEFT, Ledger
from brokerd.core.liveness import ProcessWatcher
from brokerd.core.tasks import Tasks
from brokerd.core.views import find_device
from brokerd.core.waiting import Mailbox, QueuedUpdate, WaitingRoom
from brokerd.leasing.errors import DeadlineExceeded, not_recorded
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import RELEASED, Ask, Lease, LeaseTerms, Request
from brokerd.state.queue_record import WaitRecord, WaitRecords
from brokerd.state.store import LeaseStore

# How long a request restored at start-up waits for its client to come back to it. A
# client reconnects within seconds of the broker's return (client/vaccel/session/lease_session.py).
REATTACH_GRACE_S = 60.0


class Rebuilt(NamedTuple):
    """A recorded request, rebuilt (brokerd/edge/messages.py rebuild_request)."""

    requirement: Requirement
    accelerator_config_yaml: str
    time_limit_s: float = 0.0
    devices: tuple[str, ...] = ()  # as the client named them
    reservation: bool = False
    memory_mib: int = 0  # a memory share it asks for (brokerd/leasing/shares.py), 0 = whole devices


Rebuild = Callable[[bytes], Rebuilt]


def lease_terms(config: Config, accelerator_config_yaml: str) -> LeaseTerms:
    """What a lease carries besides its devices: the allocator settings and memory cap of
    the config, and the client's accelerator config."""
    return LeaseTerms(allocator_config=config.allocator_config, memory_cap_mib=config.memory_cap_mib,
                      accelerator_config_yaml=accelerator_config_yaml)


class DurableQueue:
    def __init__(self, manager: LeaseManager, store: LeaseStore, *, config: Callable[[], Config],
                 ledger: Ledger, governance: Governance, waiting: WaitingRoom, records: WaitRecords,
                 watcher: ProcessWatcher, tasks: Tasks, changes: ChangeFeed) -> None:
        self.manager = manager
        self.store = store
        self._config = config
        self.ledger = ledger
        self.governance = governance
        self.waiting = waiting
        self.records = records
        self.watcher = watcher
        self.tasks = tasks
        self.changes = changes

    # -- joining and waiting -----------------------------------------------------------

    def enter(self, request: Request, holder: Holder, key: str, max_wait_s: float | None,
              spec: bytes) -> AsyncIterator[QueuedUpdate | Lease]:
        """A request the manager queued: record it (on disk before its waiter hears its
        place), then wait for its grant."""
        box = self.waiting.open(request.id)
        now = wall()
        deadline = 0.0 if max_wait_s is None else now + max_wait_s
        record = WaitRecord(request.id, key, holder, now, deadline, spec)
        self.records.add(record)
        saved = self.store.save_queued(record)
        log_event("queue", f"{holder.user} (pid {holder.pid}) waits for " + (
                  f"a share of {request.ask.memory_mib} MiB" if request.ask.memory_mib
                  else f"{request.requirement.gpus} device(s)"),
                  user=holder.user, pid=holder.pid, request_id=request.id)
        return self._wait_in_queue(record, box, saved)

    def resume(self, record: WaitRecord) -> AsyncIterator[QueuedUpdate | Lease] | None:
        """The stream of a waiter that came back to its own request, or None when there is
        nothing left to come back to (its grant ended meanwhile)."""
        holder = record.holder
        log_event("reattach", f"{holder.user} (pid {holder.pid}) is back for request {record.request_id}",
                  user=holder.user, pid=holder.pid, request_id=record.request_id)
        if record.lease_id:
            lease = self.manager.leases.get(record.lease_id)
            return None if lease is None else self._deliver_kept(record, lease)
        return self._wait_in_queue(record, self.waiting.open(record.request_id))

    async def _deliver_kept(self, record: WaitRecord, lease: Lease) -> AsyncIterator[Lease]:
        self.manager.heartbeat(lease.id)  # its TTL counts from the moment its holder has it
        yield lease
        self._delivered(record)

    def _delivered(self, record: WaitRecord) -> None:
        self.records.drop(record.request_id)
        self.ledger.unrecord(record.request_id)

    async def _wait_in_queue(
        self, record: WaitRecord, box: Mailbox, saved: asyncio.Future[None] | None = None
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
                    raise not_recorded(f"the broker could not record the request durably: {exc}", exc) from exc
            self.waiting.tell(self.manager, record.request_id)  # its own place at once
            lending = self.manager.lending
            if lending.enabled or any(lease.borrowed for lease in self.manager.leases.values()):
                self.ledger.pump_soon()  # it may borrow, or need what is lent (brokerd/leasing/lending.py)
            self.waiting.announce(self.manager)  # everyone else's total changed
            self.changes.changed()
            # The record's deadline is a wall-clock time (it outlives a restart); the wait
            # runs on the monotonic clock from here, so a step of the wall clock moves nothing.
            ends = time.monotonic() + record.deadline - wall() if record.deadline else None
            while True:
                timeout = None if ends is None else max(0.0, ends - time.monotonic())
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
            if self.waiting.close(record.request_id, box=box) and not delivered and not self.tasks.stopping:
                self._waiter_left(record, box, lease)

    # -- leaving -----------------------------------------------------------------------

    def _waiter_left(self, record: WaitRecord, box: Mailbox, lease: Lease | None) -> None:
        holder = record.holder
        self.records.drop(record.request_id)
        if self.manager.cancel(record.request_id):
            self._waiter_gone(record, f"{holder.user} (pid {holder.pid}) left")
            return
        # Off the queue already: granted while the client was leaving (cancelled, gave up),
        # or its grant could not be recorded (a full disk: the client asks again under its
        # key). Its record leaves the disk too, or a restart would queue it again.
        self.ledger.unrecord(record.request_id)
        # The grant may be in hand or still in the mailbox; one still being committed is found by the pump.
        for grant in ([lease] if lease is not None else []) + box.unread_grants():
            if grant.active:
                self.ledger.end(grant.id, RELEASED, LEFT)

    async def _drop_if_unclaimed(self, record: WaitRecord) -> None:
        """A restored request whose client does not come back in time leaves the queue."""
        wait = REATTACH_GRACE_S
        if record.deadline:
            wait = min(wait, record.deadline - wall())
        await asyncio.sleep(max(0.0, wait))
        current = self.records.get(record.request_id)
        if current is None or current.lease_id or self.waiting.attached(record.request_id):
            return
        if self.manager.cancel(record.request_id):
            self.records.drop(record.request_id)
            self._waiter_gone(record, "its client did not come back after the restart")

    def _waiter_gone(self, record: WaitRecord, why: str) -> None:
        holder = record.holder
        log_event("dequeue", f"request {record.request_id} of {holder.user} left the queue: {why}",
                  user=holder.user, pid=holder.pid, request_id=record.request_id)
        self.ledger.unrecord(record.request_id)
        self.ledger.forget_if_idle(holder.process)
        self.waiting.announce(self.manager)
        self.ledger.pump_soon()
        self.changes.changed()

    def requests_dropped(self, process: ProcessId, dropped: list[Request]) -> None:
        """The kernel says `process` exited: its waiting requests (the manager has taken
        them off the queue) end, and what they kept may go to others."""
        for request in dropped:
            log_event("dequeue", f"pid {process.pid} left the queue (exited)", user=request.holder.user,
                      pid=process.pid, request_id=request.id)
            self.waiting.close(request.id, QueuedUpdate(0, 0, "holder exited", ()))
            self.records.drop(request.id)
            self.ledger.unrecord(request.id)
        if dropped:
            self.waiting.announce(self.manager)
            self.ledger.pump_soon()

    # -- after a restart ---------------------------------------------------------------

    def restore(self, records: list[WaitRecord], rebuild: Rebuild) -> None:
        """Put back the recorded queue, in order: requests whose process died meanwhile are
        dropped, and those their client has replaced (see `replaced`); grants made for an
        absent waiter are kept for it."""
        stale = replaced(records, self.manager.leases.values())
        for record in records:
            holder = record.holder
            if not self.watcher.watch(holder.process):
                self._drop_restored(record, f"pid {holder.pid} exited while the broker was down")
            elif record.request_id in stale:
                self._drop_restored(record, "its client asked again under the same key since")
            elif record.lease_id:
                if record.lease_id in self.manager.leases:
                    self.records.add(record)
                else:
                    self._drop_restored(record, "its grant has ended")
            else:
                self._restore_waiting(record, rebuild)
        if self.manager.queue:
            log_event("restore", f"{len(self.manager.queue)} queued request(s) restored")
            self.ledger.pump_soon()

    def _restore_waiting(self, record: WaitRecord, rebuild: Rebuild) -> None:
        holder = record.holder
        try:
            rebuilt = rebuild(record.spec)
            requirement = rebuilt.requirement
            limits = self.governance.limits_for(holder)
            ask = Ask(self.governance.time_limit(limits, rebuilt.time_limit_s),
                      tuple(find_device(self.manager, name).uuid for name in rebuilt.devices),
                      rebuilt.reservation, rebuilt.memory_mib)
        except Exception as exc:  # parsed once already; a newer parser or policy may refuse it
            self._drop_restored(record, f"it can no longer be read or granted ({exc})")
            return
        evaluation = evaluate(requirement, list(self.manager.devices.values()))
        if not evaluation.satisfiable:
            self._drop_restored(record, evaluation.reason or "no device here satisfies it any more")
            return
        if ask.only:
            evaluation = replace(evaluation, eligible=tuple(u for u in evaluation.eligible if u in ask.only))
        terms = lease_terms(self._config(), rebuilt.accelerator_config_yaml)
        self.manager.queue.append(Request(record.request_id, holder, requirement, evaluation, terms,
                                          record.since, ask, limits.user_limits()))
        self.records.add(record)
        self.tasks.spawn(self._drop_if_unclaimed(record))

    def _drop_restored(self, record: WaitRecord, why: str) -> None:
        holder = record.holder
        log_event("dequeue", f"queued request {record.request_id} of {holder.user} dropped: {why}",
                  user=holder.user, pid=holder.pid, request_id=record.request_id)
        self.ledger.unrecord(record.request_id)
        self.ledger.forget_if_idle(holder.process)


def replaced(records: list[WaitRecord], leases: Iterable[Lease]) -> set[str]:
    """The waiting requests (of `records`, in the order they were recorded) that their client
    has replaced: it asked again under the same key, and holds a lease under it or waits as
    a newer record. That happens when a grant cannot be recorded (a full disk): the waiter
    is told so and asks again, while the old request's record stays on disk, its removal
    having met the same full disk. Put back, it would be a second request of a live client
    that nobody waits on: granted to nobody, its lease would expire unheard and the reaper
    would signal that client (issue 46's faulted day)."""
    newest = {(r.holder.process, r.holder.uid, r.key): r.request_id for r in records if r.key}
    held = {(lease.holder.process, lease.holder.uid, lease.request_key) for lease in leases if lease.request_key}
    stale = set()
    for record in records:
        mine = (record.holder.process, record.holder.uid, record.key)
        if record.key and not record.lease_id and (newest[mine] != record.request_id or mine in held):
            stale.add(record.request_id)
    return stale

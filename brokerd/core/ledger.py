"""Grants and ends, each on disk before anyone hears of it, and what follows each one.

A grant made at once is committed before its client hears (`persist_grant`); the grants
a pump makes are queued for commit together, in order, the moment the manager makes
them, and each waiter hears from its commit itself (`granted_durably`). An end is queued
for commit the moment it happens in memory (`record_end`), and what it frees is granted
in the same transaction (LeaseStore.hold): an end that happens while an earlier grant
commits is committed after the grant it ends, so no device holding outlives its lease.
After a grant or an end the lease hooks run (brokerd/leasing/hooks.py): a hook that
refuses a grant ends it before its holder hears of it.

An end the disk did not take (the state directory's file system full, issue 46) is kept
and written again ahead of every later write and every RESAVE_EVERY_S until it is on
disk: left unwritten, its device holding stayed in the file, every later grant of that
device failed on it ("UNIQUE constraint failed") long after the disk had room, and a
restart brought the ended lease back. Grants meanwhile are refused with the disk's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import NoReturn

from brokerd.base.journal import log_event
from brokerd.base.process import ProcessId
from brokerd.core.changes import ChangeFeed
from brokerd.core.liveness import ProcessWatcher
from brokerd.core.reaper import reap_after_end
from brokerd.core.tasks import Tasks
from brokerd.core.waiting import WaitingRoom
from brokerd.leasing.errors import Internal, LeaseError, not_recorded
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import HOLDER_EXITED, LOST, RELEASED, Grant, Lease
from brokerd.state.queue_record import WaitRecords
from brokerd.state.store import LeaseStore

log = logging.getLogger("vaccel.brokerd")

LEFT = "the client left before the grant reached it"
RESAVE_EVERY_S = 5.0


class Ledger:
    def __init__(self, manager: LeaseManager, store: LeaseStore, *, tasks: Tasks, changes: ChangeFeed,
                 waiting: WaitingRoom, records: WaitRecords, watcher: ProcessWatcher,
                 hooks: Sequence[LeaseHook], deadline_moved: Callable[[float], None],
                 on_its_devices: Callable[[Lease], list[ProcessId]] = lambda lease: []) -> None:
        self.manager = manager
        self.store = store
        self.tasks = tasks
        self.changes = changes
        self.waiting = waiting
        self.records = records
        self.watcher = watcher
        self.hooks = hooks  # the service's list: add-ons plugged in later are seen
        self._deadline_moved = deadline_moved  # something may end by then: wake the expiry loop
        self._on_its_devices = on_its_devices  # what the last probe saw of the lease's (Inventory)
        self._unsaved: dict[str, Lease] = {}  # ended leases whose end the disk did not take
        self._unsaved_error = ""  # why, as the disk said

    # -- grants ------------------------------------------------------------------------

    async def persist_grant(self, lease: Lease) -> None:
        """Commit a grant made outside the pump (granted at once) before its client hears."""
        self._resave_ends()
        saved = self.store.save_grant(lease)
        try:
            await asyncio.shield(saved)
        except asyncio.CancelledError:
            # The client left while its grant was being recorded: once it is on disk, end it.
            self.tasks.spawn(self._hand_back_when_saved(saved, lease))
            raise
        except Exception as exc:
            self._not_recorded(lease, exc)
        self._recorded(lease)

    def pump(self) -> None:
        """Grant what the queue can now have: the grants are made in memory and queued for
        commit (no await: a caller that holds the store's writes, LeaseStore.hold, gets them
        into its own transaction). Each waiter hears from the commit itself."""
        grants = self.manager.pump()
        if grants:
            self._resave_ends()
        for grant in grants:
            # The lease carries its request's key, as a grant made at once does: a client whose
            # grant reply was lost gets it back when it asks again, and a record of the request
            # left on disk is known at a restart for one its client has replaced (queueing.py).
            record = self.records.get(grant.request.id)
            if record is not None and not grant.lease.request_key:
                grant.lease.request_key = record.key
            self.store.save_grant_then(grant.lease, grant.request.id,
                                       lambda error, grant=grant: self._granted_durably(grant, error))
        for lease in self.manager.lending.recalled:  # borrowed, and a request within limits needs it
            self.tasks.keep(self.store.save_ending(lease), "a borrowed lease's notice")
            log_event("notice", f"lease {lease.id} of {lease.holder.user}: {lease.notice}", lease_id=lease.id,
                      user=lease.holder.user, device_uuids=lease.devices)
            self._deadline_moved(self.manager.deadline(lease))
            self.changes.changed()

    def pump_soon(self) -> None:
        """The pump, in a task of its own (after a change that is not an end)."""
        self.tasks.spawn(self._pump_task())

    async def _pump_task(self) -> None:
        self.pump()

    def _granted_durably(self, grant: Grant, error: BaseException | None) -> None:
        """A pump's grant has committed (`error` None) or failed to: tell its waiter now, in
        the commit's own turn of the loop. That is ahead of the releaser's reply and of
        whatever else the commit wakes, and two turns sooner than a task awaiting the
        commit would: a hand-over is the latency a queued student sees (issue 16)."""
        request_id = grant.request.id
        self.waiting.announce(self.manager)  # the queue moved up (or the head heard it failed)
        try:
            if error is not None:
                self._not_recorded(grant.lease, error)
            self._recorded(grant.lease)
        except Internal as exc:
            if not self.waiting.post(request_id, exc):  # the waiter hears of it rather than waiting forever
                self.records.drop(request_id)
                self.unrecord(request_id)
            return
        # Posted after the commit: a waiter that left meanwhile gets its devices handed
        # back; one away because of a restart finds its grant when it comes back.
        if self.waiting.post(request_id, grant.lease):
            return
        if self.records.get(request_id) is not None and grant.lease.active:
            self.records.granted(request_id, grant.lease.id)
        else:
            self.end(grant.lease.id, RELEASED, LEFT)

    def _not_recorded(self, lease: Lease, exc: BaseException) -> NoReturn:
        self.manager.rollback(lease.id)
        log.error("could not record grant %s: %s", lease.id, exc)
        if self._unsaved:  # the grant may fail on the unsaved end's holding: the disk is the cause
            unsaved = next(iter(self._unsaved.values()))
            raise not_recorded(f"the broker could not record the grant durably: {self._unsaved_error} (the end of "
                               f"lease {unsaved.id} is not on disk yet)", self._unsaved_error) from exc
        raise not_recorded(f"the broker could not record the grant durably: {exc}", exc) from exc

    def _recorded(self, lease: Lease) -> None:
        """A grant is on disk: make it real (the hooks, Internal if one refuses), say so."""
        refusal = self._refused_by_hooks(lease)
        if refusal:
            raise Internal(f"the broker could not make the grant real: {refusal}")
        user = lease.holder.user
        log_event("grant", f"granted {', '.join(lease.devices)} to {user} (pid {lease.holder.pid})",
                  lease_id=lease.id, user=user, device_uuids=lease.devices, pid=lease.holder.pid)
        self._deadline_moved(self.manager.deadline(lease))
        self.changes.changed()

    def _refused_by_hooks(self, lease: Lease) -> str:
        """Run the hooks a grant needs before its holder hears of it; the first refusal
        ends the lease and is returned, "" when all agree."""
        for hook in self.hooks:
            try:
                hook.granted(lease)
            except Exception as exc:
                why = f"{hook.name}: {exc}"
                log.error("grant %s refused by %s", lease.id, why)
                if lease.active:
                    self.end(lease.id, LOST, why)
                return why
        return ""

    async def _hand_back_when_saved(self, saved: asyncio.Future[None], lease: Lease) -> None:
        try:
            await saved
        except Exception:  # not recorded: nothing to hand back but the memory
            self.manager.rollback(lease.id)
            return
        if lease.active and not self.tasks.stopping:
            self.end(lease.id, RELEASED, LEFT)

    # -- ends --------------------------------------------------------------------------

    def end(self, lease_id: str, state: str, reason: str) -> None:
        """End a lease from the daemon's side (client gone, expired, lost); nobody waits
        for its commit. A lease that has ended already stays as it ended."""
        with contextlib.suppress(LeaseError):
            self.tasks.keep(self.record_end(self.manager.end(lease_id, state, reason)))

    def record_end(self, lease: Lease) -> asyncio.Future[None]:
        """Queue the end's commit right away, at the moment it happened in memory, and
        grant what it freed in the same commit (LeaseStore.hold): the pump runs in the
        loop's next step, once every end of this step is queued (an expiry ends several
        leases at once), so a grant of freed devices is never on disk before their end."""
        self.store.hold()
        asyncio.get_running_loop().call_soon(self._pump_held)  # first: whatever follows raises, it releases
        self._resave_ends()
        saved = self.store.save_end(lease)
        saved.add_done_callback(lambda done: self._end_saved(lease, done))
        self.records.drop_lease(lease.id)
        self.forget_if_idle(lease.holder.process)
        for member in lease.members:
            self.forget_if_idle(member)
        if lease.container is not None:
            self.forget_if_idle(lease.container.init)
        log_event(lease.state if lease.state != HOLDER_EXITED else "exit",
                  f"lease {lease.id} of {lease.holder.user} ended ({lease.state}): {lease.end_reason}",
                  lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices,
                  state=lease.state)
        # Not a release: what still runs under it is stopped, its processes on its devices too.
        reap_after_end(lease, self.manager.ttl_s, more=self._on_its_devices(lease))
        for hook in self.hooks:
            try:
                hook.ended(lease)
            except Exception:
                log.exception("%s failed after the end of lease %s", hook.name, lease.id)
        self.changes.changed()
        return saved

    def _end_saved(self, lease: Lease, done: asyncio.Future[None]) -> None:
        """An end's commit settled: forget it once on disk, keep it to write again if not."""
        failed = not done.cancelled() and done.exception() is not None
        if not failed:
            if self._unsaved.pop(lease.id, None) is not None:
                log_event("store", f"the end of lease {lease.id} is on disk now", lease_id=lease.id)
            return
        self._unsaved_error = str(done.exception())
        if lease.id not in self._unsaved:
            if not self._unsaved:
                self.tasks.spawn(self._resave_until_written())
            self._unsaved[lease.id] = lease
            log.error("the end of lease %s is not on disk (%s): written again until it is", lease.id,
                      done.exception())

    def _resave_ends(self) -> None:
        """Write the ends the disk did not take again, ahead of what comes next."""
        for lease in list(self._unsaved.values()):
            self.store.save_end(lease).add_done_callback(lambda done, lease=lease: self._end_saved(lease, done))

    async def _resave_until_written(self) -> None:
        while self._unsaved and not self.tasks.stopping:
            await asyncio.sleep(RESAVE_EVERY_S)
            self._resave_ends()

    def _pump_held(self) -> None:
        """The pump after an end: its grants join the held end in one transaction. A plain
        callback, not a task: it runs even when the loop is cancelling tasks, so held
        writes always reach the writer."""
        try:
            self.pump()
        finally:
            self.store.release_held()

    # -- bookkeeping -------------------------------------------------------------------

    def forget_if_idle(self, process: ProcessId) -> None:
        """Stop watching a process that holds nothing and waits for nothing."""
        if not self.manager.involves(process):
            self.watcher.release(process)

    def unrecord(self, request_id: str) -> None:
        """Take the request off the queue on disk; nobody waits for that commit."""
        self.tasks.keep(self.store.save_dequeued(request_id), "a change of the queue")

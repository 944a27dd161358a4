"""The broker's async core: the lease manager plus persistence, process liveness, timers
and the waiters' queue updates. No gRPC here: the servicer translates messages to these
calls and domain errors to status codes.

Every state change follows one path: manager decides -> store commits -> caller hears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import signal
import time
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field

from brokerd.config import Config
from brokerd.contract import Requirement
from brokerd.devices import Device, GpuProcess, Snapshot
from brokerd.identity import Identity
from brokerd.journal import log_event
from brokerd.leases import (
    HOLDER_EXITED,
    RELEASED,
    Busy,
    Caller,
    Holder,
    Lease,
    LeaseError,
    LeaseManager,
    LeaseTerms,
    NotFound,
    PermissionDenied,
    Request,
)
from brokerd.liveness import ProcessWatcher
from brokerd.occupancy import Occupancy, classify, to_signal
from brokerd.procinfo import ancestors, process_info, user_name
from brokerd.store import LeaseStore

log = logging.getLogger("vaccel.brokerd")


# Each waiting request holds a pidfd and a stream: bound what one user can pile up.
MAX_QUEUED_PER_USER = 64


class Internal(LeaseError):
    kind = "internal"


class DeadlineExceeded(LeaseError):
    kind = "deadline_exceeded"


@dataclass(frozen=True)
class QueuedUpdate:
    position: int
    total: int
    message: str
    held: tuple[str, ...]  # uuids of the devices leased right now


@dataclass
class _Waiter:
    request: Request
    updates: asyncio.Queue[QueuedUpdate | Lease | LeaseError] = field(default_factory=asyncio.Queue)
    last_position: tuple[int, int] = (0, 0)


class BrokerService:
    def __init__(
        self,
        config: Config,
        store: LeaseStore,
        snapshot: Snapshot,
        *,
        refresh: Callable[[], Snapshot] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.snapshot = snapshot
        self._refresh_inventory = refresh
        self.manager = LeaseManager(
            snapshot.devices,
            ttl_s=config.heartbeat_ttl_s,
            max_duration_s=config.max_lease_duration_s,
            clock=clock,
        )
        self.occupancy = Occupancy()
        self._first_seen: dict[int, float] = {}  # unleased GPU pid -> first sighting
        self._waiters: dict[str, _Waiter] = {}
        self._watcher: ProcessWatcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._expiry_wakeup = asyncio.Event()
        self._admin_cache: dict[int, tuple[bool, float]] = {}
        self._names: dict[int, tuple[str, float]] = {}
        self.on_change: Callable[[], None] = lambda: None

    # -- lifecycle ---------------------------------------------------------------------

    def restore(self, active: list[Lease], ended: list[Lease], drained: dict[str, str] | None = None) -> None:
        """Put back what the store held. Must run inside the loop (it opens pidfds).
        Holders that died while the daemon was down are reclaimed at once."""
        self._watcher = ProcessWatcher(asyncio.get_running_loop(), self._process_exited)
        self.manager.drained.update(drained or {})
        for lease in ended:
            self.manager.ended[lease.id] = lease
            for uuid in lease.devices:
                self.manager.last_used[uuid] = max(self.manager.last_used.get(uuid, 0), lease.ended_at)
        for lease in active:
            self.manager.restore(lease)
            restored = self.manager.leases[lease.id]
            alive = self._watcher.watch(lease.holder.pid, lease.holder.start_time)
            restored.members = {
                m for m in lease.members if self._watcher.watch(*m)
            }
            if alive:
                log_event("restore", f"lease {lease.id} restored for {lease.holder.user}",
                          lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices)
            else:
                ended_lease = self.manager.end(
                    lease.id, HOLDER_EXITED, f"holder pid {lease.holder.pid} exited while the broker was down")
                self._spawn(self._logged(self._record_end(ended_lease)))
        # Leases on devices that vanished while the daemon was down end now; devices used
        # without a lease are held back.
        self._set_inventory(self.snapshot)

    def start_timers(self) -> None:
        self._tasks.append(asyncio.create_task(self._expiry_loop(), name="expiry"))
        if self._refresh_inventory is not None and self.config.probe_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._probe_loop(), name="probe"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._watcher is not None:
            self._watcher.close()

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    # -- identity ----------------------------------------------------------------------

    def caller(self, identity: Identity) -> Caller:
        return Caller(identity.uid, identity.gid, identity.pid, identity.start_time, self.is_admin(identity))

    def is_admin(self, identity: Identity) -> bool:
        """Root, the daemon's own user (a personal broker), and the admin group."""
        if identity.uid in (0, os.geteuid()):
            return True
        cached = self._admin_cache.get(identity.uid)
        now = time.monotonic()
        if cached is not None and now - cached[1] < 60:
            return cached[0]
        gid = self.config.admin_gid()
        admin = False
        if gid is not None:
            with contextlib.suppress(KeyError, OSError):
                admin = gid in os.getgrouplist(pwd.getpwuid(identity.uid).pw_name, identity.gid)
        self._admin_cache[identity.uid] = (admin, now)
        return admin

    def _user_name(self, uid: int) -> str:
        """Cached: a name lookup may go to LDAP/sssd, and it sits on every request's path."""
        cached = self._names.get(uid)
        now = time.monotonic()
        if cached is None or now - cached[1] > 300:
            cached = self._names[uid] = (user_name(uid), now)
        return cached[0]

    def holder(self, identity: Identity, command: str) -> Holder:
        return Holder(
            identity.uid, identity.gid, identity.pid, identity.start_time,
            self._user_name(identity.uid), _printable(command) or _command_of(identity.pid),
        )

    # -- acquire -----------------------------------------------------------------------

    async def acquire(
        self,
        identity: Identity,
        requirement: Requirement,
        *,
        wait: bool,
        max_wait_s: float | None,
        command: str = "",
        accelerator_config_yaml: str = "",
        cache_key: Hashable | None = None,
    ) -> AsyncIterator[QueuedUpdate | Lease]:
        """Yield QueuedUpdate while waiting, then the granted Lease (already durable).
        Leaving the iteration early (the client cancelled) removes the request."""
        assert self._watcher is not None
        holder = self.holder(identity, command)
        if not self._watcher.watch(holder.pid, holder.start_time):
            raise LeaseError(f"process {holder.pid} exited before its request was handled")
        terms = LeaseTerms(
            allocator_config=self.config.allocator_config,
            memory_cap_mib=self.config.memory_cap_mib,
            accelerator_config_yaml=accelerator_config_yaml,
        )
        waiting = sum(1 for r in self.manager.queue if r.holder.uid == holder.uid)
        if wait and waiting >= MAX_QUEUED_PER_USER:
            self._forget_if_idle(holder)
            raise Busy(f"{holder.user} already has {waiting} requests waiting; let some finish or cancel them")
        try:
            outcome = self.manager.submit(holder, requirement, wait=wait, terms=terms, cache_key=cache_key)
        except LeaseError as exc:
            log_event("refuse", f"refused {requirement.gpus} device(s) to {holder.user}: {exc}",
                      user=holder.user, pid=holder.pid, level=logging.INFO)
            self._forget_if_idle(holder)
            raise
        if isinstance(outcome, Lease):
            await self._persist_grant(outcome)
            try:
                yield outcome
            except GeneratorExit:
                self._end(outcome.id, RELEASED, "the client left before the grant reached it")
                raise
            return
        waiter = _Waiter(outcome)
        self._waiters[outcome.id] = waiter
        log_event("queue", f"{holder.user} (pid {holder.pid}) waits for {requirement.gpus} device(s)",
                  user=holder.user, pid=holder.pid, request_id=outcome.id)
        self._announce_positions()
        self.on_change()
        delivered = False
        lease: Lease | None = None
        deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    update = await asyncio.wait_for(waiter.updates.get(), timeout)
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"gave up after waiting {max_wait_s:.0f}s; {self.manager.holders_summary()}"
                    ) from None
                if isinstance(update, LeaseError):
                    raise update
                if isinstance(update, Lease):
                    lease = update
                    yield lease
                    delivered = True
                    return
                yield update
        finally:
            self._waiters.pop(outcome.id, None)
            if self.manager.cancel(outcome.id):
                log_event("dequeue", f"{holder.user} (pid {holder.pid}) left the queue",
                          user=holder.user, pid=holder.pid, request_id=outcome.id)
                self._forget_if_idle(holder)
                self._announce_positions()
                self._spawn(self._pump())
                self.on_change()
            elif not delivered:
                # Granted while the client was leaving (cancelled, gave up): the grant may be
                # in hand or still in the waiter's mailbox. Hand the devices straight back.
                pending = [lease] if lease is not None else []
                while not waiter.updates.empty():
                    pending.append(waiter.updates.get_nowait())
                for item in pending:
                    if isinstance(item, Lease) and item.active:
                        self._end(item.id, RELEASED, "the client left before the grant reached it")

    async def _persist_grant(self, lease: Lease) -> None:
        saved = self.store.save_grant(lease)
        try:
            await asyncio.shield(saved)
        except asyncio.CancelledError:
            # The client left while its grant was being recorded: once it is on disk, end it.
            self._spawn(self._hand_back_when_saved(saved, lease))
            raise
        except Exception as exc:
            self.manager.rollback(lease.id)
            log.error("could not record grant %s: %s", lease.id, exc)
            raise Internal(f"the broker could not record the grant durably: {exc}") from exc
        user = lease.holder.user
        log_event("grant", f"granted {', '.join(lease.devices)} to {user} (pid {lease.holder.pid})",
                  lease_id=lease.id, user=user, device_uuids=lease.devices, pid=lease.holder.pid)
        self._expiry_wakeup.set()
        self.on_change()

    async def _hand_back_when_saved(self, saved: asyncio.Future[None], lease: Lease) -> None:
        try:
            await saved
        except Exception:  # not recorded: nothing to hand back but the memory
            self.manager.rollback(lease.id)
            return
        if lease.active:
            self._end(lease.id, RELEASED, "the client left before the grant reached it")

    async def _pump(self) -> None:
        """Grant what the queue can now have; each grant is durable before its waiter hears."""
        grants = self.manager.pump()
        for grant in grants:
            waiter = self._waiters.get(grant.request.id)
            try:
                await self._persist_grant(grant.lease)
            except Internal as exc:
                if waiter is not None:  # the waiter hears of it rather than waiting forever
                    waiter.updates.put_nowait(exc)
                continue
            if waiter is not None:
                waiter.updates.put_nowait(grant.lease)
            else:
                self._end(grant.lease.id, RELEASED, "the client left before the grant reached it")
        if grants:
            self._announce_positions()

    def _announce_positions(self) -> None:
        held = tuple(self.manager.owner)
        summary = self.manager.holders_summary()
        for request in self.manager.queue:
            waiter = self._waiters.get(request.id)
            if waiter is None:
                continue
            position = self.manager.queue_position(request.id)
            if position == waiter.last_position:
                continue
            waiter.last_position = position
            n = request.requirement.gpus
            message = (f"waiting for {n} GPU{'s' if n > 1 else ''}: position {position[0]} "
                       f"of {position[1]}; {summary}")
            waiter.updates.put_nowait(QueuedUpdate(position[0], position[1], message, held))

    # -- lease operations --------------------------------------------------------------

    async def heartbeat(self, identity: Identity, lease_id: str) -> Lease:
        return self.manager.heartbeat(lease_id, self.caller(identity))

    async def join(self, identity: Identity, lease_id: str) -> Lease:
        assert self._watcher is not None
        lease = self.manager.join(lease_id, self.caller(identity))
        member = (identity.pid, identity.start_time)
        if member in lease.members and self._watcher.watch(*member):
            await self.store.save_members(lease)
        return lease

    async def drain(self, identity: Identity, device: str, reason: str, undo: bool) -> Device:
        """Admins take a device out of the pool (by uuid or index) or put it back."""
        if not self.is_admin(identity):
            raise PermissionDenied(f"draining devices is for root and the {self.config.admin_group!r} group")
        target = self.find_device(device)
        self.manager.drain(target.uuid, _printable(reason), undo=undo)
        await self.store.save_drain(target.uuid, self.manager.drained.get(target.uuid, ""), undo)
        user = self._user_name(identity.uid)
        verb = "returned to the pool" if undo else f"drained ({self.manager.drained[target.uuid]})"
        log_event("undrain" if undo else "drain", f"gpu{target.index} {verb} by {user}", user=user,
                  device_uuids=(target.uuid,))
        if undo:
            self._spawn(self._pump())
        self.on_change()
        return target

    def find_device(self, text: str) -> Device:
        for device in self.manager.devices.values():
            if text in (device.uuid, str(device.index), f"gpu{device.index}"):
                return device
        raise NotFound(f"no device {text!r} on this host: give its index (0, gpu0) or uuid (see `vaccel status`)")

    async def release(self, identity: Identity, lease_id: str, reason: str = "") -> Lease:
        lease = self.manager.release(lease_id, self.caller(identity), _printable(reason))
        try:
            await self._record_end(lease)
        except Exception as exc:
            raise Internal(f"the broker could not record the release durably: {exc}") from exc
        return lease

    def _end(self, lease_id: str, state: str, reason: str) -> None:
        """End a lease from the daemon's side (client gone, expired, lost)."""
        with contextlib.suppress(LeaseError):
            self._spawn(self._logged(self._record_end(self.manager.end(lease_id, state, reason))))

    def _record_end(self, lease: Lease) -> asyncio.Future[None]:
        """Queue the end's commit right away, at the moment it happened in memory: the
        writer commits in queue order, so a grant of the freed devices (queued later by
        the pump) can never be committed before this end."""
        saved = self.store.save_end(lease)
        self._forget_if_idle(lease.holder)
        for member in lease.members:
            self._forget_if_idle(Holder(0, 0, *member))
        log_event(lease.state if lease.state != HOLDER_EXITED else "exit",
                  f"lease {lease.id} of {lease.holder.user} ended ({lease.state}): {lease.end_reason}",
                  lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices,
                  state=lease.state)
        self._spawn(self._pump())
        self.on_change()
        return saved

    @staticmethod
    async def _logged(saved: asyncio.Future[None]) -> None:
        try:
            await saved
        except Exception as exc:
            log.error("could not record the end of a lease: %s", exc)

    def _forget_if_idle(self, holder: Holder) -> None:
        """Stop watching a process that holds nothing and waits for nothing."""
        key = (holder.pid, holder.start_time)
        busy = any((lease.holder.pid, lease.holder.start_time) == key or key in lease.members
                   for lease in self.manager.leases.values())
        busy = busy or any((r.holder.pid, r.holder.start_time) == key for r in self.manager.queue)
        if not busy and self._watcher is not None:
            self._watcher.unwatch(*key)

    def _process_exited(self, pid: int, start_time: int) -> None:
        ended, dropped = self.manager.process_exited(pid, start_time)
        for request in dropped:
            log_event("dequeue", f"pid {pid} left the queue (exited)", user=request.holder.user,
                      pid=pid, request_id=request.id)
            waiter = self._waiters.pop(request.id, None)
            if waiter is not None:
                waiter.updates.put_nowait(QueuedUpdate(0, 0, "holder exited", ()))
        for lease in ended:
            self._spawn(self._logged(self._record_end(lease)))
        if dropped:
            self._announce_positions()
            self._spawn(self._pump())

    # -- timers ------------------------------------------------------------------------

    async def _expiry_loop(self) -> None:
        while True:
            saving = [self._record_end(lease) for lease in self.manager.expire()]
            for saved in saving:
                await self._logged(saved)
            deadline = self.manager.next_deadline()
            delay = 60.0 if deadline is None else max(0.05, deadline - time.time() + 0.01)
            self._expiry_wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._expiry_wakeup.wait(), delay)

    async def _probe_loop(self) -> None:
        assert self._refresh_inventory is not None
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            try:
                snapshot = await loop.run_in_executor(None, self._refresh_inventory)
            except Exception as exc:  # a failing refresh keeps the last good picture
                log.warning("device refresh failed, keeping the previous inventory: %s", exc)
                continue
            lost_probes = _lost_probes(self.snapshot, snapshot)
            if lost_probes:
                # A probe that worked a moment ago and now finds nothing is usually a
                # transient driver hiccup: revoking every lease on it would be worse.
                # Believe it only when it persists.
                failures += 1
                if failures < _PROBE_FAILURES_BEFORE_BELIEVED:
                    log.warning("the %s probe found nothing this time; keeping the previous inventory",
                                ", ".join(lost_probes))
                    continue
            failures = 0
            self.apply_snapshot(snapshot)

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        before = (self.manager.devices.keys(), dict(self.manager.unavailable))
        self._set_inventory(snapshot)
        if before != (self.manager.devices.keys(), self.manager.unavailable):
            log_event("inventory", f"devices now: {self.summary()}")
            self._spawn(self._pump())
            self.on_change()
        if self.config.unleased_processes == "signal":
            self._signal_unleased()

    def _set_inventory(self, snapshot: Snapshot) -> None:
        """Adopt a snapshot: match GPU processes to leases, hold back unhealthy devices and
        devices used without a lease (allocation fails closed), end leases on lost devices."""
        self.snapshot = snapshot
        leases = self.manager.leases.values()
        self.occupancy = classify(
            snapshot.processes,
            {lease.id: {lease.holder.pid, *(p for p, _ in lease.members)} for lease in leases},
            {lease.id: set(lease.devices) for lease in leases},
            snapshot.devices,
            ancestry=ancestors,
            info=process_info,
        )
        unavailable = {**self.occupancy.busy, **_unhealthy(snapshot.devices)}
        for lost in self.manager.set_inventory(snapshot.devices, unavailable):
            self._spawn(self._logged(self._record_end(lost)))

    def _signal_unleased(self) -> None:
        now = time.time()
        current = {p.pid for p in self.occupancy.unleased}
        self._first_seen = {pid: t for pid, t in self._first_seen.items() if pid in current}
        for pid in current:
            self._first_seen.setdefault(pid, now)
        for pid in to_signal(self.occupancy, self._first_seen, now, self.config.unleased_grace_s,
                             protected={os.getpid()}):
            proc = next(p for p in self.occupancy.unleased if p.pid == pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
                log_event("signal", f"sent SIGTERM to {proc.user}'s pid {pid} ({proc.command}): it used "
                          f"{proc.device_uuid} without a lease for over {self.config.unleased_grace_s:.0f}s",
                          user=proc.user, pid=pid, device_uuids=(proc.device_uuid,), level=logging.WARNING)

    def unleased_processes(self) -> tuple[GpuProcess, ...]:
        return self.occupancy.unleased

    # -- views -------------------------------------------------------------------------

    def device_view(self, device: Device) -> tuple[str, Lease | None]:
        lease_id = self.manager.owner.get(device.uuid)
        return self.manager.device_state(device.uuid), (
            self.manager.leases[lease_id] if lease_id else None)

    def summary(self) -> str:
        devices = self.manager.devices
        leased = len(self.manager.owner)
        unhealthy = sum(1 for d in devices.values() if not d.healthy)
        return (f"{leased}/{len(devices)} GPUs leased, {len(self.manager.queue)} waiting, "
                f"{unhealthy} unhealthy")


_PROBE_FAILURES_BEFORE_BELIEVED = 3


def _lost_probes(before: Snapshot, after: Snapshot) -> list[str]:
    """Vendors whose probe found devices before and finds none now."""
    had = {v.vendor for v in before.verdicts if v.available}
    has = {v.vendor for v in after.verdicts if v.available}
    return sorted((had - has) - {"cpu"})


def _printable(text: str) -> str:
    """Text from one user shown on another's terminal: no escape sequences."""
    return "".join(c for c in text if c.isprintable())


def _command_of(pid: int) -> str:
    info = process_info(pid)
    return info.command if info else ""


def _unhealthy(devices: tuple[Device, ...]) -> dict[str, str]:
    return {d.uuid: d.health_reason or "unhealthy" for d in devices if not d.healthy}

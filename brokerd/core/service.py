"""The broker's async core: the lease manager plus persistence, process liveness, timers
and the waiters' queue updates. No gRPC here: the servicer translates messages to these
calls and their plain results back, and domain errors to status codes.

Every request follows one path: permissions allow -> manager decides -> store commits ->
caller hears. Permissions are asked here and only here (brokerd/core/permissions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from brokerd.base.journal import log_event
from brokerd.base.process import Holder, Identity, ProcessId
from brokerd.config.loader import Config
from brokerd.contract import Requirement, evaluate
from brokerd.core.acquiring import Acquiring
from brokerd.core.governing import Governance
from brokerd.core.idle import IdleWatch
from brokerd.core.liveness import ProcessWatcher
from brokerd.core.permissions import Action, Permissions
from brokerd.core.queueing import DurableQueue
from brokerd.core.reaper import reap_after_end
from brokerd.core.timers import Timers
from brokerd.core.users import UserDirectory
from brokerd.core.views import (
    CheckView,
    DeviceView,
    StatusView,
    device_view,
    device_views,
    find_device,
    leases_of,
    summary,
)
from brokerd.core.waiting import QueuedUpdate, WaitingRoom
from brokerd.devices.model import Device, Snapshot
from brokerd.devices.occupancy import Occupancy
from brokerd.devices.watch import UnleasedSignaller, probe_forever
from brokerd.leasing.errors import Internal, LeaseError
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import HOLDER_EXITED, LOST, Lease
from brokerd.state.accounting import Accounting
from brokerd.state.queue_record import WaitRecords
from brokerd.state.report import Report
from brokerd.state.store import LeaseStore
from vaccel_common.text import printable

log = logging.getLogger("vaccel.brokerd")


class BrokerService(Acquiring, DurableQueue, Governance, Timers):
    """What the broker offers its clients, one method per operation, for the servicer.
    Asking for devices is brokerd/core/acquiring.py; the queue's half (waiting, pumping,
    restoring the queue) is brokerd/core/queueing.py."""

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
        self.manager = LeaseManager(snapshot.devices, ttl_s=config.heartbeat_ttl_s,
                                    max_duration_s=config.max_lease_duration_s, clock=clock)
        self._adopt_policy(config)
        # Both read the config at each use: a reload changes the admin group.
        self.users = UserDirectory(lambda: self.config.admin_gid())
        self.permissions = Permissions(self.users.is_admin, lambda: self.config.admin_group)
        self.occupancy = Occupancy()
        self._unleased = UnleasedSignaller()
        self.waiting = WaitingRoom()
        self.records = WaitRecords()
        self.stopping = False  # shutting down: streams closing now are not clients leaving
        self._watcher: ProcessWatcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._expiry_wakeup = asyncio.Event()
        self._expiry_due = 0.0  # when the expiry loop wakes by itself (0: it is awake)
        self._looked_at = 0.0
        self.on_change: Callable[[], None] = lambda: None
        self.idle_watch = IdleWatch()
        self.hooks: list[LeaseHook] = []  # brokerd/leasing/hooks.py: gating, accounting, metrics
        self.accounting: Accounting | None = None  # set by brokerd/daemon/addons.py: the Report RPC, the dashboard
        self.slurm: Any = None  # brokerd/addons/slurm SlurmDelegate, set by addons in [slurm] mode = "delegate"

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
            # A reservation is held by its user: the command that booked it is long gone.
            alive = restored.reservation or self._watcher.watch(lease.holder.process)
            restored.members = {m for m in lease.members if self._watcher.watch(m)}
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
        for hook in self.hooks:
            hook.restored(list(self.manager.leases.values()))

    def start_timers(self) -> None:
        """Start lease expiry and, if configured, periodic re-probing."""
        self._tasks.append(asyncio.create_task(self._expiry_loop(), name="expiry"))
        if self._refresh_inventory is not None and self.config.probe_interval_s > 0:
            probing = probe_forever(self._refresh_inventory, self.apply_snapshot, current=lambda: self.snapshot,
                                    interval_s=lambda: self.config.probe_interval_s)
            self._tasks.append(asyncio.create_task(probing, name="probe"))

    def reconfigure(self, config: Config) -> None:
        """Adopt a reloaded configuration; leases and the queue stay as they are."""
        self.config = config
        self.manager.ttl_s = config.heartbeat_ttl_s
        self.manager.max_duration_s = config.max_lease_duration_s
        self._expiry_wakeup.set()  # a shorter TTL or maximum duration ends leases sooner
        self._adopt_policy(config)
        # Limits changed: requests they held back may start, queue lines change.
        for request in self.manager.queue:
            request.limits = config.policy.for_user(request.holder.user, request.holder.gid).user_limits()
        self._spawn(self._pump())

    async def close(self) -> None:
        """Stop the timers and every pidfd watch; the state stays on disk."""
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

    # -- acquire: brokerd/core/acquiring.py, but for who may ask ----------------------------

    def _admit(self, identity: Identity, command: str) -> Holder:
        """Who asks, allowed to ask, and watched from now on (its exit ends what it gets)."""
        assert self._watcher is not None
        self.permissions.require(Action.ACQUIRE, identity)
        holder = self.users.holder(identity, command)
        if not self._watcher.watch(holder.process):
            raise LeaseError(f"process {holder.pid} exited before its request was handled")
        return holder

    # -- lease operations --------------------------------------------------------------

    async def heartbeat(self, identity: Identity, lease_id: str) -> Lease:
        """The holder is still at work: the lease's TTL starts again."""
        self.permissions.require(Action.HEARTBEAT, identity, self.manager.active(lease_id))
        return self.manager.heartbeat(lease_id)

    async def join(self, identity: Identity, lease_id: str) -> Lease:
        """The caller's process becomes a member of the lease (its end is watched, and it
        is recorded so a restart keeps it)."""
        assert self._watcher is not None
        self.permissions.require(Action.JOIN, identity, self.manager.active(lease_id))
        lease = self.manager.join(lease_id, identity.process)
        if identity.process in lease.members and self._watcher.watch(identity.process):
            await self.store.save_members(lease)
        return lease

    async def release(self, identity: Identity, lease_id: str, reason: str = "", grace_s: float = 0.0) -> Lease:
        """End a lease: the holder's user releases it, an admin revokes it. With a grace,
        the holder is told now (with the reason) and the lease ends when the grace is over."""
        self.permissions.require(Action.RELEASE, identity, self.manager.active(lease_id))
        if grace_s > 0:
            return await self._end_after_grace(identity, lease_id, printable(reason), grace_s)
        lease = self.manager.release(lease_id, identity.uid, printable(reason))
        try:
            await self._record_end(lease)
        except Exception as exc:
            raise Internal(f"the broker could not record the release durably: {exc}") from exc
        return lease

    async def drain(self, identity: Identity, device: str, reason: str, undo: bool) -> DeviceView:
        """Admins take a device out of the pool (by uuid or index) or put it back."""
        self.permissions.require(Action.DRAIN, identity)
        target = find_device(self.manager, device)
        self.manager.drain(target.uuid, printable(reason), undo=undo)
        await self.store.save_drain(target.uuid, self.manager.drained.get(target.uuid, ""), undo)
        user = self.users.name(identity.uid)
        verb = "returned to the pool" if undo else f"drained ({self.manager.drained[target.uuid]})"
        log_event("undrain" if undo else "drain", f"gpu{target.index} {verb} by {user}", user=user,
                  device_uuids=(target.uuid,))
        if undo:
            self._spawn(self._pump())
        self.on_change()
        return device_view(self.manager, target)

    def _end(self, lease_id: str, state: str, reason: str) -> None:
        """End a lease from the daemon's side (client gone, expired, lost)."""
        with contextlib.suppress(LeaseError):
            self._spawn(self._logged(self._record_end(self.manager.end(lease_id, state, reason))))

    def _record_end(self, lease: Lease) -> asyncio.Future[None]:
        """Queue the end's commit right away, at the moment it happened in memory, and
        grant what it freed in the same commit (LeaseStore.hold): the pump runs in the
        loop's next step, once every end of this step is queued (an expiry ends several
        leases at once), so a grant of freed devices is never on disk before their end."""
        self.store.hold()
        asyncio.get_running_loop().call_soon(self._pump_held)  # first: whatever follows raises, it releases
        saved = self.store.save_end(lease)
        self.records.drop_lease(lease.id)
        self._forget_if_idle(lease.holder.process)
        for member in lease.members:
            self._forget_if_idle(member)
        log_event(lease.state if lease.state != HOLDER_EXITED else "exit",
                  f"lease {lease.id} of {lease.holder.user} ended ({lease.state}): {lease.end_reason}",
                  lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices,
                  state=lease.state)
        reap_after_end(lease, self.ttl_s)  # not a release: what still runs under it is stopped
        for hook in self.hooks:
            try:
                hook.ended(lease)
            except Exception:
                log.exception("%s failed after the end of lease %s", hook.name, lease.id)
        self.on_change()
        return saved

    def _pump_held(self) -> None:
        """The pump after an end: its grants join the held end in one transaction. A plain
        callback, not a task: it runs even when the loop is cancelling tasks, so held
        writes always reach the writer."""
        try:
            self._grant_now()
        finally:
            self.store.release_held()

    def _refused_by_hooks(self, lease: Lease) -> str:
        """Run the hooks a grant needs before its holder hears of it (brokerd/leasing/hooks.py);
        the first refusal ends the lease and is returned, "" when all agree."""
        for hook in self.hooks:
            try:
                hook.granted(lease)
            except Exception as exc:
                why = f"{hook.name}: {exc}"
                log.error("grant %s refused by %s", lease.id, why)
                if lease.active:
                    self._end(lease.id, LOST, why)
                return why
        return ""

    @staticmethod
    async def _logged(saved: asyncio.Future[None], what: str = "the end of a lease") -> None:
        """Await a commit nobody waits for; a failure is logged, naming `what` was lost."""
        try:
            await saved
        except Exception as exc:
            log.error("could not record %s: %s", what, exc)

    def _forget_if_idle(self, process: ProcessId) -> None:
        """Stop watching a process that holds nothing and waits for nothing."""
        if self._watcher is not None and not self.manager.involves(process):
            self._watcher.release(process)

    def process_alive(self, process: ProcessId) -> bool | None:
        """Whether a process the broker watches still runs; None when it watches it not."""
        return self._watcher.alive(process) if self._watcher is not None else None

    def _process_exited(self, process: ProcessId) -> None:
        ended, dropped = self.manager.process_exited(process)
        for request in dropped:
            log_event("dequeue", f"pid {process.pid} left the queue (exited)", user=request.holder.user,
                      pid=process.pid, request_id=request.id)
            self.waiting.close(request.id, QueuedUpdate(0, 0, "holder exited", ()))
            self.records.drop(request.id)
            self._unrecord(request.id)
        for lease in ended:
            self._spawn(self._logged(self._record_end(lease)))
        if dropped:
            self.waiting.announce(self.manager)
            self._spawn(self._pump())

    # -- queries: plain data for the servicer, each behind its permission -------------

    @property
    def ttl_s(self) -> float:
        """How long a lease lives without a heartbeat."""
        return self.manager.ttl_s

    def device(self, uuid: str) -> Device | None:
        return self.manager.devices.get(uuid)

    def may_see_status(self, identity: Identity) -> None:
        """Raises unless `identity` may see the status (the same picture for everyone)."""
        self.permissions.require(Action.STATUS, identity)

    def status(self, identity: Identity) -> StatusView:
        """Every device with its holder, the queue, GPU processes without a lease, probes."""
        self.permissions.require(Action.STATUS, identity)
        return StatusView(device_views(self.manager), tuple(self.manager.queue), self.occupancy.unleased,
                          self.snapshot.verdicts, self.snapshot.simulated, self.usage_views())

    def leases(self, identity: Identity, *, everyone: bool = False, include_ended: bool = False) -> list[Lease]:
        """The caller's leases, or everyone's (admins only), oldest grant first."""
        self.permissions.require(Action.LIST_ALL if everyone else Action.LIST_OWN, identity)
        return leases_of(self.manager, None if everyone else identity.uid, include_ended=include_ended)

    def get(self, identity: Identity, lease_id: str) -> Lease:
        """One lease, active or recently ended."""
        lease = self.manager.get(lease_id)
        self.permissions.require(Action.GET, identity, lease)
        return lease

    def check(self, identity: Identity, requirement: Requirement) -> CheckView:
        """What `requirement` would get on this host, device by device, granting nothing."""
        self.permissions.require(Action.CHECK, identity)
        views = device_views(self.manager)
        return CheckView(evaluate(requirement, [v.device for v in views]), views)

    async def report(self, identity: Identity, since: float, until: float, by: str) -> Report:
        """Usage over a period (brokerd/state/accounting.py); other users' rows only for admins."""
        self.permissions.require(Action.REPORT, identity)
        if self.accounting is None:
            raise Internal("this broker keeps no accounting")
        others = self.permissions.allows(Action.REPORT_OTHERS, identity)
        return await self.accounting.areport(since, until, by, identity.uid, others)

    def summary(self) -> str:
        return summary(self.manager)

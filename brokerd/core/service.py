"""BrokerService: what the broker offers its clients, one method per operation, for the
edge (brokerd/edge/servicer.py) to translate. No gRPC here.

It is the core's composition root: each part is an object given what it uses, and the
service only wires them and checks who may do what (brokerd/core/permissions.py, asked
here and only here) before handing an operation to the part that does it:
    Acquisition   asking for devices (brokerd/core/acquiring.py)
    DurableQueue  waiting, on disk, across restarts (brokerd/core/queueing.py)
    Ledger        grants and ends, durable before anyone hears (brokerd/core/ledger.py)
    Governance    limits, time limits, early ends, idle reclaim (brokerd/core/governing.py)
    Expiry        leases ending at their deadlines (brokerd/core/timers.py)
    Inventory     each probe adopted (brokerd/core/inventory.py)
    ContainerHolds  leases applied to containers (brokerd/core/container_holds.py)
    ShareBudgets  memory shares held to their budget (brokerd/core/budgets.py)
Add-ons plug in through `add_hook`, `use_allocator`, `use_reporter` and `use_containers`
(brokerd/core/plugins.py) and follow changes through `changes`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from brokerd.base.clock import wall
from brokerd.base.process import Holder, Identity, ProcessId
from brokerd.config.loader import Config
from brokerd.contract import Requirement, evaluate
from brokerd.core.acquiring import Acquisition
from brokerd.core.budgets import ShareBudgets
from brokerd.core.changes import ChangeFeed
from brokerd.core.clock_steps import FollowedSteps
from brokerd.core.container_holds import ContainerHolds
from brokerd.core.drains import drain_device
from brokerd.core.governing import Governance
from brokerd.core.inventory import BusyHolder, Inventory
from brokerd.core.ledger import Ledger
from brokerd.core.liveness import ProcessWatcher
from brokerd.core.permissions import Action, Permissions
from brokerd.core.plugins import Allocator, ContainerKeeper, Reporter
from brokerd.core.queueing import DurableQueue, Rebuild
from brokerd.core.restoring import restore_leases
from brokerd.core.tasks import Tasks
from brokerd.core.timers import Expiry
from brokerd.core.users import UserDirectory
from brokerd.core.views import CheckView, DeviceView, StatusView, UsageView, device_view, device_views, leases_of
from brokerd.core.views import summary as summary_line
from brokerd.core.waiting import QueuedUpdate, WaitingRoom
from brokerd.devices.model import Device, Snapshot
from brokerd.devices.occupancy import Occupancy
from brokerd.leasing.errors import Internal, LeaseError
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Lease
from brokerd.state.queue_record import WaitRecord, WaitRecords
from brokerd.state.report import Report
from brokerd.state.store import LeaseStore
from vaccel_common.text import printable


class BrokerService:
    def __init__(
        self,
        config: Config,
        store: LeaseStore,
        snapshot: Snapshot,
        *,
        refresh: Callable[[], Snapshot] | None = None,
        clock: Callable[[], float] | None = None,  # None: the wall clock, its steps followed
    ) -> None:
        self._config, self.store = config, store
        self.manager = LeaseManager(snapshot.devices, ttl_s=config.heartbeat_ttl_s,
                                    max_duration_s=config.max_lease_duration_s, clock=clock or wall,
                                    steps=None if clock else FollowedSteps(store, lambda: self.manager.leases.values()))
        # Both read the config at each use: a reload changes the admin group.
        self.users = UserDirectory(lambda: self._config.admin_gid())
        self.permissions = Permissions(self.users.is_admin, lambda: self._config.admin_group)
        self.tasks = Tasks()
        self.changes = ChangeFeed()
        self.hooks: list[LeaseHook] = []  # gating, accounting, metrics, Slurm: add_hook
        self._allocator: Allocator | None = None
        self._reporter: Reporter | None = None
        self._keeper: ContainerKeeper | None = None
        self.waiting = WaitingRoom()
        self.records = WaitRecords()
        self.watcher = ProcessWatcher(self._process_exited)
        current = self._current_config
        # The parts call each other through these late-bound callables, so that none of
        # them knows another's class beyond what it is given.
        self.expiry = Expiry(self.manager, tasks=self.tasks, record_end=lambda lease: self.ledger.record_end(lease),
                             pump_soon=lambda: self.ledger.pump_soon())
        self.ledger = Ledger(self.manager, store, tasks=self.tasks, changes=self.changes, waiting=self.waiting,
                             records=self.records, watcher=self.watcher, hooks=self.hooks,
                             deadline_moved=self.expiry.expire_by, on_its_devices=lambda x: self.inventory.of_lease(x))
        self.governance = Governance(self.manager, store, config=current, users=self.users, tasks=self.tasks,
                                     changes=self.changes, deadline_moved=self.expiry.expire_by)
        self.queue = DurableQueue(self.manager, store, config=current, ledger=self.ledger,
                                  governance=self.governance, waiting=self.waiting, records=self.records,
                                  watcher=self.watcher, tasks=self.tasks, changes=self.changes)
        self.acquisition = Acquisition(self.manager, store, config=current, ledger=self.ledger, queue=self.queue,
                                       governance=self.governance, records=self.records, tasks=self.tasks,
                                       allocator=lambda: self._allocator)
        self.inventory = Inventory(self.manager, snapshot, config=current, tasks=self.tasks, changes=self.changes,
                                   record_end=self.ledger.record_end, pump_soon=self.ledger.pump_soon,
                                   after_probe=self._after_probe, refresh=refresh)
        self.inventory.share_devices()
        self.budgets = ShareBudgets(self.manager, config=current, snapshot=lambda: self.inventory.snapshot,
                                    occupancy=lambda: self.inventory.occupancy,
                                    note_ending=self.governance.note_ending)
        self.holds = ContainerHolds(self.manager, store, watcher=self.watcher, changes=self.changes,
                                    keeper=lambda: self._keeper, forget_if_idle=self.ledger.forget_if_idle)

    def _after_probe(self) -> None:
        """What each adopted probe is also for: idle reclaim, and shares held to their budget."""
        self.governance.reclaim_idle()
        self.budgets.check()

    def _current_config(self) -> Config:
        return self._config

    # -- plugging in -------------------------------------------------------------------

    def add_hook(self, hook: LeaseHook) -> None:
        """Follow every lease from now on (hooks run in the order they were added)."""
        self.hooks.append(hook)

    def use_allocator(self, allocator: Allocator) -> None:
        """Let `allocator` decide every grant from now on (brokerd/core/plugins.py)."""
        self._allocator = allocator

    def use_reporter(self, reporter: Reporter) -> None:
        """Answer usage reports from `reporter` (the accounting)."""
        self._reporter = reporter

    def use_containers(self, keeper: ContainerKeeper) -> None:
        """Let `keeper` confirm the containers leases are applied to, and who runs inside them."""
        self._keeper = keeper

    # -- lifecycle ---------------------------------------------------------------------

    def restore(self, active: list[Lease], ended: list[Lease], drained: dict[str, str] | None = None) -> None:
        """Put back what the store held. Must run inside the loop (it opens pidfds).
        Holders that died while the daemon was down are reclaimed at once."""
        restore_leases(self.manager, active, ended, drained or {}, watcher=self.watcher, holds=self.holds,
                       tasks=self.tasks, record_end=self.ledger.record_end)
        # Leases on devices that vanished while the daemon was down end now; devices used
        # without a lease are held back.
        self.inventory.adopt(self.inventory.snapshot)
        for hook in self.hooks:
            hook.restored(list(self.manager.leases.values()))

    def restore_queue(self, records: list[WaitRecord], rebuild: Rebuild) -> None:
        """Put back the recorded queue, in order, after restore()."""
        self.queue.restore(records, rebuild)

    def start_timers(self) -> None:
        """Start lease expiry and, if configured, periodic re-probing."""
        self.expiry.start()
        self.inventory.start()

    def reconfigure(self, config: Config) -> None:
        """Adopt a reloaded configuration; leases and the queue stay as they are."""
        self._config = config
        self.manager.ttl_s = config.heartbeat_ttl_s
        self.manager.max_duration_s = config.max_lease_duration_s
        self.expiry.wake()  # a shorter TTL or maximum duration ends leases sooner
        self.governance.adopt(config)
        self.inventory.share_devices()  # [sharing] devices may have changed
        # Limits changed: requests they held back may start, queue lines change.
        for request in self.manager.queue:
            request.limits = self.governance.limits_for(request.holder).user_limits()
        self.store.fsync_all = config.durability == "power"
        self.ledger.pump_soon()

    def shutting_down(self) -> None:
        """From now on a stream that closes is cut by the shutdown, not a client leaving:
        its request keeps its place on disk."""
        self.tasks.stopping = True

    async def close(self) -> None:
        """Stop the timers and every pidfd watch; the state stays on disk."""
        await self.tasks.close()
        self.watcher.close()

    # -- asking for devices ------------------------------------------------------------

    def _admit(self, identity: Identity, command: str) -> Holder:
        """Who asks, allowed to ask, and watched from now on (its exit ends what it gets)."""
        self.permissions.require(Action.ACQUIRE, identity)
        holder = self.users.holder(identity, command)
        if not self.watcher.watch(holder.process):
            raise LeaseError(f"process {holder.pid} exited before its request was handled")
        return holder

    def acquire(self, identity: Identity, requirement: Requirement, *, wait: bool, max_wait_s: float | None,
                command: str = "", **asked: Any) -> AsyncIterator[QueuedUpdate | Lease]:
        """QueuedUpdate while waiting, then the granted Lease (durable); see Acquisition."""
        return self._acquire(identity, requirement, wait=wait, max_wait_s=max_wait_s, command=command, **asked)

    async def _acquire(self, identity: Identity, requirement: Requirement, *, command: str,
                       **asked: Any) -> AsyncIterator[QueuedUpdate | Lease]:
        steps = self.acquisition.acquire(identity, self._admit(identity, command), requirement, **asked)
        try:
            async for item in steps:
                yield item
        finally:
            await steps.aclose()

    async def acquire_now(self, identity: Identity, requirement: Requirement, *, command: str = "",
                          **asked: Any) -> Lease:
        """The unary fast path: the Lease (durable) or Busy; see Acquisition."""
        return await self.acquisition.acquire_now(identity, self._admit(identity, command), requirement, **asked)

    # -- lease operations --------------------------------------------------------------

    async def heartbeat(self, identity: Identity, lease_id: str) -> Lease:
        """The holder is still at work: the lease's TTL starts again."""
        self.permissions.require(Action.HEARTBEAT, identity, self.manager.active(lease_id))
        return self.manager.heartbeat(lease_id)

    async def join(self, identity: Identity, lease_id: str) -> Lease:
        """The caller's process becomes a member of the lease (its end is watched, and it
        is recorded so a restart keeps it); from inside the lease's container, whatever its uid."""
        lease = self.manager.active(lease_id)
        inside = not self.permissions.allows(Action.JOIN, identity, lease) and await self.holds.runs_inside(
            identity, lease)
        self.permissions.require(Action.JOIN, identity, lease, inside=inside)
        lease = self.manager.join(lease_id, identity.process)
        if identity.process in lease.members and self.watcher.watch(identity.process):
            await self.store.save_members(lease)
        return lease

    async def release(self, identity: Identity, lease_id: str, reason: str = "", grace_s: float = 0.0) -> Lease:
        """End a lease: the holder's user releases it, an admin revokes it. With a grace,
        the holder is told now (with the reason) and the lease ends when the grace is over."""
        self.permissions.require(Action.RELEASE, identity, self.manager.active(lease_id))
        if grace_s > 0:
            return await self.governance.end_after_grace(identity, lease_id, printable(reason), grace_s)
        said = printable(reason)
        if identity.uid != self.manager.active(lease_id).holder.uid:  # the admin by name, as with a grace
            said = f"revoked by {self.users.name(identity.uid)}{': ' + said if said else ''}"
        lease = self.manager.release(lease_id, identity.uid, said)
        try:
            await self.ledger.record_end(lease)
        except Exception as exc:
            raise Internal(f"the broker could not record the release durably: {exc}") from exc
        return lease

    async def attach_container(self, identity: Identity, lease_id: str, container: str, init_pid: int = 0,
                               **how: Any) -> Lease:
        """Apply the caller's lease to the container it started for it; `how`: ContainerHolds.attach's
        keywords (held, warn_signal, shown, starting)."""
        self.permissions.require(Action.ATTACH, identity, self.manager.active(lease_id))
        return await self.holds.attach(identity, lease_id, container, init_pid, **how)

    async def drain(self, identity: Identity, device: str, reason: str, undo: bool) -> DeviceView:
        """Admins take a device out of the pool (by uuid or index) or put it back."""
        self.permissions.require(Action.DRAIN, identity)
        target = await drain_device(self.manager, self.store, device, reason, undo=undo,
                                    user=self.users.name(identity.uid), pump_soon=self.ledger.pump_soon,
                                    changed=self.changes.changed)
        return device_view(self.manager, target)

    def _process_exited(self, process: ProcessId) -> None:
        """The kernel says `process` is gone: its leases end, its waiting requests leave."""
        ended, dropped = self.manager.process_exited(process)
        self.queue.requests_dropped(process, dropped)
        for lease in ended:
            self.tasks.keep(self.ledger.record_end(lease))

    # -- for add-ons (brokerd/core/plugins.py) -----------------------------------------

    def end_lease(self, lease_id: str, state: str, reason: str) -> None:
        """End a lease from outside the client's path (an allocator saw its allocation
        end); nobody waits for the commit. One that has ended already stays as it ended."""
        self.ledger.end(lease_id, state, reason)

    async def adopt_grant(self, lease: Lease) -> Lease:
        """Make a grant an allocator made (restored into the manager) durable and real,
        as any grant: on disk, the hooks, then its holder hears."""
        await self.ledger.persist_grant(lease)
        return lease

    def time_limit_for(self, holder: Holder, asked_s: float) -> float:
        """The time limit a request of `holder` gets (the policy's default and ceiling)."""
        return self.governance.time_limit(self.governance.limits_for(holder), asked_s)

    def forget_if_idle(self, process: ProcessId) -> None:
        """Stop watching a process that holds and waits for nothing."""
        self.ledger.forget_if_idle(process)

    @property
    def stopping(self) -> bool:
        return self.tasks.stopping

    # -- queries: plain data for the edge, each behind its permission -----------------

    @property
    def config(self) -> Config:
        return self._config

    @property
    def snapshot(self) -> Snapshot:
        return self.inventory.snapshot

    @property
    def occupancy(self) -> Occupancy:
        return self.inventory.occupancy

    @property
    def allocator(self) -> Allocator | None:
        return self._allocator

    @property
    def keeps_accounting(self) -> bool:
        return self._reporter is not None

    @property
    def ttl_s(self) -> float:
        """How long a lease lives without a heartbeat."""
        return self.manager.ttl_s

    def device(self, uuid: str) -> Device | None:
        return self.manager.devices.get(uuid)

    def process_alive(self, process: ProcessId) -> bool | None:
        """Whether a process the broker watches still runs; None when it watches it not."""
        return self.watcher.alive(process)

    def outside_job(self, lease_id: str) -> int:
        """The allocator's id of the allocation behind a lease (0: none, or no allocator)."""
        return self._allocator.job_id(lease_id) if self._allocator is not None else 0

    def may_see_status(self, identity: Identity) -> None:
        """Raises unless `identity` may see the status (the same picture for everyone)."""
        self.permissions.require(Action.STATUS, identity)

    def status(self, identity: Identity) -> StatusView:
        """Every device with its holder, the queue, GPU processes without a lease, probes;
        and use against the limits: everyone's for those who may see other users' usage
        (as in a report), else the caller's own (device-hours are history, not a holder)."""
        self.permissions.require(Action.STATUS, identity)
        snapshot = self.inventory.snapshot
        only = self.usage_seen_by(identity)
        usage = tuple(use for use in self.governance.usage_views() if only is None or use.uid == only)
        return StatusView(device_views(self.manager, self.budgets.used()), tuple(self.manager.queue),
                          self.inventory.occupancy.unleased, snapshot.verdicts, snapshot.simulated, usage,
                          self._allocator.outside_status() if self._allocator is not None else None)

    def hold_back(self, by: str, devices: dict[str, str], holders: dict[str, BusyHolder] | None = None) -> None:
        """An add-on's devices that must not be granted now (uuid -> why, and who holds it
        when a process does), replacing what `by` held back before (core/inventory.py)."""
        self.inventory.hold_back(by, devices, holders or {})

    def usage_seen_by(self, identity: Identity) -> int | None:
        """Whose use against the limits `identity` sees in the status: everyone's (None) where
        they may see other users' rows in a report, else only their own (their uid)."""
        if self._config.accounting_per_user_report == "everyone" or \
                self.permissions.allows(Action.REPORT_OTHERS, identity):
            return None
        return identity.uid

    def usage_views(self) -> tuple[UsageView, ...]:
        """Each user holding or waiting for devices, against their limits."""
        return self.governance.usage_views()

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

    def report(self, identity: Identity, since: float, until: float, by: str) -> AsyncIterator[Report]:
        """Usage over a period (accounting) in pages (by lease: many); others' rows only for admins."""
        self.permissions.require(Action.REPORT, identity)
        if self._reporter is None:
            raise Internal("this broker keeps no accounting")
        others = self.permissions.allows(Action.REPORT_OTHERS, identity)
        return self._reporter.areport_pages(since, until, by, identity.uid, others)

    def summary(self) -> str:
        return summary_line(self.manager)


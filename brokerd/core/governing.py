"""The policy in force: adopting the [policy] section, the limits and time limit each
request gets, an early end announced to the holder (an admin's revoke with grace, an idle
reclaim), and each user's use against their limits. The rules themselves live in
brokerd/config/policy.py, brokerd/leasing/queue_rules.py and brokerd/leasing/fairshare.py;
this is where the broker applies them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from brokerd.base.clock import wall
from brokerd.base.groups import BOOK
from brokerd.base.journal import log_event
from brokerd.base.process import Holder, Identity
from brokerd.config.loader import Config
from brokerd.config.policy import EffectiveLimits
from brokerd.core.changes import ChangeFeed
from brokerd.core.idle import IdleWatch
from brokerd.core.tasks import Tasks
from brokerd.core.users import UserDirectory
from brokerd.core.views import UsageView
from brokerd.leasing.errors import Internal, Unsatisfiable
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import IDLE, RELEASED, REVOKED, Lease
from brokerd.state.store import LeaseStore
from vaccel_common.units import format_duration


class Governance:
    def __init__(self, manager: LeaseManager, store: LeaseStore, *, config: Callable[[], Config],
                 users: UserDirectory, tasks: Tasks, changes: ChangeFeed,
                 deadline_moved: Callable[[float], None]) -> None:
        self.manager = manager
        self.store = store
        self._config = config  # read at each use: a reload replaces it
        self.users = users
        self.tasks = tasks
        self.changes = changes
        self._deadline_moved = deadline_moved
        self.idle_watch = IdleWatch()
        self.adopt(config())

    def adopt(self, config: Config) -> None:
        """Take up the [policy] section: fair share's half-life and window, aging; and look
        the users' groups up afresh (the admin may have changed them before the reload)."""
        BOOK.forget()
        self.manager.usage.half_life_s = config.policy.fair_half_life_s
        # The longest window any table asks for: use older than that is forgotten.
        windows = [config.policy.default.window_s or 0.0, *(g.window_s or 0.0 for _, g in config.policy.groups)]
        self.manager.usage.window_s = max(windows) or self.manager.usage.window_s
        self.manager.aging_s = config.policy.aging_s
        self.manager.lending.enabled = config.policy.lend_idle
        self.manager.lending.notice_s = config.policy.lend_notice_s

    def limits_for(self, holder: Holder) -> EffectiveLimits:
        """The limits that apply to the holder's user."""
        return self._config().policy.for_user(holder.user)

    def time_limit(self, limits: EffectiveLimits, asked_s: float) -> float:
        """The time limit a request gets: what it asked for, else the policy's default,
        never over the ceiling (the policy's time_max and leases.max_duration)."""
        config = self._config()
        ceiling = limits.time_max_s or 0.0
        if config.max_lease_duration_s:
            ceiling = min(ceiling, config.max_lease_duration_s) if ceiling else config.max_lease_duration_s
        if asked_s and ceiling and asked_s > ceiling:
            most = format_duration(ceiling)
            raise Unsatisfiable(f"a time limit of {format_duration(asked_s)} is over the ceiling time_max={most} "
                                f"for {limits.name}; ask for --time {most} or less")
        default = limits.time_default_s or 0.0
        return asked_s or (min(default, ceiling) if ceiling else default)

    async def end_after_grace(self, identity: Identity, lease_id: str, reason: str, grace_s: float) -> Lease:
        """The holder is told now (with the reason) and the lease ends when the grace is over."""
        lease = self.manager.active(lease_id)
        by = self.users.name(identity.uid)
        own = identity.uid == lease.holder.uid
        verb = "released by its holder" if own else f"revoked by {by}"
        at = wall() + grace_s
        notice = f"{verb}{': ' + reason if reason else ''} (ends at {time.strftime('%H:%M:%S', time.localtime(at))})"
        lease = self.manager.end_early(lease_id, at, RELEASED if own else REVOKED, notice)
        try:
            await self.store.save_ending(lease)
        except Exception as exc:
            raise Internal(f"the broker could not record the notice durably: {exc}") from exc
        log_event("notice", f"lease {lease.id} of {lease.holder.user}: {lease.notice}", lease_id=lease.id,
                  user=lease.holder.user, device_uuids=lease.devices)
        self._deadline_moved(self.manager.deadline(lease))
        self.changes.changed()
        return lease

    def usage_views(self) -> tuple[UsageView, ...]:
        """Each user holding or waiting for devices, against their limits, by name."""
        manager, now, policy = self.manager, wall(), self._config().policy
        # One pass over the leases and one over the queue, not one of each per user: with
        # 500 waiting that was 40% of a Status build (built at every change of the queue).
        own = manager.holdings.leases_by_user()
        # as their latest lease names them, else their latest request
        people: dict[int, Holder] = {uid: leases[-1].holder for uid, leases in own.items()}
        waiting: dict[int, int] = {}
        queued: dict[int, Holder] = {}
        for request in manager.queue:
            waiting[request.holder.uid] = waiting.get(request.holder.uid, 0) + 1
            queued[request.holder.uid] = request.holder
        for uid, holder in queued.items():
            people.setdefault(uid, holder)
        views = []
        for uid, holder in people.items():
            limits = policy.for_user(holder.user)
            leases = own.get(uid, [])  # the usage book counts only this uid's leases anyway
            views.append(UsageView(
                user=holder.user or str(uid), uid=uid, policy=limits.name,
                devices_held=sum(len(lease.devices) for lease in leases),
                max_devices=limits.max_devices,
                waiting=waiting.get(uid, 0), max_waiting=limits.max_waiting,
                device_hours=manager.usage.in_window(uid, now, limits.window_s, leases),
                max_device_hours=limits.max_device_hours, window_s=limits.window_s,
                fair_usage=manager.usage.recent(uid, now, leases),
            ))
        return tuple(sorted(views, key=lambda v: v.user))

    # -- idle reclaim ---------------------------------------------------------------------

    def reclaim_idle(self) -> None:
        """At each probe refresh: warn leases idle for `idle_reclaim` while others wait for
        their devices (they end as `idle` after `idle_warning`), call the warning off for
        those that compute again. Off when idle_reclaim is 0."""
        policy = self._config().policy
        if not policy.idle_reclaim_s:
            return
        manager, now = self.manager, wall()
        idle_for = self.idle_watch.observe(manager.leases.values(), manager.devices, now)
        wanted = {u for r in manager.queue for u in r.evaluation.eligible}
        for lease_id, idle_s in idle_for.items():
            lease = manager.leases[lease_id]
            warned = lease.ending_state == IDLE
            if warned and idle_s < policy.idle_reclaim_s:
                self.note_ending(manager.call_off_ending(lease_id), "it computes again: idle reclaim called off")
            elif not lease.notice and idle_s >= policy.idle_reclaim_s and wanted & set(lease.devices):
                at = now + policy.idle_warning_s
                notice = (f"idle for {format_duration(idle_s)} while others wait: reclaimed at "
                          f"{time.strftime('%H:%M:%S', time.localtime(at))} unless it computes")
                self.note_ending(manager.end_early(lease_id, at, IDLE, notice), notice)

    def note_ending(self, lease: Lease, what: str) -> None:
        """An early end announced or called off (idle reclaim, a share over its budget): on
        disk, in the journal, and the expiry timer and the watchers told."""
        self.tasks.keep(self.store.save_ending(lease), "a lease's notice")
        log_event("notice", f"lease {lease.id} of {lease.holder.user}: {what}", lease_id=lease.id,
                  user=lease.holder.user, device_uuids=lease.devices)
        self._deadline_moved(self.manager.deadline(lease))
        self.changes.changed()

"""`[slurm] mode = "delegate"`: on a node Slurm also manages, Slurm is the only allocator.

Every acquire becomes `salloc --no-shell` on this node as the requesting user; while the
job is pending the waiter hears Slurm's reason and its place among the pending jobs that
want the node; once Slurm grants it, the GRES indices it assigned are this broker's device
indices (gres.conf lists the device files in index order, as the fake GPUs' minors and a
real node's /dev/<gpu>N numbering have them). The contract is checked against exactly
those devices (a refusal cancels the job before anything computes), then the grant is an
ordinary vaccel lease (`manager.restore` puts it on those devices): the store, the hooks,
heartbeats, the pidfd exit watch and the end states are the usual ones.

This object is also a LeaseHook: whenever such a lease ends (release, holder exit even by
SIGKILL, TTL, time limit, revoke) `ended` cancels its Slurm job at once; `restored`
re-adopts, after a restart, the jobs whose leases came back and cancels the others. A
poller (`scontrol show job` about once a second) keeps the picture: the pending queue, the
batch jobs Slurm runs on the node's GPUs (shown in `vaccel status` as `slurm job N (user)`),
and jobs that ended on Slurm's side, whose leases end too.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Coroutine, Hashable, Sequence
from typing import Any

from brokerd.addons.slurm.commands import Allocation, SlurmCommands
from brokerd.addons.slurm.jobs import HOLDING, PENDING
from brokerd.addons.slurm.picture import SlurmPicture, Waiter
from brokerd.addons.slurm.table import JobTable
from brokerd.base.journal import log_event
from brokerd.base.process import Holder
from brokerd.config.loader import Config
from brokerd.contract import Requirement, evaluate
from brokerd.core.acquiring import MAX_QUEUED_PER_USER
from brokerd.core.ledger import LEFT
from brokerd.core.service import BrokerService
from brokerd.core.views import OutsideStatus, device_views
from brokerd.core.waiting import QueuedUpdate
from brokerd.leasing.errors import Busy, DeadlineExceeded, Internal, LeaseError, Unsatisfiable
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.model import LOST, RELEASED, Lease, LeaseTerms
from vaccel_common.units import format_duration

log = logging.getLogger("vaccel.brokerd")

POLL_INTERVAL_S = 1.0


class SlurmDelegate(LeaseHook):
    name = "slurm"
    mode = "delegate"

    def __init__(self, config: Config, service: BrokerService) -> None:
        self.service = service
        self.node = config.slurm_node or socket.gethostname().split(".")[0]
        self.commands = SlurmCommands(self.node, config.slurm_partition, config.slurm_gres)
        self.table = JobTable(config.state_dir)
        self.job_of = self.table.load()  # lease id -> job id: every job vaccel made that may still run
        self.ended_jobs: dict[str, int] = {}  # the same, of recently ended leases (`vaccel leases`)
        self.picture = SlurmPicture(self.node)  # the last poll: pending jobs, batch holds, our waiters
        self._tasks: set[asyncio.Task[Any]] = set()
        self._asking: dict[int, int] = {}  # uid -> requests with Slurm now (pending or being granted)
        self._poller: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever(), name="slurm poll")

    async def close(self) -> None:
        for task in [t for t in (self._poller, *self._tasks) if t is not None]:
            task.cancel()
        await asyncio.gather(*[t for t in (self._poller, *self._tasks) if t is not None], return_exceptions=True)
        self.table.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- lease hook --------------------------------------------------------------------

    def restored(self, active: Sequence[Lease]) -> None:
        live = {lease.id for lease in active}
        for lease_id, job_id in list(self.job_of.items()):
            if lease_id in live:
                log_event("slurm", f"lease {lease_id} re-adopted with slurm job {job_id}", lease_id=lease_id,
                          job=job_id)
            else:  # its holder died while we were down, or it never became a lease
                self._cancel_soon(lease_id, f"its lease {lease_id} is not live after the restart")

    def ended(self, lease: Lease) -> None:
        if lease.id in self.job_of:
            self._cancel_soon(lease.id, f"lease {lease.id} ended ({lease.state})", lease.ended_at)

    def _cancel_soon(self, lease_id: str, why: str, ended_at: float = 0.0) -> None:
        job_id = self._forget(lease_id)
        if job_id:
            self._spawn(self._cancel(lease_id, job_id, why, ended_at))

    def _forget(self, lease_id: str) -> int:
        """The lease's job leaves the live table (kept a while for `vaccel leases`)."""
        job_id = self.job_of.pop(lease_id, 0)
        if job_id:
            self.ended_jobs[lease_id] = job_id
            while len(self.ended_jobs) > 1000:
                del self.ended_jobs[next(iter(self.ended_jobs))]
        return job_id

    async def _cancel(self, lease_id: str, job_id: int, why: str, ended_at: float = 0.0) -> None:
        error = await self.commands.cancel(job_id)
        done = time.time()
        if error and "already completed" not in error and "Invalid job id" not in error:
            log_event("slurm", f"could not cancel slurm job {job_id}: {error}", lease_id=lease_id, job=job_id,
                      level=logging.ERROR)
            return  # the row stays: the next start tries again
        after = f" {(done - ended_at) * 1000:.0f} ms after the end" if ended_at else ""
        log_event("slurm", f"cancelled slurm job {job_id}{after}: {why}", lease_id=lease_id or "", job=job_id,
                  ended_at=f"{ended_at:.3f}", cancelled_at=f"{done:.3f}")
        if lease_id:
            await self.table.remove(lease_id)

    # -- acquire -----------------------------------------------------------------------

    async def acquire_now(self, holder: Holder, requirement: Requirement, **asked: Any) -> Lease:
        """The unary fast path: granted by Slurm at once, or Busy (the client then waits on
        the stream, which asks Slurm again). Asked only when the node looks free: a
        request that would wait anyway costs Slurm no job that is cancelled a second later."""
        manager = self.service.manager
        free = [u for u in manager.devices if u not in manager.owner and u not in self.picture.batch]
        if len(free) < requirement.gpus or self.picture.waiters or self.picture.pending():
            raise Busy(f"no {requirement.gpus} free GPU(s) on node {self.node} now (Slurm allocates them)")
        steps = self._obtain(holder, requirement, wait=False, max_wait_s=None, **asked)
        try:
            async for item in steps:
                if isinstance(item, Lease):
                    return item
        finally:
            await steps.aclose()
        raise Internal("the Slurm allocation ended without a grant")

    async def acquire(self, holder: Holder, requirement: Requirement, *, wait: bool, max_wait_s: float | None,
                      **asked: Any) -> AsyncIterator[QueuedUpdate | Lease]:
        """What BrokerService.acquire yields, with Slurm deciding: QueuedUpdate while the job
        is pending, then the Lease (durable) on the devices Slurm assigned. A waiter that
        leaves once granted hands the lease back (which cancels the job)."""
        steps = self._obtain(holder, requirement, wait=wait, max_wait_s=max_wait_s, **asked)
        try:
            async for item in steps:
                try:
                    yield item
                except GeneratorExit:
                    if isinstance(item, Lease) and not self.service.stopping:
                        self.service.end_lease(item.id, RELEASED, LEFT)
                    raise
        finally:
            await steps.aclose()

    async def _obtain(self, holder: Holder, requirement: Requirement, **asked: Any,
                      ) -> AsyncIterator[QueuedUpdate | Lease]:
        """`_allocate`, within the user's bound: each request is a salloc process the daemon
        starts as root, so one user's flood of requests is refused, as the broker's own
        queue refuses it (limit max_waiting, at most MAX_QUEUED_PER_USER)."""
        limits = self.service.config.policy.for_user(holder.user, holder.gid)
        cap = min(limits.max_waiting or MAX_QUEUED_PER_USER, MAX_QUEUED_PER_USER)
        asking = self._asking.get(holder.uid, 0)
        if asking >= cap:
            self.service.forget_if_idle(holder.process)
            raise Busy(f"limit max_waiting={cap} for {limits.name}: {holder.user} already has {asking} "
                       "requests with Slurm; let some finish or cancel them")
        self._asking[holder.uid] = asking + 1
        steps = self._allocate(holder, requirement, **asked)
        try:
            async for item in steps:
                yield item
        finally:
            await steps.aclose()
            left = self._asking[holder.uid] - 1
            if left:
                self._asking[holder.uid] = left
            else:
                del self._asking[holder.uid]

    async def _allocate(
        self, holder: Holder, requirement: Requirement, *, wait: bool, max_wait_s: float | None,
        accelerator_config_yaml: str = "", cache_key: Hashable | None = None, time_limit_s: float = 0.0,
        devices: tuple[str, ...] = (), reservation: bool = False, **_: Any,
    ) -> AsyncIterator[QueuedUpdate | Lease]:
        service = self.service
        requested_at = time.time()
        allocation: Allocation | None = None
        lease_id = f"l-{secrets.token_hex(6)}"
        try:
            if devices:
                raise Unsatisfiable("naming devices (--device) is not possible where Slurm allocates this "
                                    "node's GPUs ([slurm] mode = \"delegate\"): ask for a number of GPUs")
            time_limit = service.time_limit_for(holder, time_limit_s)
            evaluation = evaluate(requirement, list(service.manager.devices.values()))
            if not evaluation.satisfiable:
                message = evaluation.reason or "no device on this host satisfies the request"
                raise Unsatisfiable(message, evaluation)
            allocation = await self.commands.allocate(holder, requirement.gpus, time_limit, holder.command,
                                                      immediate=not wait)
            self._spawn(allocation.follow())
            deadline = requested_at + max_wait_s if max_wait_s else 0.0
            async for update in self._pending(allocation, holder, requirement, time_limit, lease_id, deadline):
                yield update
            lease = await self._grant(allocation.job_id, holder, requirement, evaluation, lease_id, requested_at,
                                      time_limit, LeaseTerms(service.config.allocator_config,
                                                             service.config.memory_cap_mib, accelerator_config_yaml),
                                      reservation)
        except BaseException as exc:
            if allocation is not None:
                allocation.stop()
            job_id = self.job_of.get(lease_id) or (allocation.job_id if allocation else 0)
            self.picture.waiters.pop(job_id, None)
            if job_id and lease_id not in service.manager.leases:  # never granted: its job goes
                self.job_of[lease_id] = job_id
                self._cancel_soon(lease_id, "its request ended before a grant")
            if isinstance(exc, LeaseError):
                log_event("refuse", f"refused {requirement.gpus} device(s) to {holder.user}: {exc}",
                          user=holder.user, pid=holder.pid, level=logging.INFO)
            service.forget_if_idle(holder.process)
            raise
        yield lease

    async def _pending(self, allocation: Allocation, holder: Holder, requirement: Requirement, time_limit: float,
                       lease_id: str, deadline: float) -> AsyncIterator[QueuedUpdate]:
        """Until salloc has its grant: record the job as soon as Slurm names it, and tell the
        waiter its place at each poll (and at once when Slurm first says it waits)."""
        last: tuple[int, int, str] = (0, 0, "")
        while True:
            if allocation.job_id and lease_id not in self.job_of:
                self.job_of[lease_id] = allocation.job_id
                await self.table.add(lease_id, allocation.job_id)
            if allocation.done:
                if allocation.granted:
                    return
                raise self._refusal(allocation)
            if allocation.job_id and not allocation.granted:
                job_id = allocation.job_id
                self.picture.waiters.setdefault(job_id, Waiter(job_id, holder, requirement.gpus, time.time(),
                                                               time_limit))
                update = self._queued_update(job_id)
                if (update.position, update.total, update.message) != last:
                    last = (update.position, update.total, update.message)
                    yield update
            if deadline and time.time() >= deadline:
                raise DeadlineExceeded(f"Slurm did not grant job {allocation.job_id} within the wait")
            allocation.changed.clear()
            polled = asyncio.ensure_future(self.picture.polled.wait())
            changed = asyncio.ensure_future(allocation.changed.wait())
            timeout = max(0.01, deadline - time.time()) if deadline else None
            try:
                await asyncio.wait({polled, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                polled.cancel()
                changed.cancel()

    def _refusal(self, allocation: Allocation) -> LeaseError:
        said = "; ".join(allocation.errors) or "salloc exited without a grant"
        never = any(words in said for words in ("configuration is not available", "Invalid", "not allowed"))
        # --immediate gave up: "nodes are busy", "Immediate execution impossible, insufficient priority"
        if allocation.immediate and not never:
            return Busy(f"Slurm cannot start it now: {said}")
        return Unsatisfiable(f"Slurm refused the allocation on node {self.node}: {said}")

    async def _grant(self, job_id: int, holder: Holder, requirement: Requirement, evaluation: Any, lease_id: str,
                     requested_at: float, time_limit: float, terms: LeaseTerms, reservation: bool) -> Lease:
        """Slurm granted `job_id`: its GRES on this node become the lease's devices, if the
        contract holds on exactly them."""
        self.picture.waiters.pop(job_id, None)
        service = self.service
        jobs = await self.commands.jobs(job_id)
        indices = jobs[0].indices_on(self.node) if jobs else ()
        by_index = {d.index: d for d in service.manager.devices.values()}
        chosen = [by_index[i] for i in indices if i in by_index]
        if len(chosen) != requirement.gpus or len(indices) != requirement.gpus:
            raise Internal(f"slurm job {job_id} holds GRES {self.commands.gres} indices {list(indices)} on "
                           f"{self.node}, which are not {requirement.gpus} of this broker's devices (gres.conf must "
                           "list the GPUs in the broker's index order)")
        unfit = [d for d in chosen if d.uuid not in evaluation.eligible]
        if unfit:
            first = unfit[0]
            why = "; ".join(line.message for line in evaluation.per_device.get(first.uuid, ()) if line.level == "ERROR")
            raise Unsatisfiable(f"Slurm gave job {job_id} gpu{first.index} ({first.name}), where the contract cannot "
                                f"be met: {why or 'not eligible'}; the allocation was cancelled before anything ran",
                                evaluation)
        now = time.time()
        limit = time_limit or service.manager.max_duration_s
        uuids = tuple(d.uuid for d in chosen)
        # Slurm is the source of truth: a device it gives again was freed on its side (the
        # job behind the lease on it ended: time limit, scancel) before our poll saw it.
        for earlier in {service.manager.owner[u] for u in uuids if u in service.manager.owner}:
            self._forget(earlier)
            self._spawn(self.table.remove(earlier))
            service.end_lease(earlier, LOST, f"Slurm gave its device to job {job_id}: its own slurm job has ended")
        service.manager.restore(Lease(
            id=lease_id, holder=holder, devices=uuids, backend=chosen[0].backend, granted_at=now,
            expires_at=now + limit if limit else 0.0, terms=terms, warnings=evaluation.warnings_for(uuids),
            simulated=any(d.simulated for d in chosen), last_heartbeat=now, requested_at=requested_at,
            reservation=reservation, time_limit_s=time_limit))
        lease = service.manager.leases[lease_id]
        await service.adopt_grant(lease)
        log_event("slurm", f"lease {lease_id} is slurm job {job_id} (GRES {list(indices)})", lease_id=lease_id,
                  job=job_id, user=holder.user)
        return lease

    # -- what Slurm says ---------------------------------------------------------------

    def job_id(self, lease_id: str) -> int:
        """The Slurm job behind a lease, 0 = none."""
        return self.job_of.get(lease_id) or self.ended_jobs.get(lease_id, 0)

    def outside_status(self) -> OutsideStatus:
        return self.picture.outside_status(self.mode)

    def version(self) -> Hashable:
        return self.picture.version()

    def _queued_update(self, job_id: int) -> QueuedUpdate:
        held = tuple(v for v in device_views(self.service.manager) if v.lease is not None)
        return self.picture.queued_update(job_id, held)

    async def _poll_forever(self) -> None:
        while True:
            started = time.time()
            if await self.picture.refresh(self.commands):
                self._take_in(started)
            self.picture.polled.set()
            self.picture.polled.clear()
            await asyncio.sleep(max(0.05, POLL_INTERVAL_S - (time.time() - started)))

    def _take_in(self, started: float) -> None:
        """Batch holds from the poll, and the end of leases whose jobs Slurm ended."""
        ours = {job: lease for lease, job in self.job_of.items()}
        changed = self.picture.take_batch(ours, {d.index: d.uuid for d in self.service.manager.devices.values()})
        state = {job.job_id: job for job in self.picture.jobs}
        for job_id, lease_id in ours.items():
            lease = self.service.manager.leases.get(lease_id)
            # Only a lease granted before this poll began can be judged by it.
            if lease is None or lease.granted_at >= started:
                continue
            job = state.get(job_id)
            if job is None or (job.state not in HOLDING and job.state != PENDING):
                how = f"{job.state.lower()} ({job.reason})" if job else "gone"
                self._forget(lease_id)
                self._spawn(self.table.remove(lease_id))
                self.service.end_lease(lease_id, LOST, f"its slurm job {job_id} ended on Slurm's side: {how}")
        if changed:
            self.service.changes.changed()

    def describe(self) -> str:
        """One line for the log at start-up."""
        limit = format_duration(POLL_INTERVAL_S)
        return f"slurm delegate on node {self.node}: Slurm allocates, polled every {limit}"

"""`[slurm] mode = "delegate"`: on a node Slurm also manages, Slurm is the only allocator.

Every acquire becomes `salloc --no-shell` on this node as the requesting user, its job
marked with a secret of the request's own; the job is the one Slurm shows with that mark
and the requester's uid (claims.py), never what salloc prints, which the user can write.
While the job is pending the waiter hears Slurm's reason and its place among the pending
jobs that want the node; once Slurm shows it running here, the GRES indices it assigned
are this broker's device indices (gres.conf lists the device files in index order, as the
fake GPUs' minors and a real node's /dev/<gpu>N numbering have them). The contract is
checked against exactly those devices (a refusal cancels the job before anything
computes), then the grant is an ordinary vaccel lease (`manager.restore` puts it on those
devices): the store, the hooks, heartbeats, the pidfd exit watch and the end states are
the usual ones.

This object is also a LeaseHook: whenever such a lease ends (release, holder exit even by
SIGKILL, TTL, time limit, revoke) `ended` cancels its Slurm job at once (ours.py);
`restored` re-adopts, after a restart, the jobs whose leases came back and cancels the
others. A poller (`squeue --json` about once a second) keeps the picture: the pending
queue, the batch jobs Slurm runs on the node's GPUs (shown in `vaccel status` as
`slurm job N (user)`), and jobs that ended on Slurm's side, whose leases end too (only on
Slurm's word about their own job).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

from brokerd.addons.slurm.claims import Claim, MarkedTwice, granted_indices
from brokerd.addons.slurm.commands import Allocation, SlurmCommands
from brokerd.addons.slurm.jobs import PENDING, STARTED, SlurmJob
from brokerd.addons.slurm.ours import OurJobs, ended_on_slurms_side
from brokerd.addons.slurm.picture import SlurmPicture, Waiter
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
        self.ours = OurJobs(config.state_dir, self.commands)  # which job is behind which lease
        self.picture = SlurmPicture(self.node)  # the last poll: pending jobs, batch holds, our waiters
        self._asking: dict[int, int] = {}  # uid -> requests with Slurm now (pending or being granted)
        self._poller: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever(), name="slurm poll")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await self.ours.close()

    # -- lease hook --------------------------------------------------------------------

    def restored(self, active: Sequence[Lease]) -> None:
        live = {lease.id for lease in active}
        for lease_id, job_id in list(self.ours.job_of.items()):
            if lease_id in live:
                log_event("slurm", f"lease {lease_id} re-adopted with slurm job {job_id}", lease_id=lease_id,
                          job=job_id)
            else:  # its holder died while we were down, or it never became a lease
                self.ours.cancel_soon(lease_id, f"its lease {lease_id} is not live after the restart")

    def ended(self, lease: Lease) -> None:
        if lease.id in self.ours.job_of:
            self.ours.cancel_soon(lease.id, f"lease {lease.id} ended ({lease.state})", lease.ended_at)

    # -- acquire -----------------------------------------------------------------------

    async def acquire_now(self, holder: Holder, requirement: Requirement, **asked: Any) -> Lease:
        """The unary fast path: granted by Slurm at once, or Busy (the client then waits on
        the stream, which asks Slurm again). Asked only when enough GPUs look free: a
        request that would wait anyway costs Slurm no job that is cancelled a second later.
        Pending jobs are no reason to refuse here: whether one keeps the free GPUs (it could
        start now and is ahead) or not (held, dependent, starting later, over its limits) is
        Slurm's answer to salloc --immediate."""
        manager = self.service.manager
        free = [u for u in manager.devices if u not in manager.owner and u not in self.picture.batch]
        if len(free) < requirement.gpus:
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
        limits = self.service.config.policy.for_user(holder.user)
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
        claim: Claim | None = None
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
            self.ours.spawn(allocation.follow())
            claim = Claim(allocation.mark, holder.uid, holder.user)
            deadline = requested_at + max_wait_s if max_wait_s else 0.0
            async for update in self._pending(allocation, claim, holder, requirement, time_limit, lease_id,
                                              deadline):
                yield update
            lease = await self._grant(claim, holder, requirement, evaluation, lease_id, requested_at, time_limit,
                                      LeaseTerms(service.config.allocator_config, service.config.memory_cap_mib,
                                                 accelerator_config_yaml), reservation)
        except BaseException as exc:
            if allocation is not None:
                allocation.stop()
            job_id = self.ours.job_of.get(lease_id, 0)
            self.picture.waiters.pop(claim.job_id if claim is not None else job_id, None)
            if job_id and lease_id not in service.manager.leases:  # never granted: its job goes
                self.ours.cancel_soon(lease_id, "its request ended before a grant")
            if isinstance(exc, MarkedTwice):
                for other in set(exc.jobs) - {job_id}:
                    self.ours.cancel_job(other, f"it carries the mark of {holder.user}'s refused request")
            elif claim is not None and not claim.job_id:
                self.ours.spawn(self._cancel_unseen(claim))
            if isinstance(exc, LeaseError):
                log_event("refuse", f"refused {requirement.gpus} device(s) to {holder.user}: {exc}",
                          user=holder.user, pid=holder.pid, level=logging.INFO)
            service.forget_if_idle(holder.process)
            raise
        finally:
            if allocation is not None:
                self.ours.spawn(allocation.finish())
        yield lease

    async def _pending(self, allocation: Allocation, claim: Claim, holder: Holder, requirement: Requirement,
                       time_limit: float, lease_id: str, deadline: float) -> AsyncIterator[QueuedUpdate]:
        """Until Slurm shows the request's job started: record the job as soon as Slurm shows
        it, and tell the waiter its place at each poll (and at once when it first waits).
        Slurm is read again whenever salloc says something; the poll reads it anyway."""
        last: tuple[int, int, str] = (0, 0, "")
        while True:
            exited = allocation.check_exit()
            if allocation.news_at > self.picture.read_at:
                await self.picture.read(self.commands, allocation.news_at)
            job = claim.find(self.picture.jobs)
            if job is not None and lease_id not in self.ours.job_of and not ended_on_slurms_side(job):
                await self.ours.record(lease_id, job.job_id)
            if job is not None and job.state in STARTED:
                return
            if exited or (job is not None and job.state != PENDING):
                raise self._refusal(allocation, job)
            if job is not None:
                self.picture.waiters.setdefault(job.job_id, Waiter(job.job_id, holder, requirement.gpus, time.time(),
                                                                   time_limit))
                update = self._queued_update(job.job_id)
                if (update.position, update.total, update.message) != last:
                    last = (update.position, update.total, update.message)
                    yield update
            if deadline and time.time() >= deadline:
                raise DeadlineExceeded(f"Slurm did not grant job {claim.job_id or '(not yet listed)'} within the wait")
            allocation.changed.clear()
            polled = asyncio.ensure_future(self.picture.polled.wait())
            changed = asyncio.ensure_future(allocation.changed.wait())
            timeout = max(0.01, deadline - time.time()) if deadline else None
            try:
                await asyncio.wait({polled, changed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                polled.cancel()
                changed.cancel()

    async def _cancel_unseen(self, claim: Claim) -> None:
        """A request that ended before Slurm showed its job: a job carrying its mark now goes
        too (salloc, stopped or killed by its user, may have left it queued)."""
        if await self.picture.read(self.commands, time.monotonic()):
            for job in self.picture.jobs:
                if job.uid == claim.uid and job.comment == claim.mark and not ended_on_slurms_side(job):
                    self.ours.cancel_job(job.job_id, "its request ended before Slurm showed it")

    def _refusal(self, allocation: Allocation, job: SlurmJob | None) -> LeaseError:
        """Why there is no grant: salloc's own words (the requester's to forge, and only theirs
        to read), Slurm's state of the job, and the job ahead that --immediate yields to."""
        said = "; ".join(allocation.errors) or (f"Slurm shows job {job.job_id} {job.state.lower()} ({job.reason})"
                                                if job is not None else "salloc exited without a grant")
        never = any(words in said for words in ("configuration is not available", "Invalid", "not allowed"))
        # --immediate gave up: "nodes are busy", "Immediate execution impossible, insufficient priority"
        if allocation.immediate and not never:
            ahead = self.picture.first_ahead(job.job_id if job is not None else 0)
            if ahead is not None and "priority" in said:
                said += (f" (slurm job {ahead.job_id} ({ahead.user}) is ahead in Slurm's queue for this node's GPUs, "
                         f"pending: {ahead.reason})")
            return Busy(f"Slurm cannot start it now: {said}")
        return Unsatisfiable(f"Slurm refused the allocation on node {self.node}: {said}")

    async def _grant(self, claim: Claim, holder: Holder, requirement: Requirement, evaluation: Any, lease_id: str,
                     requested_at: float, time_limit: float, terms: LeaseTerms, reservation: bool) -> Lease:
        """Slurm shows the request's job started: its GRES on this node become the lease's
        devices, once the job is this request's due (claims.py) and the contract holds on
        exactly them."""
        job_id = claim.job_id
        self.picture.waiters.pop(job_id, None)
        service = self.service
        by_index = {d.index: d for d in service.manager.devices.values()}
        job = claim.find(self.picture.jobs)
        if job is None:
            raise Internal(f"slurm job {job_id} left Slurm's list before its grant")
        indices = granted_indices(job, node=self.node, partition=self.commands.partition, gres=self.commands.gres,
                                  gpus=requirement.gpus, indices_here=by_index, taken=self.ours.behind_others(lease_id))
        chosen = [by_index[i] for i in indices]
        unfit = [d for d in chosen if d.uuid not in evaluation.eligible]
        if unfit:
            first = unfit[0]
            why = "; ".join(line.message for line in evaluation.per_device.get(first.uuid, ()) if line.level == "ERROR")
            raise Unsatisfiable(f"Slurm gave job {job_id} gpu{first.index} ({first.name}), where the contract cannot "
                                f"be met: {why or 'not eligible'}; the allocation was cancelled before anything ran",
                                evaluation)
        uuids = tuple(d.uuid for d in chosen)
        self._end_leases_slurm_ended(uuids, job_id)
        now = time.time()
        limit = time_limit or service.manager.max_duration_s
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

    def _end_leases_slurm_ended(self, uuids: tuple[str, ...], job_id: int) -> None:
        """A device Slurm gives again was freed on its side before our poll saw it: the lease
        on it ends, on Slurm's word that its own job ended (the same read), never on the new
        job's claim. Should Slurm still show that job holding the device, nothing is granted."""
        manager = self.service.manager
        state = {job.job_id: job for job in self.picture.jobs}
        for earlier in {manager.owner[u] for u in uuids if u in manager.owner}:
            earlier_job = self.ours.job_id(earlier)
            how = ended_on_slurms_side(state.get(earlier_job)) if earlier_job else ""
            if not how:
                raise Internal(f"Slurm shows job {job_id} on the GPUs of lease {earlier}, whose slurm job "
                               f"{earlier_job} still holds them")
            self.ours.drop(earlier)
            self.service.end_lease(earlier, LOST, f"its slurm job {earlier_job} ended on Slurm's side: {how}")

    # -- what Slurm says ---------------------------------------------------------------

    def job_id(self, lease_id: str) -> int:
        """The Slurm job behind a lease, 0 = none."""
        return self.ours.job_id(lease_id)

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
            if await self.picture.read(self.commands, time.monotonic()):
                self._take_in(started)
            self.picture.polled.set()
            self.picture.polled.clear()
            await asyncio.sleep(max(0.05, POLL_INTERVAL_S - (time.time() - started)))

    def _take_in(self, started: float) -> None:
        """Batch holds from the poll, and the end of leases whose jobs Slurm ended."""
        ours = {job: lease for lease, job in self.ours.job_of.items()}
        changed = self.picture.take_batch(ours, {d.index: d.uuid for d in self.service.manager.devices.values()})
        state = {job.job_id: job for job in self.picture.jobs}
        for job_id, lease_id in ours.items():
            lease = self.service.manager.leases.get(lease_id)
            # Only a lease granted before this poll began can be judged by it.
            if lease is None or lease.granted_at >= started:
                continue
            how = ended_on_slurms_side(state.get(job_id))
            if how:
                self.ours.drop(lease_id)
                self.service.end_lease(lease_id, LOST, f"its slurm job {job_id} ended on Slurm's side: {how}")
        if changed:
            self.service.changes.changed()

    def describe(self) -> str:
        """One line for the log at start-up."""
        limit = format_duration(POLL_INTERVAL_S)
        return f"slurm delegate on node {self.node}: Slurm allocates, polled every {limit}"

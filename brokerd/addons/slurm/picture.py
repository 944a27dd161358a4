"""What the Slurm delegate knows of Slurm between polls: the jobs of the last
`squeue --json`, the devices batch jobs hold (jobs vaccel did not make), and which
pending jobs are vaccel's own waiters; and how that shows in `vaccel status` (through the
core's OutsideStatus, brokerd/core/plugins.py) and in a waiter's queue line.

One read of Slurm at a time, shared by all who wait for it: the poller's, and a request's
when its salloc says something (that salloc is the user's to write into, so such reads
are spaced by MIN_READ_GAP_S however much it says)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass

from brokerd.addons.slurm.commands import SlurmCommands
from brokerd.addons.slurm.jobs import SlurmJob, pending_order
from brokerd.base.journal import log_event
from brokerd.base.process import Holder
from brokerd.core.views import DeviceView, OutsideHold, OutsideStatus, OutsideWait
from brokerd.core.waiting import QueuedUpdate

MIN_READ_GAP_S = 0.05


@dataclass(frozen=True)
class Waiter:
    """A vaccel request whose Slurm job is pending (for `vaccel status`'s queue)."""

    job_id: int
    holder: Holder
    gpus: int
    since: float
    time_limit_s: float


@dataclass(frozen=True)
class BatchHold:
    """A device a Slurm job vaccel did not make holds (sbatch, srun from elsewhere)."""

    job_id: int
    user: str
    uid: int
    name: str
    since: float


def held_by(job_id: int, user: str) -> str:
    """How a device a Slurm job holds is named to people: `slurm job 42 (alice)`."""
    return f"slurm job {job_id} ({user})"


class SlurmPicture:
    def __init__(self, node: str) -> None:
        self.node = node
        self.jobs: list[SlurmJob] = []  # the last poll
        self.batch: dict[str, BatchHold] = {}  # device uuid -> the batch job holding it
        self.waiters: dict[int, Waiter] = {}  # job id -> our request waiting on it
        self.polled = asyncio.Event()  # set and cleared after each poll
        self.read_at = -math.inf  # time.monotonic() when the read behind `jobs` began
        self._reading = asyncio.Lock()
        self._poll_error = ""

    async def read(self, commands: SlurmCommands, after: float) -> bool:
        """Make `jobs` come from a read begun at or after `after` (time.monotonic()), starting
        one unless one did; False when Slurm cannot be read."""
        async with self._reading:
            if self.read_at >= after:
                return True
            await asyncio.sleep(max(0.0, self.read_at + MIN_READ_GAP_S - time.monotonic()))
            started = time.monotonic()
            if not await self._refresh(commands):
                return False
            self.read_at = started
            return True

    async def _refresh(self, commands: SlurmCommands) -> bool:
        """Read Slurm's jobs; False (said once per new error) when Slurm cannot be read."""
        try:
            self.jobs = await commands.jobs()
        except (OSError, TimeoutError) as exc:
            if str(exc) != self._poll_error:
                log_event("slurm", f"cannot read Slurm's jobs: {exc}", level=logging.WARNING)
            self._poll_error = str(exc)
            return False
        self._poll_error = ""
        return True

    def take_batch(self, ours: dict[int, str], uuid_of_index: dict[int, str]) -> bool:
        """The devices running jobs hold that are neither ours (`ours`: job -> lease) nor our
        waiters'; whether that changed."""
        batch: dict[str, BatchHold] = {}
        now = time.time()
        for job in self.jobs:
            if job.holding and job.job_id not in ours and job.job_id not in self.waiters:
                # Slurm's start of a job that holds GPUs is past; were it not, the submit time is.
                since = job.start_time if 0 < job.start_time <= now else job.submit_time
                for index in job.indices_on(self.node):
                    if index in uuid_of_index:
                        batch[uuid_of_index[index]] = BatchHold(job.job_id, job.user, job.uid, job.name, since)
        changed = batch != self.batch
        self.batch = batch
        return changed

    def pending(self) -> list[tuple[SlurmJob, Waiter | None]]:
        """The pending jobs that want this node, in Slurm's order, with ours marked."""
        return [(job, self.waiters.get(job.job_id)) for job in pending_order(self.jobs, self.node)]

    def first_ahead(self, job_id: int) -> SlurmJob | None:
        """The first pending job for this node, other than `job_id`, that waits for room alone
        (Resources, Priority; None: not looked at yet), not for a hold, a dependency, a begin
        time or a limit: the kind ahead of which `salloc --immediate` never starts."""
        return next((job for job in pending_order(self.jobs, self.node)
                     if job.job_id != job_id and job.reason in ("Resources", "Priority", "None")), None)

    def queued_update(self, job_id: int, held: tuple[DeviceView, ...]) -> QueuedUpdate:
        """Where a pending job of ours stands, as a queue update."""
        order = pending_order(self.jobs, self.node)
        place = next((i for i, j in enumerate(order, 1) if j.job_id == job_id), 0)
        if not place:
            return QueuedUpdate(1, max(1, len(order)), f"waiting for Slurm: job {job_id} submitted", held,
                                f"slurm-{job_id}")
        reason = order[place - 1].reason
        return QueuedUpdate(place, len(order), f"waiting for Slurm: job {job_id} pending ({reason}), position "
                                               f"{place} of {len(order)} for node {self.node}", held, f"slurm-{job_id}")

    def outside_status(self, mode: str) -> OutsideStatus:
        """The devices batch jobs hold, and the pending jobs that want this node (ours with
        their requester), for `vaccel status`."""
        holds = tuple(OutsideHold(uuid, f"slurm-{hold.job_id}", hold.user, hold.uid, held_by(hold.job_id, hold.user),
                                  hold.since) for uuid, hold in self.batch.items())
        waiting = []
        for job, waiter in self.pending():
            reason = f"slurm job {job.job_id} pending: {job.reason}"
            if waiter is not None:
                waiting.append(OutsideWait(f"slurm-{job.job_id}", job.job_id, waiter.gpus, waiter.since, reason,
                                           waiter.holder.user, waiter.holder.uid, "", waiter.holder,
                                           waiter.time_limit_s))
            else:
                waiting.append(OutsideWait(f"slurm-{job.job_id}", job.job_id, job.gpus, job.submit_time, reason,
                                           job.user, job.uid, f"{held_by(job.job_id, job.user)}: {job.name}"))
        return OutsideStatus(mode, holds, tuple(waiting))

    def version(self) -> Hashable:
        """Changes whenever the status this shows would (the Status reply's cache key)."""
        return id(self.batch), len(self.waiters)

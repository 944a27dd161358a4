"""The Slurm jobs vaccel made: which lease each stands behind (kept on disk by table.py from
the moment Slurm shows the job), and their end: cancelled as root when their lease or
request ends, forgotten when Slurm ended them first. The work runs as tasks off the
caller's path; `close` ends them.

Only jobs found by a request's mark and owner (claims.py) are recorded here, so the
daemon never cancels a job because a user's text named it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from brokerd.addons.slurm.commands import SlurmCommands
from brokerd.addons.slurm.jobs import HOLDING, PENDING, SlurmJob
from brokerd.addons.slurm.table import JobTable
from brokerd.base.journal import log_event

KEEP_ENDED = 1000  # ended leases whose job `vaccel leases` still names


def ended_on_slurms_side(job: SlurmJob | None) -> str:
    """How Slurm says a lease's job ended ("cancelled (TimeLimit)", "gone"), "" while it still
    holds its GPUs or waits to again (requeued)."""
    if job is None:
        return "gone"
    if job.state in HOLDING or job.state == PENDING:
        return ""
    return f"{job.state.lower()} ({job.reason})"


class OurJobs:
    def __init__(self, state_dir: Path, commands: SlurmCommands) -> None:
        self.commands = commands
        self.table = JobTable(state_dir)
        self.job_of = self.table.load()  # lease id -> job id: every job vaccel made that may still run
        self._ended: dict[str, int] = {}  # the same, of recently ended leases (`vaccel leases`)
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.table.close()

    def job_id(self, lease_id: str) -> int:
        """The Slurm job behind a lease, live or recently ended; 0 = none."""
        return self.job_of.get(lease_id) or self._ended.get(lease_id, 0)

    def behind_others(self, lease_id: str) -> set[int]:
        """The jobs behind every lease or request but this one."""
        return {job for lease, job in self.job_of.items() if lease != lease_id}

    async def record(self, lease_id: str, job_id: int) -> None:
        """Slurm shows the request's job: from now on it is cancelled unless a live lease
        stands for it, restarts included."""
        self.job_of[lease_id] = job_id
        await self.table.add(lease_id, job_id)

    def drop(self, lease_id: str) -> None:
        """Slurm ended the lease's job itself: nothing to cancel, the row goes."""
        if self._forget(lease_id):
            self.spawn(self.table.remove(lease_id))

    def cancel_soon(self, lease_id: str, why: str, ended_at: float = 0.0) -> None:
        """The lease (or request) ended: its job is cancelled, then its row goes."""
        job_id = self._forget(lease_id)
        if job_id:
            self.spawn(self._cancel(lease_id, job_id, why, ended_at))

    def cancel_job(self, job_id: int, why: str) -> None:
        """Cancel a job no lease or row stands for."""
        self.spawn(self._cancel("", job_id, why))

    def _forget(self, lease_id: str) -> int:
        """The lease's job leaves the live table (kept a while for `vaccel leases`)."""
        job_id = self.job_of.pop(lease_id, 0)
        if job_id:
            self._ended[lease_id] = job_id
            while len(self._ended) > KEEP_ENDED:
                del self._ended[next(iter(self._ended))]
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

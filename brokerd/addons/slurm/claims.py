"""Which Slurm job is a request's, and whether it may become a lease: on Slurm's word alone.

The salloc behind a request runs as the requesting user, who can read its arguments and
write into its pipes, so what it prints names no job (issue 31: a forged "Granted job
allocation N" once handed one user another's GPU). Instead:

- the job is the one Slurm shows with the request's mark in its comment AND the
  requester's uid. Slurm sets a job's uid from the submitter's munge credential, so a
  mark someone else copies onto their own job is ignored; a requester who copies it onto
  another job of theirs makes the request ambiguous, and it is refused (every job carrying
  the mark is then cancelled: all are theirs). Once seen, the job is followed by its id;
- a grant needs that job started (RUNNING or CONFIGURING), in the configured partition, on
  this node alone, holding exactly as many of this node's GRES as were asked, and behind no
  other lease. Anything else is refused, and the job cancelled, before anything is granted.

Pure functions on SlurmJob (brokerd/addons/slurm/jobs.py): no subprocess, no service.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from brokerd.addons.slurm.jobs import SlurmJob
from brokerd.leasing.errors import Internal, Unsatisfiable


class MarkedTwice(Unsatisfiable):
    """More than one job of the requester carries the request's mark."""

    def __init__(self, message: str, jobs: tuple[int, ...]) -> None:
        super().__init__(message)
        self.jobs = jobs


@dataclass
class Claim:
    """A request's job, found in each read of Slurm's jobs by its mark and owner."""

    mark: str
    uid: int
    user: str
    job_id: int = 0  # 0 until Slurm shows it

    def find(self, jobs: Iterable[SlurmJob]) -> SlurmJob | None:
        """The request's job in this read, None while Slurm shows none; MarkedTwice when
        another job of the requester's carries the mark too."""
        ours = [j for j in jobs if j.uid == self.uid and (j.comment == self.mark or j.job_id == self.job_id)]
        if len(ours) > 1:
            ids = tuple(sorted(j.job_id for j in ours))
            raise MarkedTwice(f"more than one Slurm job of {self.user} carries this request's mark (jobs "
                              f"{', '.join(map(str, ids))}): which one Slurm granted cannot be told, so the request "
                              "is refused and all of them are cancelled", ids)
        if not ours:
            return None
        self.job_id = ours[0].job_id
        return ours[0]


def granted_indices(job: SlurmJob, *, node: str, partition: str, gres: str, gpus: int,
                    indices_here: Collection[int], taken: Collection[int]) -> tuple[int, ...]:
    """The GRES indices a started job holds on `node`, once everything about it is this
    request's due: Internal (the caller cancels the job) with what is wrong otherwise.
    `indices_here` are this broker's device indices, `taken` the job ids behind other leases."""
    if job.job_id in taken:
        raise Internal(f"slurm job {job.job_id} is already behind another lease")
    if partition and job.partition != partition:
        raise Internal(f"slurm job {job.job_id} runs in partition {job.partition!r}, not {partition!r}")
    if job.nodes != node or set(job.gres) - {node}:
        raise Internal(f"slurm job {job.job_id} holds node(s) {job.nodes or 'none'}, not node {node} alone")
    indices = job.indices_on(node)
    if len(indices) != gpus or not set(indices) <= set(indices_here):
        raise Internal(f"slurm job {job.job_id} holds GRES {gres} indices {list(indices)} on {node}, which are not "
                       f"{gpus} of this broker's devices (gres.conf must list the GPUs in the broker's index order)")
    return indices

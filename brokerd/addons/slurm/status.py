"""Slurm's side of `vaccel status` (and the dashboard, which shares the reply): the mode,
the devices batch jobs hold (`slurm job N (user)`), and the pending jobs that want this
node with Slurm's reason, vaccel's own waiters among them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vaccel_common.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    from brokerd.core.service import BrokerService


def held_by(job_id: int, user: str) -> str:
    """How a device a Slurm job holds is named to people: `slurm job 42 (alice)`."""
    return f"slurm job {job_id} ({user})"


def add_slurm_status(reply: pb.StatusReply, service: BrokerService) -> None:
    delegate = service.slurm
    if delegate is None:
        # A delegate exists from the start or not at all: a reload to "delegate" is not
        # in force until a restart, and the reply must not claim it is.
        reply.slurm_mode = "submit" if service.config.slurm_mode == "submit" else "off"
        return
    reply.slurm_mode = delegate.mode
    for msg in reply.devices:
        hold = delegate.batch.get(msg.uuid)
        if hold is None or msg.lease_id:
            continue
        msg.state = "leased"
        msg.lease_id = f"slurm-{hold.job_id}"
        msg.holder.CopyFrom(pb.Holder(user=hold.user, uid=max(hold.uid, 0), command=held_by(hold.job_id, hold.user)))
        msg.since = hold.since
    first = len(reply.queue) + 1
    for place, (job, waiter) in enumerate(delegate.pending(), start=first):
        entry = pb.QueueEntry(request_id=f"slurm-{job.job_id}", gpus=job.gpus, since=job.submit_time,
                              position=place, reason=f"slurm job {job.job_id} pending: {job.reason}",
                              slurm_job_id=job.job_id)
        if waiter is not None:
            h = waiter.holder
            entry.requester.CopyFrom(pb.Holder(user=h.user, uid=h.uid, pid=h.pid, command=h.command))
            entry.since, entry.time_limit_s, entry.gpus = waiter.since, waiter.time_limit_s, waiter.gpus
        else:
            entry.requester.CopyFrom(pb.Holder(user=job.user, uid=max(job.uid, 0),
                                               command=f"{held_by(job.job_id, job.user)}: {job.name}"))
        reply.queue.append(entry)

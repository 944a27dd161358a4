"""The lease this process runs under, and an accelerator for it, without passing them
around: what a training script written for `init_accelerator()` expects.

    from vaccel import init_accelerator
    accelerator = init_accelerator()
    model, loader = accelerator.prepare(model, loader)

Under `with vaccel.lease()` (here or in a parent this process was forked from) the
accelerator is that lease's own, stopped when the lease ends. Under `vaccel run`, and in
torchrun ranks started by it, it is built from the lease's environment. With no lease at
all it computes on the CPU and says so once.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vaccel import leasing

if TYPE_CHECKING:
    from vaccel.accelerator import Accelerator
    from vaccel.session.lease import Lease


def current_lease() -> Lease | None:
    """The innermost lease entered with `vaccel.lease()` that this process is inside
    (a forked child sees its parent's, as a view it never releases), or None.

    A `vaccel run` command has no lease object of its own: its lease is in its environment
    (VACCEL_LEASE_ID), and `with vaccel.lease()` there joins it. Inside a Slurm job that
    holds GPUs it is the job's allocation (slurm_job.py), inside a container that its runtime
    gave GPUs and that reaches no broker the GPUs it was given (container_job.py)."""
    # Entries leave the table when their `with` block exits; a lease lost meanwhile stays,
    # so that using it raises LeaseLost rather than quietly falling back to the CPU.
    for pid, entered in reversed(list(leasing._ENTERED.values())):
        return entered if pid == os.getpid() else entered.forked_view()
    from vaccel.containers import job as container_job
    from vaccel.slurm import job as slurm_job

    return slurm_job.job_lease() or container_job.container_lease()


def init_accelerator(**options: Any) -> Accelerator:
    """The accelerator for the lease this process runs under (see the module doc).
    `options` (env, amp) go to `Accelerator` when it is built from the environment; the
    lease's own accelerator is shared, so options are refused there."""
    held = current_lease()
    if held is not None:
        if options:
            raise TypeError(f"init_accelerator() inside `with lease()` uses that lease's accelerator; "
                            f"pass {', '.join(sorted(options))} to vaccel.Accelerator(...) instead")
        return held.accelerator
    from vaccel.accelerator import Accelerator

    return Accelerator(**options)

"""vaccel client: exclusive GPU leases from the host's broker.

    from vaccel import lease
    with lease(gpus=1, min_memory="20GiB") as l:
        train(l.accelerator)

Importing this package starts no device runtime and imports no torch, nor even typing
(~9 ms on a 2-core machine, most of what a `vaccel status` may spend: vaccel/entry.py).

The client in layers, from a user's command down to the broker (each package's __init__
says what it owns; tests/test_project_rules.py keeps imports going down):
  entry.py, __main__.py   the `vaccel` command: fast paths, else the full CLI
  kernel/                 the Jupyter kernel that holds its devices while it lives
  cli/                    the command line: parser, the full CLI, one module per command
  leasing.py, current.py  the library: `with lease()`, current_lease(), init_accelerator()
  run/                    running a command under a lease (runner, quick run, process tree)
  containers/             docker and podman under a lease
  slurm/                  inside a Slurm job, and delegate mode's salloc
  session/                the lease session: connection, identity calls, request, acquisition
  contract/               contract files, the job's facts, the check report
  accelerator/            the torch accelerator a lease brings (the only torch user)
This package root may import only the library's modules (leasing, current, accelerator),
and those lazily.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING's value, without importing typing

# With a gRPC channel and a heartbeat thread alive, grpcio's fork handlers print
# "Other threads are currently calling into gRPC, skipping fork() handlers" on every
# fork (DataLoader workers) and a child touching the parent's channel can hang. The
# client never uses a channel across fork (see session/connection.py), so turn the handlers off
# before grpc is imported anywhere.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

__version__ = "0.1.0"
__all__ = ["Accelerator", "Lease", "LeaseEnding", "LeaseError", "LeaseLost", "current_lease", "init_accelerator",
           "lease"]

if TYPE_CHECKING:
    from typing import Any

    from vaccel.accelerator import Accelerator
    from vaccel.current import current_lease, init_accelerator
    from vaccel.leasing import Lease, LeaseEnding, LeaseError, LeaseLost, lease


def __getattr__(name: str) -> Any:
    # Lazy: `import vaccel` stays cheap, and torch is imported only by the accelerator.
    if name == "Accelerator":
        from vaccel.accelerator import Accelerator

        return Accelerator
    if name in ("lease", "Lease", "LeaseEnding", "LeaseError", "LeaseLost"):
        from vaccel import leasing

        return getattr(leasing, name)
    if name in ("current_lease", "init_accelerator"):
        from vaccel import current

        return getattr(current, name)
    raise AttributeError(f"module 'vaccel' has no attribute {name!r}")

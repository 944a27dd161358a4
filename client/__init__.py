"""vaccel client: exclusive GPU leases from the host's broker.

    from vaccel import lease
    with lease(gpus=1, min_memory="20GiB") as l:
        train(l.accelerator)

Importing this package starts no device runtime and imports no torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

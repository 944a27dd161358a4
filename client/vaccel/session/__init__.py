"""The lease session: everything between a client and the broker. The connection (gRPC, its
token from the identity socket) and the identity socket's own calls, the lease request and
its acquisition (asking, waiting in the queue, heartbeating), the lease types, joining a lease
from inside one (VACCEL_LEASE_ID), and how a session's outcomes reach a person (exit
statuses, queue lines).

May import: vaccel.contract, vaccel.accelerator, vaccel_common. Never the layers above it
(slurm, containers, run, cli, kernel), so that `with lease()` and every command share it.
"""

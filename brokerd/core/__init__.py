"""The broker's async core: the lease manager made durable, live and governed.

Owns: BrokerService (one method per operation the clients have) built by composition of
parts that are each given what they use: asking for devices, the durable queue and its
waiters, grants and ends committed before anyone hears of them, policy in force (time
limits, early ends, idle reclaim), lease expiry, adopting each probe, pidfd watches of
holders, reaping what an ended lease leaves, permissions and users, and read-only views.
No gRPC here. Add-ons plug in through declared interfaces (brokerd/leasing/hooks.py,
brokerd/core/plugins.py), never by setting attributes of the service.
May import: brokerd.base, brokerd.devices, brokerd.contract, brokerd.leasing,
brokerd.config, brokerd.state.
"""

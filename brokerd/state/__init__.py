"""What the daemon keeps on disk, and the trust it needs to keep it.

Owns: the lease store (SQLite in WAL mode, group commit, brokerd/state/writer.py), the
records of waiting requests, the state directory's ownership rules, and usage accounting
(its own SQLite file, a LeaseHook) with the report arithmetic over it.
May import: brokerd.base, brokerd.devices, brokerd.contract, brokerd.leasing, brokerd.config.
"""

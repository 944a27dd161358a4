"""The lease core in plain, synchronous Python: no gRPC, no I/O, an injectable clock.

Owns: the lease model (Lease, Request, Grant, end states), the lease manager (who holds
which device; what it holds is brokerd/leasing/holdings.py), the fair queue and its rules,
fair share, reservations and backfill, which free devices a request gets (selection), the
holders line, the typed refusals (errors) and the LeaseHook interface add-ons implement.
May import: brokerd.base, brokerd.devices, brokerd.contract.
"""

"""What follows a lease's life besides the store: device-node gating (brokerd/addons/enforce),
accounting (brokerd/state/accounting.py), the metrics and the dashboard. Each is a LeaseHook the
core calls at three moments (brokerd/core/ledger.py); add-ons plug them in with
`BrokerService.add_hook`.

- `restored(active)`: at start-up, after the store's leases are back and before anyone is
  served, so a hook can reconcile what it keeps outside the store (ACL entries).
- `granted(lease)`: the grant is on disk and its holder has not heard of it yet. Raising
  refuses the grant: the lease ends at once and the waiter hears the error. So a hook
  that must hold for a lease to be real (its device nodes opened for the holder) cannot
  be skipped.
- `ended(lease)`: the lease has ended in memory and its end is queued for commit.
  Raising is logged and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from brokerd.leasing.model import Lease


class LeaseHook:
    """Base with no-op moments: a hook overrides the ones it needs."""

    name = "hook"

    def restored(self, active: Sequence[Lease]) -> None:
        return None

    def granted(self, lease: Lease) -> None:
        return None

    def ended(self, lease: Lease) -> None:
        return None

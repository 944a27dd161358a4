"""The holders line every queue update and every Busy refusal ends with: who holds what.

On a workstation it names each device's holder; on a large host (64 MIG slices) a line
with 64 of those reached every waiter at every change of the queue, ~1.6 KB each, and
nobody reads it. Past HOLDERS_LISTED devices it counts the devices per user instead.
"""

from __future__ import annotations

import itertools

from brokerd.base.process import Holder
from brokerd.contract import Requirement
from brokerd.leasing.holders_line import HOLDERS_LISTED
from brokerd.leasing.manager import LeaseManager
from tests.test_leases import ALICE, BOB, CAROL, gpu


def host(n: int, unhealthy: int | None = None) -> LeaseManager:
    counter = itertools.count()
    return LeaseManager([gpu(i, healthy=i != unhealthy) for i in range(n)], clock=lambda: 1000.0,
                        new_id=lambda p: f"{p}{next(counter)}")


def test_a_small_host_names_each_devices_holder():
    m = host(4)
    m.submit(ALICE, Requirement(1), wait=False)
    m.submit(BOB, Requirement(2), wait=False)
    m.drain("GPU-3", "fan broken")
    line = m.holders_summary()
    assert line.startswith("gpu0 alice since ") and ", gpu1 bob since " in line and ", gpu2 bob since " in line
    assert line.endswith("gpu3 drained: fan broken")


def test_a_large_host_counts_devices_per_user_most_first():
    m = host(64, unhealthy=62)
    for holder, count in ((ALICE, 40), (BOB, 20), (CAROL, 2)):
        for _ in range(count):
            m.submit(holder, Requirement(1), wait=False)
    m.drain("GPU-63", "fan broken")
    line = m.holders_summary()
    assert line == "62 of 64 devices leased: alice 40, bob 20, carol 2; 1 drained, 1 unhealthy"


def test_a_large_host_with_many_users_names_the_biggest_and_counts_the_rest():
    m = host(64)
    for uid in range(12):
        holder = Holder(2000 + uid, 2000, 900 + uid, uid, f"user{uid:02d}")
        for _ in range(1 + (uid == 5) * 10):
            m.submit(holder, Requirement(1), wait=False)
    line = m.holders_summary()
    assert line.startswith("22 of 64 devices leased: user05 11, user00 1, ")
    assert line.endswith("and 7 more users")


def test_the_cut_over_is_at_holders_listed_notes():
    m = host(HOLDERS_LISTED + 1)
    for _ in range(HOLDERS_LISTED):
        m.submit(ALICE, Requirement(1), wait=False)
    assert m.holders_summary().count(" since ") == HOLDERS_LISTED
    m.submit(BOB, Requirement(1), wait=False)
    n = HOLDERS_LISTED + 1
    assert m.holders_summary() == f"{n} of {n} devices leased: alice {HOLDERS_LISTED}, bob 1"


def test_a_device_with_many_shares_names_the_memory_per_user():
    """One user's thousands of shares made a Busy refusal 128 KB (issue 43)."""
    from brokerd.leasing.model import Ask

    m = host(2)
    m.set_sharing(["GPU-1"])
    for _ in range(300):
        m.submit(ALICE, Requirement(1), wait=False, ask=Ask(memory_mib=100))
    m.submit(BOB, Requirement(1), wait=False, ask=Ask(memory_mib=2048))
    line = m.holders_summary()
    assert line == "gpu1 shared: alice 29.3 GiB in 300, bob 2 GiB in 1, 48.7 GiB free", line

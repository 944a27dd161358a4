"""Memory shares in the lease manager (issue 35): plain Python, an injectable clock.

A shared device is leased by memory: shares fit beside each other and never overcommit it,
whole requests wait for it to have no share, a share waiting keeps its memory from the
requests behind (which may backfill with a short enough --time), and fair share, limits
and accounting count a share by its part of the device."""

from __future__ import annotations

import pytest

from brokerd.contract import Requirement
from brokerd.leasing.errors import Busy, Unsatisfiable
from brokerd.leasing.model import LOST, Ask, Lease, LeaseTerms, Request, UserLimits
from tests.test_leases import ALICE, BOB, CAROL, gpu, manager

GIB = 1024


def shared_host(n: int = 2, shared: tuple[int, ...] = (1,)):
    """GPUs of 80 GiB; gpu1 (by default) leased by memory."""
    m, clock = manager(n)
    m.set_sharing(f"GPU-{i}" for i in shared)
    return m, clock


def share(m, who, gib: int, *, wait: bool = False, time_s: float = 0.0, **kw):
    return m.submit(who, Requirement(1), wait=wait, ask=Ask(time_limit_s=time_s, memory_mib=gib * GIB), **kw)


def test_shares_fit_beside_each_other_and_never_overcommit_the_device():
    m, _ = shared_host()
    a, b = share(m, ALICE, 40), share(m, BOB, 30)
    assert isinstance(a, Lease) and isinstance(b, Lease)
    assert a.devices == b.devices == ("GPU-1",)
    assert (a.share_mib, a.share_of_mib, a.weight) == (40 * GIB, 80 * GIB, 0.5)
    assert a.terms.memory_cap_mib == 40 * GIB  # the client caps its allocator to the share
    assert m.holdings.device_state("GPU-1") == "shared" and m.holdings.room("GPU-1") == 10 * GIB
    with pytest.raises(Busy, match=r"no shared device has room for the share now.*gpu1 shared: alice 40 GiB, bob 30"):
        share(m, CAROL, 20)
    waiting = share(m, CAROL, 20, wait=True)
    assert isinstance(waiting, Request)
    assert waiting.reason.startswith("waiting for 20 GiB of shared memory to come free (most free now: gpu1, 10 GiB)")
    m.release(a.id, ALICE.uid)
    (grant,) = m.pump()
    assert grant.lease.devices == ("GPU-1",) and grant.lease.share_mib == 20 * GIB
    m.check_invariants()


def test_a_config_cap_below_the_share_stays_the_cap():
    m, _ = shared_host()
    lease = m.submit(ALICE, Requirement(1), wait=False, ask=Ask(memory_mib=40 * GIB),
                     terms=LeaseTerms(memory_cap_mib=8 * GIB))
    assert lease.terms.memory_cap_mib == 8 * GIB


def test_whole_requests_never_land_beside_shares_and_take_a_shared_device_only_without_any():
    m, _ = shared_host(2)
    whole = m.submit(ALICE, Requirement(1), wait=False)
    assert whole.devices == ("GPU-0",)  # unshared devices first: the shared one stays for shares
    other = m.submit(BOB, Requirement(1), wait=False)
    assert other.devices == ("GPU-1",)  # a shared device without shares is given whole
    m.release(whole.id, ALICE.uid)
    m.release(other.id, BOB.uid)
    s = share(m, BOB, 10)
    assert s.devices == ("GPU-1",)
    both = m.submit(CAROL, Requirement(2), wait=True)
    assert isinstance(both, Request), "two whole devices while one of them has a share"
    m.release(s.id, BOB.uid)
    (grant,) = m.pump()
    assert set(grant.lease.devices) == {"GPU-0", "GPU-1"} and not grant.lease.share_mib
    with pytest.raises(Busy):
        share(m, ALICE, 10)  # held whole: no share goes to it
    m.check_invariants()


def test_a_share_goes_to_the_fullest_device_it_fits():
    m, _ = shared_host(3, shared=(1, 2))
    first = share(m, ALICE, 60)
    second = share(m, BOB, 10)
    assert second.devices == first.devices, "best fit: the room left by the first share, not a fresh device"
    third = share(m, CAROL, 20)
    assert third.devices != first.devices


@pytest.mark.parametrize(("gpus", "shared", "memory", "words"), [
    (2, (1,), 10, "a memory share is of one device"),
    (1, (), 10, "no device on this host is shared by memory"),
    (1, (1,), 100, "a share of 100 GiB is more than any shared device holds (the largest, gpu1, has 80 GiB)"),
])
def test_share_requests_that_can_never_start_are_refused(gpus, shared, memory, words):
    m, _ = shared_host(2, shared=shared)
    with pytest.raises(Unsatisfiable, match=words.replace("(", r"\(").replace(")", r"\)")):
        m.submit(ALICE, Requirement(gpus), wait=True, ask=Ask(memory_mib=memory * GIB))


def test_a_waiting_share_keeps_its_memory_from_later_shares_unless_they_fit_beside_it_or_end_before():
    m, clock = shared_host(1, shared=(0,))
    share(m, ALICE, 60, time_s=3600)  # ends in an hour: 20 GiB free until then
    big = share(m, BOB, 50, wait=True)
    assert isinstance(big, Request)  # starts in an hour, when alice's 60 GiB is back
    # 20 GiB now would still run then, beside bob's 50 (70 <= 80): it does not delay him
    beside = share(m, CAROL, 20)
    assert isinstance(beside, Lease)
    m.release(beside.id, CAROL.uid)
    # 20 GiB with another 20 GiB kept too would not fit beside bob then: only a short one may
    other = share(m, CAROL, 10, wait=True)
    assert isinstance(other, Lease)  # 10 + 50 <= 80: fits then too
    m.release(other.id, CAROL.uid)
    clock.now += 1
    held = [share(m, CAROL, 15), share(m, CAROL, 5)]
    assert all(isinstance(x, Lease) for x in held)  # 20 GiB beside bob's 50 later: 70
    with pytest.raises(Busy):
        share(m, CAROL, 1)  # no room left now
    m.check_invariants()


def test_backfill_of_a_share_needs_a_short_enough_time_limit():
    m, _ = shared_host(1, shared=(0,))
    share(m, ALICE, 70, time_s=3600)
    big = share(m, BOB, 75, wait=True)
    assert isinstance(big, Request)
    long = share(m, CAROL, 10, wait=True)  # would still run when bob starts: 75 + 10 > 80
    assert isinstance(long, Request) and long.reason.startswith("backfill window")
    m.cancel(long.id)
    short = share(m, CAROL, 10, time_s=1800)  # gone before bob can start
    assert isinstance(short, Lease)


def test_a_whole_request_waiting_for_a_shared_device_keeps_it_from_new_shares():
    m, _ = shared_host(1, shared=(0,))
    first = share(m, ALICE, 10, time_s=600)
    whole = m.submit(BOB, Requirement(1), wait=True)
    assert isinstance(whole, Request)
    later = share(m, CAROL, 10, wait=True)  # would keep bob's device from coming free
    assert isinstance(later, Request)
    m.cancel(later.id)
    assert isinstance(share(m, CAROL, 10, time_s=300), Lease)  # ends before alice's share: no delay
    m.release(first.id, ALICE.uid)
    assert m.pump() == []  # carol's share still runs
    m.check_invariants()


def test_limits_and_fair_share_count_a_share_by_its_part_of_the_device():
    m, clock = shared_host(2)
    one = UserLimits(max_devices=1)
    quarters = [share(m, ALICE, 20, limits=one) for _ in range(4)]
    assert all(isinstance(x, Lease) for x in quarters)
    held = m.submit(ALICE, Requirement(1), wait=True, limits=one)
    assert isinstance(held, Request) and held.reason.startswith("limit max_devices=1 for default: you hold 1 (gpu1)")
    clock.now += 3600
    assert m.usage.in_window(ALICE.uid, clock.now, 7 * 86400, m.leases.values()) == pytest.approx(1.0)
    for lease in quarters[:2]:
        m.release(lease.id, ALICE.uid)
    assert m.usage.in_window(ALICE.uid, clock.now, 7 * 86400, m.leases.values()) == pytest.approx(1.0)


def test_a_vanished_or_shrunk_device_ends_its_shares_as_lost():
    m, _ = shared_host(2)
    a, b = share(m, ALICE, 40), share(m, BOB, 30)
    smaller = [gpu(0), gpu(1, memory_gib=60)]
    (lost,) = m.set_inventory(smaller)
    assert lost.id == b.id and lost.state == LOST and "less than its shares hold" in lost.end_reason
    (gone,) = m.set_inventory([gpu(0)])
    assert gone.id == a.id and "disappeared" in gone.end_reason
    assert m.holdings.shares == {}
    m.check_invariants()


def test_unsharing_a_device_lets_its_shares_run_and_takes_no_more():
    m, _ = shared_host(2)
    a = share(m, ALICE, 40)
    m.set_sharing(())
    assert a.id in m.leases
    with pytest.raises(Unsatisfiable, match="no device on this host is shared"):
        share(m, BOB, 10)
    assert isinstance(m.submit(BOB, Requirement(1), wait=False), Lease)  # gpu0
    with pytest.raises(Busy):
        m.submit(CAROL, Requirement(1), wait=False)  # gpu1 still has alice's share


def test_a_share_counts_its_part_of_the_device_it_gets_against_max_devices():
    m, _ = manager(0)
    m.set_inventory([gpu(0, memory_gib=80), gpu(1, memory_gib=24)])
    m.set_sharing(["GPU-0", "GPU-1"])
    one = UserLimits(max_devices=1)
    half = share(m, ALICE, 40, limits=one)
    assert half.devices == ("GPU-0",) and half.weight == 0.5
    # Best fit would be the 24 GiB device, where 16 GiB counts as 0.67: over the limit with
    # the 0.5 she holds. On the 80 GiB device it counts as 0.2: she gets that one.
    more = share(m, ALICE, 16, limits=one)
    assert more.devices == ("GPU-0",) and more.weight == 0.2
    m.release(more.id, ALICE.uid)
    share(m, BOB, 30)  # the large device has 10 GiB of room left: only the small one fits 16 GiB
    waits = share(m, ALICE, 16, wait=True, limits=one)
    assert isinstance(waits, Request)
    assert waits.reason == ("limit max_devices=1 for default: you hold 0.5, and a 16 GiB share of gpu1 counts as "
                            "0.67 of a device")
    m.check_invariants()


def test_max_leases_caps_one_users_shares_and_min_share_refuses_a_tiny_one():
    """A share weighs its part of the device, so max_devices alone let one user hold
    thousands of 1 MiB shares (issue 43): max_leases counts them, min_share refuses them."""
    m, _ = shared_host()
    limits = UserLimits(max_devices=3, max_leases=4, min_share_mib=GIB)
    with pytest.raises(Unsatisfiable, match=r"a share of 1 MiB is under the smallest share granted here, 1 GiB"):
        m.submit(ALICE, Requirement(1), wait=False, ask=Ask(memory_mib=1), limits=limits)
    held = [share(m, ALICE, 1, limits=limits) for _ in range(4)]
    assert all(isinstance(lease, Lease) for lease in held)
    with pytest.raises(Busy, match=r"limit max_leases=4 for default: you hold 4 leases and shares"):
        share(m, ALICE, 1, limits=limits)
    waiting = share(m, ALICE, 1, wait=True, limits=limits)
    assert waiting.reason.startswith("limit max_leases=4")
    assert isinstance(share(m, BOB, 1, limits=limits), Lease)  # the cap is alice's alone
    m.release(held[0].id, ALICE.uid)
    assert [grant.request is waiting for grant in m.pump()] == [True]

"""[policy] lend_idle in the lease manager: a request over its user's limits starts on
devices no request within limits can use now, its lease is borrowed, and it ends with
notice (lend_notice) when a request within limits needs the device. The rule's property
over every interleaving is in tests/test_lease_properties.py."""

from __future__ import annotations

from brokerd.contract import Requirement
from brokerd.leasing.model import RELEASED, REVOKED, UserLimits
from tests.test_fair_queue import granted, queued
from tests.test_leases import ALICE, BOB, CAROL, manager

ONE = UserLimits(policy="group students", max_devices=1)


def _lending(n: int, notice_s: float = 300.0):  # type: ignore[no-untyped-def]
    m, clock = manager(n)
    m.lending.enabled, m.lending.notice_s = True, notice_s
    return m, clock


def test_without_lend_idle_a_limited_request_waits_while_devices_sit_idle():
    m, _ = manager(3)
    granted(m.submit(ALICE, Requirement(1), wait=False, limits=ONE))
    waiting = queued(m.submit(ALICE, Requirement(1), wait=True, limits=ONE))
    assert m.pump() == []
    assert waiting.reason.startswith("limit max_devices=1")


def test_a_limited_request_borrows_a_device_nobody_within_limits_can_use():
    m, _ = _lending(3)
    own = granted(m.submit(ALICE, Requirement(1), wait=False, limits=ONE))
    queued(m.submit(ALICE, Requirement(1), wait=True, limits=ONE))
    grants = m.pump()
    assert len(grants) == 1 and grants[0].lease.borrowed
    assert not own.borrowed
    assert m.queue == []
    m.check_invariants()


def test_a_borrowed_lease_ends_with_notice_when_a_request_within_limits_needs_its_device():
    m, clock = _lending(2, notice_s=300)
    granted(m.submit(ALICE, Requirement(1), wait=False, limits=ONE))
    queued(m.submit(ALICE, Requirement(1), wait=True, limits=ONE))
    [grant] = m.pump()
    borrowed = grant.lease
    # Bob is within his limits and nothing is free: the borrowed device is his in 5 minutes.
    bob = queued(m.submit(BOB, Requirement(1), wait=True))
    assert m.pump() == []
    assert m.lending.recalled == [borrowed]
    assert borrowed.expires_at == clock.now + 300
    assert borrowed.notice.startswith("lent while idle: a request within its limits needs gpu1 (ends at ")
    # Told once: the next pass leaves the notice as it is.
    m.pump()
    assert m.lending.recalled == []
    clock.now += 300
    for lease in list(m.leases.values()):
        m.heartbeat(lease.id)  # they are all at work: only the notice ends one
    [ended] = m.expire()
    assert ended.id == borrowed.id and ended.state == REVOKED
    [handed] = m.pump()
    assert handed.request.id == bob.id and handed.lease.devices == borrowed.devices and not handed.lease.borrowed
    m.check_invariants()


def test_lending_leaves_alone_a_device_kept_for_a_request_within_limits():
    m, _ = _lending(3)
    granted(m.submit(ALICE, Requirement(1), wait=False, limits=ONE))
    granted(m.submit(CAROL, Requirement(1), wait=False))  # no time limit: the free gpu2 is kept for bob for good
    bob = queued(m.submit(BOB, Requirement(2), wait=True))
    limited = queued(m.submit(ALICE, Requirement(1), wait=True, limits=ONE))
    assert m.pump() == []
    assert {r.id for r in m.queue} == {bob.id, limited.id}
    assert m.holdings.device_state("GPU-2") == "free"


def test_a_borrowed_lease_is_not_recalled_for_a_request_that_could_not_start_anyway():
    m, _ = _lending(3)
    granted(m.submit(CAROL, Requirement(1), wait=False, limits=ONE))
    queued(m.submit(CAROL, Requirement(1), wait=True, limits=ONE))
    [grant] = m.pump()  # carol borrows one of the two idle devices
    assert grant.lease.borrowed
    # Bob wants 3: even with the borrowed device back he could not start (carol's own lease stays).
    queued(m.submit(BOB, Requirement(3), wait=True))
    m.pump()
    assert m.lending.recalled == [] and not grant.lease.notice


def test_a_borrower_that_gives_back_when_called_back_has_released_and_is_not_reaped():
    m, _ = _lending(2)
    granted(m.submit(ALICE, Requirement(1), wait=False, limits=ONE))
    queued(m.submit(ALICE, Requirement(1), wait=True, limits=ONE))
    [grant] = m.pump()
    queued(m.submit(BOB, Requirement(1), wait=True))
    m.pump()
    assert grant.lease.notice
    # Her job checkpoints on the notice and gives the device back: released (the reaper
    # stops nothing of a release), where an admin's revoke stays a revoke.
    ended = m.release(grant.lease.id, ALICE.uid)
    assert ended.state == RELEASED and ended.end_reason.startswith("gave back what it borrowed: lent while idle")
    [handed] = m.pump()
    assert handed.lease.devices == grant.lease.devices

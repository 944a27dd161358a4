"""The queue plans with how long users' leases really run (brokerd/leasing/runtimes.py):
a lab's jobs mostly run under the 24 h default limit and end within the hour, and planned
by their limits alone a request for several devices keeps the free ones idle for a day."""

from __future__ import annotations

from brokerd.contract import Requirement
from brokerd.leasing.model import Ask
from brokerd.leasing.runtimes import RuntimeBook
from tests.test_fair_queue import granted, queued
from tests.test_leases import ALICE, BOB, CAROL, manager

DAY = Ask(time_limit_s=86400.0)
TWO_DAYS = Ask(time_limit_s=2 * 86400.0)
HOUR = 3600.0


def _short_history(m, clock, holder, runs: int = 2, run_s: float = 0.5 * HOUR) -> None:  # type: ignore[no-untyped-def]
    for _ in range(runs):
        lease = granted(m.submit(holder, Requirement(1), wait=False, ask=DAY))
        clock.now += run_s
        m.release(lease.id, holder.uid)


def test_a_user_whose_jobs_run_short_backfills_devices_kept_for_a_larger_request():
    m, clock = manager(3)
    _short_history(m, clock, CAROL)
    # Alice holds one device for a day by her limit; Bob waits for all three: the two free
    # ones are kept for him until Alice's lease could end.
    granted(m.submit(ALICE, Requirement(1), wait=False, ask=DAY))
    bob = queued(m.submit(BOB, Requirement(3), wait=True, ask=DAY))
    assert bob.reason == "waiting for a device to come free"
    # Carol's jobs ran half an hour: planned so, her request backfills a kept device (by
    # its two-day limit alone it would end after Alice's lease could, and wait).
    lease = m.submit(CAROL, Requirement(1), wait=True, ask=TWO_DAYS)
    assert granted(lease).devices[0] not in m.owner or m.owner[lease.devices[0]] == lease.id
    m.check_invariants()


def test_on_a_host_without_history_a_request_is_planned_by_its_time_limit_as_before():
    m, _ = manager(3)
    granted(m.submit(ALICE, Requirement(1), wait=False, ask=DAY))
    queued(m.submit(BOB, Requirement(3), wait=True, ask=DAY))
    carol = queued(m.submit(CAROL, Requirement(1), wait=True, ask=TWO_DAYS))
    assert carol.reason.startswith("backfill window")


def test_a_lease_that_outlives_its_prediction_is_planned_by_its_limit_again():
    m, clock = manager(3)
    _short_history(m, clock, CAROL, run_s=2 * HOUR)  # Carol's jobs run their hour's limit out
    _short_history(m, clock, ALICE)
    long_one = granted(m.submit(ALICE, Requirement(1), wait=False, ask=DAY))
    # Bob waits for all three. While Alice's lease is within its half-hour prediction, he
    # is planned to start then, and Carol's 1-hour request may not backfill in front of him.
    queued(m.submit(BOB, Requirement(3), wait=True, ask=DAY))
    carol = queued(m.submit(CAROL, Requirement(1), wait=True, ask=Ask(time_limit_s=HOUR)))
    assert carol.reason.startswith("backfill window")
    # Past its prediction Alice's lease is planned by its limit: Bob is a day away, and
    # Carol's hour fits in front of him.
    clock.now += HOUR
    [grant] = m.pump()
    assert grant.request.id == carol.id
    assert m.waiting.runtimes.end_of(long_one, clock.now) == long_one.expires_at
    m.check_invariants()


def test_only_runs_that_ended_by_themselves_count_and_only_the_last_two():
    m, clock = manager(2)
    book: RuntimeBook = m.waiting.runtimes
    assert book.run_s(ALICE.uid, 86400.0) == 86400.0  # no history: the limit
    _short_history(m, clock, ALICE, runs=3, run_s=HOUR)
    lease = granted(m.submit(ALICE, Requirement(1), wait=False, ask=DAY))
    clock.now += 3 * HOUR
    m.release(lease.id, ALICE.uid)
    assert book.run_s(ALICE.uid, 86400.0) == 2 * HOUR  # (1 h + 3 h) / 2
    assert book.run_s(ALICE.uid, 1800.0) == 1800.0  # never past the limit
    revoked = granted(m.submit(ALICE, Requirement(1), wait=False, ask=DAY))
    clock.now += 10 * HOUR
    m.release(revoked.id, BOB.uid)  # another user's release is a revoke: says nothing of the job
    assert book.run_s(ALICE.uid, 86400.0) == 2 * HOUR


def test_a_user_new_to_the_host_is_planned_like_its_typical_lease():
    m, clock = manager(3)
    _short_history(m, clock, ALICE, runs=3, run_s=HOUR)  # the host's leases run an hour
    granted(m.submit(ALICE, Requirement(1), wait=False, ask=DAY))
    queued(m.submit(BOB, Requirement(3), wait=True, ask=DAY))
    # Carol has no lease of her own yet: planned like the host's, an hour, she backfills
    # the two devices kept for Bob until Alice's lease (planned an hour too) ends.
    carol = m.submit(CAROL, Requirement(1), wait=True, ask=TWO_DAYS)
    assert granted(carol).devices
    assert m.waiting.runtimes.run_s(CAROL.uid, 86400.0) == HOUR
    m.check_invariants()


def test_a_plan_goes_with_its_lease_whether_it_ends_or_its_grant_is_undone():
    m, clock = manager(2)
    book = m.waiting.runtimes
    ended = granted(m.submit(ALICE, Requirement(1), wait=False, ask=DAY))
    undone = granted(m.submit(BOB, Requirement(1), wait=False, ask=DAY))
    assert set(book._planned) == {ended.id, undone.id}
    m.rollback(undone.id)  # the store could not record it
    clock.now += HOUR
    m.release(ended.id, ALICE.uid)
    assert book._planned == {}


def test_a_user_backfills_on_predictions_with_at_most_two_leases_at_once():
    """Predictions are not promises: two short jobs teach the queue that a user's jobs are
    short, then a burst of day-long jobs would all backfill in front of a waiting request.
    A request that fits a kept window only by its prediction (not by its time limit) may
    take it while its user holds at most one lease; one that fits by its limit always may."""
    m, clock = manager(6)
    _short_history(m, clock, ALICE, run_s=3 * HOUR)
    _short_history(m, clock, CAROL)  # two half-hour runs
    granted(m.submit(ALICE, Requirement(2), wait=False, ask=DAY))  # planned 3 h
    queued(m.submit(BOB, Requirement(5), wait=True, ask=DAY))  # keeps the 4 free ones for 3 h
    first = granted(m.submit(CAROL, Requirement(1), wait=True, ask=DAY))
    second = granted(m.submit(CAROL, Requirement(1), wait=True, ask=DAY))
    third = queued(m.submit(CAROL, Requirement(1), wait=True, ask=DAY))
    assert third.reason.startswith("backfill window"), third.reason
    # An honest --time that ends before Bob could start still backfills.
    granted(m.submit(CAROL, Requirement(1), wait=True, ask=Ask(time_limit_s=HOUR)))
    # Once she is down to one lease, her waiting request backfills on its prediction again.
    clock.now += 0.25 * HOUR
    m.release(first.id, CAROL.uid)
    assert [g.request.id for g in m.pump()] == []  # still two: second, and the honest one
    m.release(second.id, CAROL.uid)
    assert [g.request.id for g in m.pump()] == [third.id]
    m.check_invariants()

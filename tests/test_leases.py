"""Unit tests of the lease manager: plain Python, an injectable clock, no daemon."""

from __future__ import annotations

import itertools

import pytest

from brokerd.base.process import Holder, ProcessId
from brokerd.contract import Requirement
from brokerd.devices.model import Device
from brokerd.leasing.errors import Busy, Ended, LeaseError, NotFound, Unsatisfiable
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import EXPIRED, HOLDER_EXITED, LOST, RELEASED, REVOKED, Lease, Request


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gpu(i: int, memory_gib: int = 80, backend: str = "cuda", healthy: bool = True) -> Device:
    return Device(index=i, uuid=f"GPU-{i}", vendor="nvidia" if backend == "cuda" else "amd",
                  name=f"card{i}", memory_mib=memory_gib * 1024, backend=backend, arch="sm_80",
                  healthy=healthy, health_reason="" if healthy else "ECC errors")


ALICE = Holder(1001, 1001, 500, 11, "alice")
BOB = Holder(1002, 1002, 600, 22, "bob")
CAROL = Holder(1003, 1003, 700, 33, "carol")


def manager(n: int = 2, **kw) -> tuple[LeaseManager, Clock]:
    clock = Clock()
    counter = itertools.count()
    m = LeaseManager([gpu(i) for i in range(n)], clock=clock, new_id=lambda p: f"{p}{next(counter)}", **kw)
    return m, clock


def test_grant_is_exclusive_and_release_frees():
    m, _ = manager(2)
    a = m.submit(ALICE, Requirement(1), wait=False)
    b = m.submit(BOB, Requirement(1), wait=False)
    assert isinstance(a, Lease) and isinstance(b, Lease)
    assert set(a.devices).isdisjoint(b.devices)
    with pytest.raises(Busy, match="alice"):
        m.submit(CAROL, Requirement(1), wait=False)
    m.release(a.id, ALICE.uid)
    c = m.submit(CAROL, Requirement(1), wait=False)
    assert isinstance(c, Lease) and c.devices == a.devices
    m.check_invariants()


def test_multi_device_is_all_or_nothing():
    m, _ = manager(3)
    m.submit(ALICE, Requirement(2), wait=False)
    with pytest.raises(Busy):
        m.submit(BOB, Requirement(2), wait=False)
    assert len(m.owner) == 2, "a refused request must not hold a partial set"
    m.check_invariants()


def test_unsatisfiable_requests_fail_at_once():
    m, _ = manager(2)
    with pytest.raises(Unsatisfiable):
        m.submit(ALICE, Requirement(3), wait=True)
    with pytest.raises(Unsatisfiable, match="GiB"):
        m.submit(ALICE, Requirement(1, min_memory_mib=200 * 1024), wait=True)
    with pytest.raises(Unsatisfiable):
        m.submit(ALICE, Requirement(0), wait=True)
    assert not m.queue


def test_fifo_queue_and_positions():
    m, _ = manager(1)
    first = m.submit(ALICE, Requirement(1), wait=True)
    r1 = m.submit(BOB, Requirement(1), wait=True)
    r2 = m.submit(CAROL, Requirement(1), wait=True)
    assert isinstance(r1, Request) and isinstance(r2, Request)
    assert m.waiting.position(r1.id) == (1, 2)
    assert m.waiting.position(r2.id) == (2, 2)
    m.release(first.id, ALICE.uid)
    grants = m.pump()
    assert [g.request.id for g in grants] == [r1.id]
    assert m.waiting.position(r2.id) == (1, 1)


def test_newcomer_does_not_jump_the_queue():
    m, _ = manager(2)
    held = m.submit(ALICE, Requirement(1), wait=True)
    waiting_for_two = m.submit(BOB, Requirement(2), wait=True)
    assert isinstance(waiting_for_two, Request)
    # One device is free, but Bob (ahead, wanting 2) may use it: Carol must wait behind him.
    late = m.submit(CAROL, Requirement(1), wait=True)
    assert isinstance(late, Request)
    m.release(held.id, ALICE.uid)
    grants = m.pump()
    assert [g.request.holder.user for g in grants] == ["bob"]


def test_backfill_takes_only_devices_nobody_ahead_can_use():
    clock = Clock()
    m = LeaseManager([gpu(0, 80), gpu(1, 16)], clock=clock)
    m.submit(ALICE, Requirement(1, min_memory_mib=40 * 1024), wait=True)  # takes the 80 GiB card
    big = m.submit(BOB, Requirement(1, min_memory_mib=40 * 1024), wait=True)  # waits: only the 80 GiB fits
    assert isinstance(big, Request)
    small = m.submit(CAROL, Requirement(1), wait=True)  # the 16 GiB card is useless to Bob
    assert isinstance(small, Lease) and small.devices == ("GPU-1",)


def test_cancel_removes_from_queue():
    m, _ = manager(1)
    m.submit(ALICE, Requirement(1), wait=True)
    r = m.submit(BOB, Requirement(1), wait=True)
    assert m.cancel(r.id)
    assert not m.queue
    assert not m.cancel(r.id)


def test_release_by_another_user_is_a_revoke():
    # Who may release at all is brokerd/core/permissions.py's (tests/test_permissions.py).
    m, _ = manager(1)
    a = m.submit(ALICE, Requirement(1), wait=False)
    revoked = m.release(a.id, BOB.uid)
    assert revoked.state == REVOKED and "admin" in revoked.end_reason
    with pytest.raises(Ended, match="revoked"):
        m.heartbeat(a.id)
    with pytest.raises(NotFound):
        m.release("l-nope", ALICE.uid)


def test_heartbeat_ttl_and_max_duration():
    m, clock = manager(2, ttl_s=10, max_duration_s=100)
    a = m.submit(ALICE, Requirement(1), wait=False)
    b = m.submit(BOB, Requirement(1), wait=False)
    for _ in range(12):
        clock.now += 8
        m.heartbeat(a.id)
        ended = m.expire()
        if ended:
            break
    assert [lease.id for lease in ended] == [b.id]
    assert ended[0].state == EXPIRED and "heartbeat" in ended[0].end_reason
    while a.active:
        clock.now += 8
        m.heartbeat(a.id)
        ended = m.expire()
    assert a.state == EXPIRED and "maximum" in a.end_reason
    assert clock.now - a.granted_at >= 100
    assert not m.owner


def test_holder_exit_ends_leases_and_drops_requests():
    m, _ = manager(1)
    a = m.submit(ALICE, Requirement(1), wait=False)
    r = m.submit(BOB, Requirement(1), wait=True)
    ended, dropped = m.process_exited(BOB.process)
    assert ended == [] and [d.id for d in dropped] == [r.id]
    ended, _ = m.process_exited(ProcessId(ALICE.pid, ALICE.start_time + 1))  # same pid, another process
    assert ended == []
    ended, _ = m.process_exited(ALICE.process)
    assert [lease.id for lease in ended] == [a.id] and a.state == HOLDER_EXITED


def test_a_joining_process_becomes_a_member():
    # Who may join is brokerd/core/permissions.py's (tests/test_permissions.py).
    m, _ = manager(1)
    a = m.submit(ALICE, Requirement(1), wait=False)
    assert m.join(a.id, ProcessId(9999, 5)).members == {(9999, 5)}


def test_unhealthy_or_vanished_device_ends_lease_and_is_not_granted():
    m, _ = manager(2)
    a = m.submit(ALICE, Requirement(1), wait=False)
    sick = [gpu(0, healthy=False), gpu(1)]
    lost = m.set_inventory(sick if a.devices == ("GPU-0",) else [gpu(0), gpu(1, healthy=False)])
    assert [lease.id for lease in lost] == [a.id] and a.state == LOST
    b = m.submit(BOB, Requirement(1), wait=False)
    assert b.devices != a.devices
    with pytest.raises(Busy):
        m.submit(CAROL, Requirement(1), wait=False)
    lost = m.set_inventory([gpu(0), gpu(1)][:1] if b.devices == ("GPU-1",) else [gpu(1)])
    assert [lease.id for lease in lost] == [b.id] and "disappeared" in b.end_reason


def test_busy_device_is_not_granted_but_keeps_its_lease():
    m, _ = manager(2)
    a = m.submit(ALICE, Requirement(1), wait=False)
    other = "GPU-1" if a.devices == ("GPU-0",) else "GPU-0"
    lost = m.set_inventory([gpu(0), gpu(1)], {a.devices[0]: "IN USE WITHOUT LEASE", other: "zombie memory"})
    assert lost == [] and a.active
    with pytest.raises(Busy, match="zombie"):
        m.submit(BOB, Requirement(1), wait=False)


def test_never_mixes_backends_in_one_lease():
    m = LeaseManager([gpu(0, backend="cuda"), gpu(1, backend="rocm"), gpu(2, backend="rocm")])
    lease = m.submit(ALICE, Requirement(2), wait=False)
    assert lease.devices == ("GPU-1", "GPU-2") and lease.backend == "rocm"


def test_restore_refuses_double_holding():
    m, _ = manager(1)
    a = m.submit(ALICE, Requirement(1), wait=False)
    fresh, _ = manager(1)
    fresh.restore(a)
    with pytest.raises(LeaseError, match="two live leases"):
        fresh.restore(Lease("l-x", BOB, a.devices, "cuda", 0.0))


def test_release_records_history_and_last_used():
    m, clock = manager(1)
    a = m.submit(ALICE, Requirement(1), wait=False)
    clock.now += 5
    m.release(a.id, ALICE.uid)
    assert m.get(a.id).state == RELEASED
    assert m.holdings.last_used["GPU-0"] == clock.now


def test_a_holder_that_exits_after_being_told_of_an_announced_end_ends_as_announced():
    """A revoke with grace or a share over its budget is announced with its end; the holder
    that stops on the notice (its client's clock a moment ahead of the broker's timer, or
    acting on an end the broker moved since) ends the lease as announced, not as a plain
    exit; an idle reclaim announced ends so only once its time is reached."""
    from brokerd.leasing.model import IDLE, OVER_BUDGET

    for state in (REVOKED, OVER_BUDGET, IDLE):
        m, clock = manager(1)
        lease = m.submit(ALICE, Requirement(1), wait=False)
        m.end_early(lease.id, clock.now + 30, state, f"ends: {state}")
        clock.now += 29.5  # its holder stops a moment before the broker's end
        (ended,), _ = m.process_exited(ALICE.process)
        assert (ended.state, ended.end_reason) == ((state, f"ends: {state}") if state != IDLE
                                                   else (HOLDER_EXITED, "holder pid 500 exited"))

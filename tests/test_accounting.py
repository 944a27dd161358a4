"""Usage accounting: the report's figures on a known sequence of leases (brokerd/state/report.py),
and the accounting hook on a real SQLite file with an injected clock (brokerd/state/accounting.py):
live leases reported mid-lease, durability across a reopen, the backfill after a crash,
pruning that never touches live leases, utilisation sampling, and who sees whose rows."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from brokerd.base.process import Holder
from brokerd.config.loader import Config, ConfigError, load_config
from brokerd.devices.model import Device, Snapshot
from brokerd.leasing.model import EXPIRED, RELEASED, Lease
from brokerd.state.accounting import DB_NAME, Accounting
from brokerd.state.report import UsageRow, build_report, day_start, percentile, report_json

H = 3600.0
T0 = day_start(1736899200.0) + 10 * H  # 10:00 local time on 2025-01-15, whatever the zone
GROUPS = {100: "staff", 200: "students"}


def group_of(gid: int) -> str:
    return GROUPS.get(gid, str(gid))


def usage(lease_id, uid, user, gid, devices, start, end, wait, state, idle=None) -> UsageRow:
    return UsageRow(lease_id=lease_id, uid=uid, user=user, gid=gid, devices=tuple(devices), granted_at=start,
                    ended_at=end, wait_s=wait, state=state, idle_device_s=idle)


# The period is [T0, T0+6h). carol's lease began before it; erin's ended before it.
SEQUENCE = [
    usage("a", 1001, "alice", 100, ["d1"], T0, T0 + 2 * H, 0, "released"),
    usage("b", 1001, "alice", 100, ["d2", "d3"], T0 + H, T0 + 4 * H, 60, "expired"),
    usage("c", 1002, "bob", 200, ["d1"], T0 + 3 * H, T0 + 3.5 * H, 600, "released", idle=900),
    usage("d", 1003, "carol", 100, ["d4"], T0 - 2 * H, T0 + H, 30, "revoked"),
    usage("e", 1004, "dave", 200, ["d2"], T0 + 5 * H, T0 + 6 * H, 5, "active"),
    usage("f", 1005, "erin", 200, ["d3"], T0 - 5 * H, T0 - 4 * H, 9999, "released"),
]


def rows_by_key(report):
    return {row.key: row for row in report.rows}


def test_nearest_rank_percentiles_match_the_benchmarks():
    values = list(range(1, 11))
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 100)) == (5, 9, 10)
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) == 0.0


def test_report_by_user_on_a_known_sequence():
    report = build_report(SEQUENCE, T0, T0 + 6 * H, "user", group_of, None)
    rows = rows_by_key(report)
    assert list(rows) == ["alice", "carol", "dave", "bob"]  # most device-hours first
    alice = rows["alice"]
    assert alice.device_hours == pytest.approx(2 + 2 * 3)
    assert (alice.leases, alice.wait_p50_s, alice.wait_p90_s, alice.wait_max_s) == (2, 0, 60, 60)
    assert alice.end_reasons == {"expired": 1, "released": 1}
    bob = rows["bob"]
    assert (bob.device_hours, bob.idle_device_hours, bob.wait_p50_s) == (pytest.approx(0.5), pytest.approx(0.25), 600)
    assert rows["carol"].device_hours == pytest.approx(1.0)  # clipped at the period's start
    assert rows["dave"].end_reasons == {"active": 1}
    assert "erin" not in rows
    total = report.total
    assert total.device_hours == pytest.approx(10.5)
    assert total.leases == 5
    # waits 0, 5, 30, 60, 600: nearest rank p50 is the 3rd, p90 the 5th
    assert (total.wait_p50_s, total.wait_p90_s, total.wait_max_s) == (30, 600, 600)
    assert sum(total.end_reasons.values()) == total.leases
    assert report.rows_hidden is False


def test_report_by_group_and_device():
    groups = rows_by_key(build_report(SEQUENCE, T0, T0 + 6 * H, "group", group_of, None))
    assert groups["staff"].device_hours == pytest.approx(9.0)
    assert groups["staff"].leases == 3
    assert groups["students"].device_hours == pytest.approx(1.5)
    devices = rows_by_key(build_report(SEQUENCE, T0, T0 + 6 * H, "device", group_of, None))
    assert {k: round(r.device_hours, 6) for k, r in devices.items()} == {"d1": 2.5, "d2": 4.0, "d3": 3.0, "d4": 1.0}
    assert devices["d1"].leases == 2
    assert devices["d2"].end_reasons == {"active": 1, "expired": 1}


def test_report_clips_to_the_period():
    report = build_report(SEQUENCE, T0 + H, T0 + 2 * H, "user", group_of, None)
    rows = rows_by_key(report)
    # a (d1) and b (d2, d3) run the whole hour; carol's ended exactly at its start: not in it
    assert rows["alice"].device_hours == pytest.approx(3.0)
    assert set(rows) == {"alice"}
    assert report.total.leases == 2


def test_by_day_splits_a_lease_across_midnight():
    midnight = day_start(T0 + 24 * H)
    following = day_start(midnight + 36 * H)
    late = usage("n", 1001, "alice", 100, ["d1", "d2"], midnight - 1 * H, midnight + 2 * H, 10, "released")
    instant = usage("z", 1002, "bob", 200, ["d3"], midnight + 3 * H, midnight + 3 * H, 0, "lost")
    report = build_report([late, instant], midnight - 5 * H, following, "day", group_of, None)
    days = [(r.key, round(r.device_hours, 6), r.leases) for r in report.rows]
    first = report.rows[0].key
    assert days == [(first, 2.0, 1), (report.rows[1].key, 4.0, 2)]
    assert first < report.rows[1].key  # oldest day first
    assert report.rows[1].end_reasons == {"lost": 1, "released": 1}
    assert report.total.device_hours == pytest.approx(6.0)
    assert report.total.leases == 2  # the split lease counts once in the total


def test_non_admins_see_totals_and_their_own_rows_only():
    for by in ("user", "group"):
        report = build_report(SEQUENCE, T0, T0 + 6 * H, by, group_of, hide_other_users_for_uid=1002)
        assert [r.leases for r in report.rows] == [1]
        assert report.rows[0].key == ("bob" if by == "user" else "students")
        assert report.rows[0].device_hours == pytest.approx(0.5)  # bob's own leases only
        assert report.total.device_hours == pytest.approx(10.5)
        assert report.rows_hidden is True
    devices = build_report(SEQUENCE, T0, T0 + 6 * H, "device", group_of, hide_other_users_for_uid=1002)
    assert len(devices.rows) == 4
    assert devices.rows_hidden is False


def test_by_lease_each_lease_is_a_row_oldest_first_carrying_the_lease():
    report = build_report(SEQUENCE, T0, T0 + 6 * H, "lease", group_of, None)
    assert [r.key for r in report.rows] == ["d", "a", "b", "c", "e"]  # erin's ended before the period
    row = rows_by_key(report)["b"]
    assert (row.leases, row.device_hours, row.wait_max_s, row.end_reasons) == (1, pytest.approx(6.0), 60,
                                                                               {"expired": 1})
    assert row.lease is SEQUENCE[1]
    mine = build_report(SEQUENCE, T0, T0 + 6 * H, "lease", group_of, hide_other_users_for_uid=1002)
    assert [r.key for r in mine.rows] == ["c"] and mine.rows_hidden is True


def test_report_json_has_the_design_shape():
    doc = report_json(build_report(SEQUENCE, T0, T0 + 6 * H, "user", group_of, None))
    assert {"since", "until", "rows", "total", "by", "rows_hidden"} <= set(doc)
    keys = {"key", "device_hours", "leases", "wait_p50_s", "wait_p90_s", "idle_device_hours", "wait_max_s",
            "end_reasons"}
    assert all(keys <= set(row) for row in [*doc["rows"], doc["total"]])
    assert doc["total"]["leases"] == 5


# -- the hook on a real database -----------------------------------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def lease(lease_id: str, uid: int, devices: tuple[str, ...], granted: float, requested: float = 0.0) -> Lease:
    holder = Holder(uid, 100, 4000 + uid, 1, f"user{uid}", "train.py")
    return Lease(id=lease_id, holder=holder, devices=devices, backend="cuda", granted_at=granted,
                 requested_at=requested)


def end(item: Lease, at: float, state: str = RELEASED) -> Lease:
    item.state, item.ended_at, item.end_reason = state, at, "test"
    return item


def make(state_dir: Path, clock: Clock, **kwargs) -> Accounting:
    config = kwargs.pop("config", Config(state_dir=state_dir))
    accounting = Accounting(state_dir, lambda: config, clock=clock, **kwargs)
    accounting.restored([])
    return accounting


def close(accounting: Accounting) -> None:
    accounting._writer.close()


def test_live_leases_are_reported_mid_lease_and_ended_ones_survive_a_reopen(tmp_path):
    clock = Clock(T0)
    acc = make(tmp_path, clock)
    one = lease("l-1", 1001, ("d1", "d2"), T0, requested=T0 - 120)
    acc.granted(one)
    clock.now = T0 + H
    mid = acc.report(T0 - H, 0, "user", 0, True)
    assert (mid.total.device_hours, mid.total.end_reasons, mid.total.wait_max_s) == (
        pytest.approx(2.0), {"active": 1}, 120)
    clock.now = T0 + 2 * H
    acc.ended(end(one, T0 + 2 * H, EXPIRED))
    assert acc.report(T0 - H, 0, "user", 0, True).total.end_reasons == {"expired": 1}
    close(acc)
    again = make(tmp_path, clock)
    after = again.report(T0 - H, 0, "user", 0, True)
    assert after.total.device_hours == pytest.approx(4.0)
    assert after.rows[0].key == "user1001"
    close(again)


def test_a_lease_keeps_its_time_limit_and_an_older_file_gains_the_column(tmp_path):
    import sqlite3

    old = sqlite3.connect(tmp_path / "accounting.db")  # the table as it was before time limits were kept
    old.executescript("CREATE TABLE usage (lease_id TEXT PRIMARY KEY, uid INTEGER NOT NULL, user TEXT NOT NULL, "
                      "gid INTEGER NOT NULL, devices TEXT NOT NULL, granted_at REAL NOT NULL, ended_at REAL NOT NULL, "
                      "wait_s REAL NOT NULL, state TEXT NOT NULL, end_reason TEXT NOT NULL, reservation INTEGER "
                      "NOT NULL, util_mean_pct REAL, idle_device_s REAL);"
                      f"INSERT INTO usage VALUES ('l-old', 1001, 'user1001', 100, '[\"d1\"]', {T0}, {T0 + H}, 0, "
                      "'released', '', 0, NULL, NULL);")
    old.close()
    clock = Clock(T0 + 3 * H)
    acc = make(tmp_path, clock)
    limited = lease("l-new", 1001, ("d2",), T0 + H)
    limited.time_limit_s = 2 * H
    acc.granted(limited)
    acc.ended(end(limited, T0 + 2 * H))
    rows = rows_by_key(acc.report(T0, 0, "lease", 0, True))
    assert (rows["l-old"].lease.time_limit_s, rows["l-new"].lease.time_limit_s) == (0.0, 2 * H)
    close(acc)


def test_a_lease_the_store_saw_end_is_filled_in_after_a_crash(tmp_path):
    clock = Clock(T0 + H)
    missed = end(lease("l-missed", 1001, ("d1",), T0), T0 + 0.5 * H)
    acc = make(tmp_path, clock, recently_ended=lambda: [missed])
    report = acc.report(T0, 0, "user", 0, True)
    assert (report.total.leases, report.total.device_hours) == (1, pytest.approx(0.5))
    close(acc)


def test_pruning_drops_old_rows_keeps_live_leases_and_bounds_the_rows(tmp_path):
    clock = Clock(T0)
    config = replace(Config(state_dir=tmp_path), accounting_max_rows=1000)
    acc = make(tmp_path, clock, config=config)
    day = 86400.0
    ancient = end(lease("l-ancient", 1001, ("d1",), T0 - 402 * day), T0 - 401 * day)
    acc.ended(ancient)
    running = lease("l-running", 1002, ("d2",), T0 - 500 * day)  # granted long ago, still held
    acc.granted(running)
    for i in range(1002):
        acc.ended(end(lease(f"l-{i}", 1003, ("d3",), T0 - 300 * day + i), T0 - 300 * day + i + 1))
    assert acc.prune().result() == 1 + 2  # the ancient row, then the two oldest above the ceiling
    everything = acc.report(T0 - 600 * day, T0 + 1, "user", 0, True)
    by_user = rows_by_key(everything)
    assert by_user["user1003"].leases == 1000 and "user1001" not in by_user
    assert by_user["user1002"].end_reasons == {"active": 1}  # the live lease is never pruned
    close(acc)
    conn = sqlite3.connect(tmp_path / DB_NAME)
    assert conn.execute("SELECT COUNT(*) FROM usage").fetchone() == (1000,)
    assert conn.execute("SELECT COUNT(*) FROM usage WHERE lease_id IN ('l-0', 'l-1')").fetchone() == (0,)
    conn.close()


def test_utilisation_is_sampled_at_each_probe_refresh(tmp_path):
    clock = Clock(T0)
    readings = {"d1": 0, "d2": 80}

    def snapshot() -> Snapshot:
        return Snapshot(tuple(Device(index=i, uuid=u, vendor="cpu", name=u, memory_mib=1, backend="cpu",
                                     extra={"utilization_gpu_pct": pct})
                              for i, (u, pct) in enumerate(readings.items())))

    current = [snapshot()]
    acc = make(tmp_path, clock, snapshot=lambda: current[0],
               config=replace(Config(state_dir=tmp_path), probe_interval_s=10.0))
    held = lease("l-u", 1001, ("d1", "d2"), T0)
    acc.granted(held)
    acc.sample()  # the first refresh only starts the clock
    for _ in range(3):
        clock.now += 10
        current[0] = snapshot()
        acc.sample()
    acc.sample()  # the same snapshot again: no new reading, nothing counted twice
    clock.now += 5
    acc.ended(end(held, clock.now))
    close(acc)
    conn = sqlite3.connect(tmp_path / DB_NAME)
    util, idle = conn.execute("SELECT util_mean_pct, idle_device_s FROM usage WHERE lease_id='l-u'").fetchone()
    conn.close()
    assert (util, idle) == (pytest.approx(40.0), pytest.approx(30.0))  # d1 idle 30 s, d2 busy


def test_who_sees_other_users_rows(tmp_path):
    clock = Clock(T0 + H)
    acc = make(tmp_path, clock)
    for uid in (1001, 1002):
        acc.ended(end(lease(f"l-{uid}", uid, ("d1",), T0), T0 + 0.5 * H))
    mine = acc.report(T0, 0, "user", viewer_uid=1002, viewer_is_admin=False)
    assert ([r.key for r in mine.rows], mine.rows_hidden, mine.total.leases) == (["user1002"], True, 2)
    admin = acc.report(T0, 0, "user", viewer_uid=1002, viewer_is_admin=True)
    assert (len(admin.rows), admin.rows_hidden) == (2, False)
    close(acc)
    shared = make(tmp_path, clock, config=replace(Config(state_dir=tmp_path), accounting_per_user_report="everyone"))
    assert len(shared.report(T0, 0, "user", viewer_uid=1002, viewer_is_admin=False).rows) == 2
    close(shared)


def test_an_unreadable_file_is_moved_aside_not_fatal(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"this is not sqlite" * 100)
    clock = Clock(T0)
    acc = make(tmp_path, clock)
    acc.ended(end(lease("l-1", 1001, ("d1",), T0 - 60), T0))
    assert acc.report(T0 - H, T0 + 1, "user", 0, True).total.leases == 1
    close(acc)
    assert len(list(tmp_path.glob(f"{DB_NAME}.unreadable-*"))) == 1


def test_config_keys_are_validated(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text('[accounting]\nkeep = "30d"\nmax_rows = 5000\nper_user_report = "everyone"\n'
                    '[metrics]\nlisten = "9464"\nhpc_job_mapping_dir = "/run/dcgm-job-map"\n')
    config = load_config(path)
    assert (config.accounting_keep_s, config.accounting_max_rows, config.accounting_per_user_report) == (
        30 * 86400, 5000, "everyone")
    assert (config.metrics_listen, config.metrics_job_mapping_dir) == ("127.0.0.1:9464", Path("/run/dcgm-job-map"))
    for bad in ('[accounting]\nkeep = "1h"', '[accounting]\nmax_rows = 10', '[accounting]\nmax_rows = "many"',
                '[accounting]\nper_user_report = "nobody"', '[metrics]\nlisten = "localhost"',
                '[metrics]\nhpc_job_mapping_dir = "relative/dir"'):
        path.write_text(bad + "\n")
        with pytest.raises(ConfigError):
            load_config(path)


def test_pruning_gives_the_space_back_to_the_disk(tmp_path):
    clock = Clock(T0)
    acc = make(tmp_path, clock)
    for i in range(3000):
        acc.ended(end(lease(f"l-old-{i}", 1001, ("d1",), T0 - 500 * 86400 + i), T0 - 450 * 86400 + i))

    def size() -> int:
        acc._writer.submit(lambda conn: None).result()  # what is queued is committed: the checkpoint runs alone
        acc._writer.submit(lambda conn: conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()).result()
        return (tmp_path / DB_NAME).stat().st_size

    full = size()
    assert acc.prune().result() == 3000
    assert size() < full / 4
    close(acc)


def test_the_writer_thread_outlives_a_caller_that_leaves(tmp_path):
    """Issue 31 item 5: a report whose caller left (its future cancelled) used to make the
    writer set the result of a cancelled future, which raised and ended the thread."""
    import threading

    from brokerd.state.accounting_writer import AccountingWriter

    writer = AccountingWriter(sqlite3.connect(tmp_path / "w.db", isolation_level=None, check_same_thread=False))
    busy, ran = threading.Event(), []
    try:
        writer.submit(lambda conn: busy.wait(10))  # the thread is busy with someone's report
        left = writer.submit(lambda conn: ran.append("left"))
        assert left.cancel()  # its caller gave up while it waited
        started = writer.submit(lambda conn: busy.wait(10) and "started")
        busy.set()
        assert started.result(10) == "started" and not started.cancel()  # running: no longer cancellable
        assert writer.submit(lambda conn: conn.execute("SELECT 1").fetchone()[0]).result(10) == 1
        assert ran == []  # the work of the caller that left was never done
        # An operation that fails gets its error; the thread goes on with the next one.
        failed = writer.submit(lambda conn: conn.execute("BEGIN"))  # the writer's own BEGIN is already open
        with pytest.raises(sqlite3.OperationalError):
            failed.result(10)
        assert writer.submit(lambda conn: "still here").result(10) == "still here"
    finally:
        writer.close()

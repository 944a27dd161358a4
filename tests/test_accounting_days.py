"""Accounting at scale (issue 46): reports read day summaries for the whole days of a period
(brokerd/state/usage_days.py) and must give the figures the rows give; an export reads the
rows in pages, so one of more leases than one gRPC message holds comes out whole; reports
are bounded per user; `--since 1y` is a duration."""

from __future__ import annotations

import csv
import io
import random
import sqlite3
from dataclasses import replace

import pytest

from brokerd.config.loader import Config
from brokerd.leasing.errors import Busy
from brokerd.leasing.model import RELEASED
from brokerd.state.accounting import DB_NAME, _group_names, fill
from brokerd.state.accounting_read import PER_USER, Reads
from brokerd.state.report import UsageRow, build_report, day_start
from brokerd.state.usage_rows import COLUMNS, MARKS, values
from tests.test_accounting import GROUPS, Clock, close, end, lease, make
from vaccel_common.units import parse_duration

H = 3600.0
DAY = 86400.0
NOW = day_start(1736899200.0) + 15.5 * H  # mid-afternoon, local time
STATES = ("released", "expired", "holder_exited", "revoked")


def random_rows(n: int, days: int, seed: int = 7) -> list[UsageRow]:
    """Leases over `days` days before NOW: short ones, ones across midnight, ones that
    lasted no time, memory shares, some with idle time."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        granted = NOW - rng.random() * days * DAY
        length = rng.choice((0.0, rng.random() * 2 * H, rng.random() * 30 * H))
        devices = tuple(rng.sample(["d1", "d2", "d3", "d4"], rng.choice((1, 1, 2))))
        uid = 1001 + rng.randrange(6)
        rows.append(UsageRow(
            lease_id=f"l-{i:05d}", uid=uid, user=f"user{uid}", gid=rng.choice(list(GROUPS)), devices=devices,
            granted_at=granted, ended_at=min(granted + length, NOW), wait_s=rng.choice((0.0, rng.random() * 900)),
            state=rng.choice(STATES), idle_device_s=rng.choice((None, rng.random() * 60)),
            weight=rng.choice((None, None, 0.25))))
    return rows


def assert_same(summed, expected) -> None:
    """Equal figures; percentiles from the summaries' 1 % buckets within 0.5 %."""
    assert [r.key for r in summed.rows] == [r.key for r in expected.rows]
    assert summed.rows_hidden == expected.rows_hidden
    for got, want in zip([*summed.rows, summed.total], [*expected.rows, expected.total], strict=True):
        assert (got.key, got.leases, got.end_reasons) == (want.key, want.leases, want.end_reasons)
        assert got.device_hours == pytest.approx(want.device_hours, rel=1e-9, abs=1e-9)
        assert got.idle_device_hours == pytest.approx(want.idle_device_hours, rel=1e-9, abs=1e-9)
        assert got.wait_max_s == pytest.approx(want.wait_max_s, rel=1e-9)
        assert got.wait_p50_s == pytest.approx(want.wait_p50_s, rel=0.005, abs=0.001)
        assert got.wait_p90_s == pytest.approx(want.wait_p90_s, rel=0.005, abs=0.001)


# A year's report in short: whole months (December), whole days, and edges inside days.
PERIODS = [(NOW - 70 * DAY, NOW), (NOW - 30 * DAY, NOW), (NOW - 20.3 * DAY, NOW - 3.7 * DAY),
           (day_start(NOW - 10 * DAY), day_start(NOW))]


def check_reports(acc, rows: list[UsageRow]) -> None:
    for since, until in PERIODS:
        for by in ("user", "group", "day"):
            for viewer, admin in ((0, True), (1003, False)):
                expected = build_report(rows, since, until, by, _group_names(), None if admin else viewer)
                assert_same(acc.report(since, until, by, viewer, admin), expected)


def test_reports_from_day_summaries_equal_the_rows_through_ends_replacements_and_pruning(tmp_path):
    rows = random_rows(1500, 75)
    clock = Clock(NOW)
    config = Config(state_dir=tmp_path)
    acc = make(tmp_path, clock, config=config)
    for row in rows:  # through the lease's end, as the daemon writes them
        item = lease(row.lease_id, row.uid, row.devices, row.granted_at, requested=row.granted_at - row.wait_s)
        item.holder = replace(item.holder, gid=row.gid)
        if row.weight is not None:
            item.share_mib, item.share_of_mib = 1024, 4096  # a quarter of its device
        acc.ended(end(item, row.ended_at, row.state))
    rows = [replace(r, end_reason="test", idle_device_s=None) for r in rows]  # as the hook records them
    check_reports(acc, rows)
    conn = sqlite3.connect(tmp_path / DB_NAME)
    assert conn.execute("SELECT COUNT(*) FROM usage_day").fetchone()[0] > 0  # the summaries were used
    conn.close()

    # A lease recorded again (its end written twice) replaces its row and its day's figures.
    again = rows[10]
    item = lease(again.lease_id, again.uid, again.devices, again.granted_at, requested=again.granted_at)
    item.holder = replace(item.holder, gid=again.gid)
    acc.ended(end(item, again.granted_at + H / 2, RELEASED))
    rows[10] = replace(again, ended_at=again.granted_at + H / 2, wait_s=0.0, state=RELEASED, weight=None)
    check_reports(acc, rows)

    # Pruning to a ceiling drops the oldest rows and their days' figures with them.
    config.__dict__["accounting_max_rows"] = 1000
    acc.prune().result()
    kept = sorted(rows, key=lambda r: r.ended_at)[-1000:]
    check_reports(acc, kept)
    close(acc)


def test_a_file_from_before_the_summaries_gains_them_and_reports_the_same(tmp_path):
    rows = random_rows(800, 20, seed=3)
    fill(tmp_path, rows)
    conn = sqlite3.connect(tmp_path / DB_NAME)  # as an older daemon left it: no summaries
    conn.executescript("DELETE FROM meta WHERE key = 'days'; DROP TABLE usage_day;")
    conn.close()
    acc = make(tmp_path, Clock(NOW))
    check_reports(acc, rows)
    close(acc)
    # An older daemon that knows no summaries writes a row: the next start sums again.
    late = replace(rows[0], lease_id="l-late", granted_at=NOW - 5.2 * DAY, ended_at=NOW - 5.1 * DAY)
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute(f"INSERT INTO usage ({COLUMNS}) VALUES ({MARKS})", values(late))
    conn.commit()
    conn.close()
    acc = make(tmp_path, Clock(NOW))
    check_reports(acc, [*rows, late])
    close(acc)
    conn = sqlite3.connect(tmp_path / DB_NAME)
    assert conn.execute("SELECT value FROM meta WHERE key = 'days'").fetchone() == ("1",)
    conn.close()


def test_reports_are_bounded_per_user(tmp_path):
    reads = Reads(tmp_path / DB_NAME)
    with reads.admitted(1001), reads.admitted(1001):
        assert PER_USER == 2
        with pytest.raises(Busy, match="reports of yours"), reads.admitted(1001):
            pass
        with reads.admitted(1002):  # another user is not held up
            pass
    with reads.admitted(1001):  # and the first user's share is back
        pass
    reads.close()


def test_a_year_and_a_week_are_durations():
    assert parse_duration("1y") == 365 * DAY
    assert parse_duration("2w") == 14 * DAY
    assert parse_duration("1y2w") == 379 * DAY


LEASES = 60_000  # about 6 MB by lease: more than gRPC's 4 MiB in one message


def test_an_export_of_more_leases_than_one_message_holds_is_complete(start_broker):
    import shutil
    import tempfile
    import time
    from pathlib import Path

    now = time.time()
    start = now - 300 * DAY
    rows = [UsageRow(lease_id=f"x-{i:06d}", uid=1001 + i % 20, user=f"user{1001 + i % 20}", gid=100,
                     devices=("GPU-sim-0",), granted_at=start + i * 400, ended_at=start + i * 400 + 300,
                     wait_s=float(i % 97), state="released")
            for i in range(LEASES)]
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-"))
    try:
        assert fill(workdir / "state", rows) == LEASES
        broker = start_broker(workdir=workdir)
        exported = broker.vaccel("report", "--by", "lease", "--csv", "--since", "1y", timeout=600)
        assert exported.returncode == 0, exported.stderr[-2000:]
        lines = list(csv.reader(io.StringIO(exported.stdout)))
        assert lines[0][:2] == ["key", "user"]
        assert [line[0] for line in lines[1:]] == [r.lease_id for r in rows]  # every lease, oldest first, once
        assert {line[1] for line in lines[1:]} == {r.user for r in rows}
        summed = broker.vaccel("report", "--json", "--since", "1y", timeout=600)
        assert summed.returncode == 0, summed.stderr
        import json

        total = json.loads(summed.stdout)["total"]
        assert (total["leases"], total["device_hours"]) == (LEASES, pytest.approx(LEASES * 300 / H))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_an_exports_rows_are_the_reports_rows_by_lease():
    from brokerd.state.report import clip, lease_row

    rows = random_rows(400, 10, seed=5)
    since, until = NOW - 6.5 * DAY, NOW - DAY
    expected = build_report(rows, since, until, "lease", _group_names(), None).rows
    made = [lease_row(r, *clip(r, since, until)) for r in sorted(rows, key=lambda r: (r.granted_at, r.lease_id))
            if clip(r, since, until) is not None]
    assert made == list(expected)

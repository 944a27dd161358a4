"""Accounting of memory shares (issue 35): a share's device-hours are weighted by its part
of the device, live and ended, in every breakdown; an accounting file from before shares
(schema 1) opens, migrated in place, with its rows."""

from __future__ import annotations

import sqlite3
from dataclasses import replace

import pytest

from brokerd.state.accounting import DB_NAME, SCHEMA_VERSION
from brokerd.state.report import build_report
from tests.test_accounting import T0, Clock, H, close, end, group_of, lease, make, usage


def test_a_share_counts_its_part_of_the_device_in_every_breakdown():
    quarter = replace(usage("s", 1001, "alice", 100, ["d1"], T0, T0 + 4 * H, 0, "released"), weight=0.25)
    whole = usage("w", 1002, "bob", 200, ["d2"], T0, T0 + H, 0, "released")
    for by in ("user", "group", "device", "day"):
        report = build_report([quarter, whole], T0, T0 + 6 * H, by, group_of, None)
        assert report.total.device_hours == pytest.approx(2.0), by
    by_user = {row.key: row.device_hours for row in build_report([quarter, whole], T0, T0 + 6 * H, "user",
                                                                 group_of, None).rows}
    assert by_user == {"alice": pytest.approx(1.0), "bob": pytest.approx(1.0)}


def test_share_leases_are_recorded_with_their_weight_live_and_after_a_reopen(tmp_path):
    clock = Clock(T0)
    acc = make(tmp_path, clock)
    share = replace(lease("l-s", 1001, ("d1",), T0), share_mib=20480, share_of_mib=81920)
    acc.granted(share)
    clock.now = T0 + 2 * H
    assert acc.report(T0, 0, "user", 0, True).total.device_hours == pytest.approx(0.5)
    acc.ended(end(share, T0 + 2 * H))
    close(acc)
    again = make(tmp_path, clock)
    assert again.report(T0, 0, "user", 0, True).total.device_hours == pytest.approx(0.5)
    close(again)


def test_a_schema_1_accounting_file_is_migrated_and_keeps_its_rows(tmp_path):
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE usage (lease_id TEXT PRIMARY KEY, uid INTEGER NOT NULL, user TEXT NOT NULL,
            gid INTEGER NOT NULL, devices TEXT NOT NULL, granted_at REAL NOT NULL, ended_at REAL NOT NULL,
            wait_s REAL NOT NULL, state TEXT NOT NULL, end_reason TEXT NOT NULL, reservation INTEGER NOT NULL,
            util_mean_pct REAL, idle_device_s REAL);
        INSERT INTO meta VALUES ('schema_version', '1');
    """)
    conn.execute("INSERT INTO usage VALUES ('old', 1001, 'alice', 100, '[\"d1\", \"d2\"]', ?, ?, 0, 'released', "
                 "'', 0, NULL, NULL)", (T0, T0 + H))
    conn.commit()
    conn.close()
    acc = make(tmp_path, Clock(T0 + 2 * H))
    report = acc.report(T0, 0, "user", 0, True)
    assert (report.total.leases, report.total.device_hours) == (1, pytest.approx(2.0))
    close(acc)
    conn = sqlite3.connect(tmp_path / DB_NAME)
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    conn.close()
    assert list(tmp_path.glob("*.unreadable-*")) == []

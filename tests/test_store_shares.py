"""The store and memory shares (issue 35): a share lease is kept with its share and no
device holding (several shares live on one device), and a file of the schema before
shares (version 3) opens, migrated in place, with its leases whole."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

from brokerd.state.store import DB_NAME, SCHEMA_VERSION
from tests.test_store import make_lease, raw, reopen, saved_store


def share(lease_id: str, device: str, mib: int) -> object:
    return dataclasses.replace(make_lease(lease_id, device), share_mib=mib, share_of_mib=81920, reservation=False)


def test_shares_on_one_device_are_kept_with_their_size_and_hold_no_device_row(tmp_path: Path) -> None:
    whole = make_lease("l-whole", "GPU-0")
    saved_store(tmp_path, whole, share("l-a", "GPU-3", 20480), share("l-b", "GPU-3", 10240))
    active, _, _ = reopen(tmp_path)
    by_id = {lease.id: lease for lease in active}
    assert {i: (lease.devices, lease.share_mib, lease.share_of_mib) for i, lease in by_id.items()} == {
        "l-whole": (("GPU-0",), 0, 0), "l-a": (("GPU-3",), 20480, 81920), "l-b": (("GPU-3",), 10240, 81920)}
    assert by_id["l-a"].weight == 0.25 and by_id["l-whole"].weight == 1.0
    assert raw(tmp_path, "SELECT device_uuid, lease_id FROM holdings") == [("GPU-0", "l-whole")]


# The leases table as schema version 3 made it (before shares), with a live lease in it.
_V3 = """CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE leases (id TEXT PRIMARY KEY, state TEXT NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    pid INTEGER NOT NULL, start_time INTEGER NOT NULL, user TEXT NOT NULL, command TEXT NOT NULL,
    devices TEXT NOT NULL, backend TEXT NOT NULL, granted_at REAL NOT NULL, expires_at REAL NOT NULL,
    ended_at REAL NOT NULL DEFAULT 0, end_reason TEXT NOT NULL DEFAULT '', terms TEXT NOT NULL,
    warnings TEXT NOT NULL, simulated INTEGER NOT NULL, members TEXT NOT NULL DEFAULT '[]',
    requested_at REAL NOT NULL DEFAULT 0, reservation INTEGER NOT NULL DEFAULT 0,
    notice TEXT NOT NULL DEFAULT '', time_limit_s REAL NOT NULL DEFAULT 0,
    ending_state TEXT NOT NULL DEFAULT '', request_key TEXT NOT NULL DEFAULT '');
CREATE TABLE holdings (device_uuid TEXT PRIMARY KEY, lease_id TEXT NOT NULL REFERENCES leases(id));
CREATE TABLE drained (device_uuid TEXT PRIMARY KEY, reason TEXT NOT NULL);
CREATE TABLE queue (id TEXT PRIMARY KEY, request_key TEXT NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    pid INTEGER NOT NULL, start_time INTEGER NOT NULL, user TEXT NOT NULL, command TEXT NOT NULL,
    since REAL NOT NULL, deadline REAL NOT NULL, spec BLOB NOT NULL, lease_id TEXT NOT NULL DEFAULT '');
INSERT INTO meta VALUES ('schema_version', '3');
INSERT INTO leases VALUES ('l-v3', 'active', 1000, 1000, 4242, 777, 'ada', 'python train.py', '["GPU-1"]',
    'cuda', 1700000000.5, 0, 0, '', '{}', '[]', 0, '[]', 1699999999.0, 0, '', 3600, '', 'key-1');
INSERT INTO holdings VALUES ('GPU-1', 'l-v3');
"""


def test_a_version_3_file_opens_migrated_and_its_lease_holds_its_device_whole(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.executescript(_V3)
    conn.close()
    active, _, _ = reopen(tmp_path)
    assert [(lease.id, lease.devices, lease.share_mib, lease.time_limit_s, lease.request_key) for lease in active] \
        == [("l-v3", ("GPU-1",), 0, 3600.0, "key-1")]
    assert raw(tmp_path, "SELECT value FROM meta WHERE key='schema_version'") == [(str(SCHEMA_VERSION),)]
    assert SCHEMA_VERSION == 6  # 6: borrowed leases ([policy] lend_idle)
    saved_store(tmp_path, share("l-new", "GPU-3", 4096))  # and the migrated file takes shares
    assert sorted((lease.id, lease.share_mib) for lease in reopen(tmp_path)[0]) == [("l-new", 4096), ("l-v3", 0)]

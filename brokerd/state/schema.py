"""The lease database's tables, its schema version, and how an older file is brought up to it.

Each version adds columns in place (ALTER TABLE ... ADD COLUMN, with defaults that read
as "none"), so an older file opens migrated in one transaction, all or nothing.
"""

from __future__ import annotations

import logging
import sqlite3

log = logging.getLogger("vaccel.brokerd")

SCHEMA_VERSION = 6
# Columns each older version lacks, added in place at start-up (after the read-only checks).
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "ALTER TABLE leases ADD COLUMN requested_at REAL NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN reservation INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN notice TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE leases ADD COLUMN time_limit_s REAL NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN ending_state TEXT NOT NULL DEFAULT ''",
    ),
    2: ("ALTER TABLE leases ADD COLUMN request_key TEXT NOT NULL DEFAULT ''",),
    3: ("ALTER TABLE leases ADD COLUMN container TEXT NOT NULL DEFAULT ''",),
    4: ("ALTER TABLE leases ADD COLUMN share_mib INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN share_of_mib INTEGER NOT NULL DEFAULT 0"),
    5: ("ALTER TABLE leases ADD COLUMN borrowed INTEGER NOT NULL DEFAULT 0",),
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    uid INTEGER NOT NULL, gid INTEGER NOT NULL, pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL, user TEXT NOT NULL, command TEXT NOT NULL,
    devices TEXT NOT NULL, backend TEXT NOT NULL,
    granted_at REAL NOT NULL, expires_at REAL NOT NULL,
    ended_at REAL NOT NULL DEFAULT 0, end_reason TEXT NOT NULL DEFAULT '',
    terms TEXT NOT NULL, warnings TEXT NOT NULL, simulated INTEGER NOT NULL,
    members TEXT NOT NULL DEFAULT '[]',
    requested_at REAL NOT NULL DEFAULT 0, reservation INTEGER NOT NULL DEFAULT 0,
    notice TEXT NOT NULL DEFAULT '', time_limit_s REAL NOT NULL DEFAULT 0,
    ending_state TEXT NOT NULL DEFAULT '', request_key TEXT NOT NULL DEFAULT '',
    container TEXT NOT NULL DEFAULT '',
    share_mib INTEGER NOT NULL DEFAULT 0, share_of_mib INTEGER NOT NULL DEFAULT 0,
    borrowed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS holdings (
    device_uuid TEXT PRIMARY KEY,
    lease_id TEXT NOT NULL REFERENCES leases(id)
);
CREATE INDEX IF NOT EXISTS leases_state ON leases(state);
-- A lease's end finds its holdings and its queue row (queue_lease, below) by lease id:
-- without these indexes, a pass over every row (every waiting request's, ~75 us at 500)
-- in the transaction the next waiter's grant shares. Made on every open, so older files
-- get them too; an older daemon opening the file keeps them up to date unknowing.
CREATE INDEX IF NOT EXISTS holdings_lease ON holdings(lease_id);
CREATE TABLE IF NOT EXISTS drained (device_uuid TEXT PRIMARY KEY, reason TEXT NOT NULL);
-- The wait queue, in rowid order. A granted request keeps its row (with lease_id) until
-- its waiter has the grant, so a waiter cut off by a restart still finds it.
CREATE TABLE IF NOT EXISTS queue (
    id TEXT PRIMARY KEY, request_key TEXT NOT NULL,
    uid INTEGER NOT NULL, gid INTEGER NOT NULL, pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL, user TEXT NOT NULL, command TEXT NOT NULL,
    since REAL NOT NULL, deadline REAL NOT NULL, spec BLOB NOT NULL,
    lease_id TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS queue_lease ON queue(lease_id);
"""


def migrate(conn: sqlite3.Connection, found: int) -> None:
    """Bring a file of schema version `found` up to SCHEMA_VERSION in one transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for version in range(found, SCHEMA_VERSION):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
        conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    log.info("lease database migrated from schema version %d to %d", found, SCHEMA_VERSION)

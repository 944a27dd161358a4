"""A lease's accounting row as the `usage` table stores it: its columns, a row's values for
them, and a stored row read back (brokerd/state/accounting.py writes them, usage_days.py
sums them per day, accounting_read.py reads them for reports)."""

from __future__ import annotations

import json

from brokerd.state.report import UsageRow

COLUMNS = ("lease_id, uid, user, gid, devices, granted_at, ended_at, wait_s, state, end_reason, "
           "reservation, util_mean_pct, idle_device_s, weight, time_limit_s")
MARKS = ",".join("?" * 15)


def values(row: UsageRow) -> tuple:
    return (row.lease_id, row.uid, row.user, row.gid, json.dumps(list(row.devices)), row.granted_at,
            row.ended_at, row.wait_s, row.state, row.end_reason, int(row.reservation), row.util_mean_pct,
            row.idle_device_s, row.weight, row.time_limit_s)


def from_db(r: tuple, devices: dict[str, tuple[str, ...]]) -> UsageRow:
    """A stored row. A year's report decodes 100,000 of these: positional, in COLUMNS
    order, and each distinct device list decoded once (`devices`, a host has few)."""
    held = devices.get(r[4])
    if held is None:
        held = devices[r[4]] = tuple(json.loads(r[4]))
    return UsageRow(r[0], r[1], r[2], r[3], held, *r[5:10], bool(r[10]), r[11], r[12], r[13], r[14])

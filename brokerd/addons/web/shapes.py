"""What the dashboard serves, as JSON-ready data: the status (exactly `vaccel status --json`),
a 24 h timeline of who held which device, and the usage report (exactly `vaccel report
--json`, where the daemon keeps accounting). The page is anonymous: everything here is
what any local user already sees, asked for as one of them. So other users' history (who
held a device before now, their lease ids, their usage) is shown only where the lab made
usage public (`[accounting] per_user_report = "everyone"`); otherwise the timeline's past
spans say only that the device was in use, as `vaccel status` said to anyone at the time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from brokerd.base.process import Identity
from brokerd.core.plugins import Reporter
from brokerd.core.service import BrokerService
from brokerd.edge.messages import status_reply
from brokerd.state.report import report_json
from vaccel_common.status_json import status_json

log = logging.getLogger("vaccel.brokerd")

# Not root, not the daemon's own user, in no admin group: the view every local user gets.
ANONYMOUS = Identity(uid=65534, gid=65534, pid=0, start_time=0)
REPORT_BY = ("user", "group", "device", "day")
REPORT_CACHE_S = 10.0  # a page reloaded in a loop must not make the daemon add up its history each time
MAX_TIMELINE_HOURS = 7 * 24


def status(service: BrokerService) -> dict[str, Any]:
    """The `vaccel status --json` shape, as a local user who is not an admin sees it."""
    return status_json(status_reply(service, ANONYMOUS))


def usage_is_public(service: BrokerService) -> bool:
    """Whether the lab shows everyone who used what (docs/accounting.md, "Who sees what")."""
    return service.config.accounting_per_user_report == "everyone"


def timeline(service: BrokerService, hours: float, now: float | None = None, *, personal: bool) -> dict[str, Any]:
    """Who held each present device when, over the last `hours`: the recent ended leases
    the manager keeps (restored from the store at start) plus the active ones, which have
    no end yet (null). Without `personal`, an ended lease's span names no user and no
    lease (""): the current holders are what `vaccel status` shows everyone, the past ones
    are other users' history."""
    now = time.time() if now is None else now
    since = now - hours * 3600
    manager = service.manager
    devices = sorted(manager.devices.values(), key=lambda d: (d.index, d.mig_index))
    spans: dict[str, list[dict[str, Any]]] = {d.uuid: [] for d in devices}
    for lease in [*manager.ended.values(), *manager.leases.values()]:
        end = lease.ended_at if not lease.active else None
        if end is not None and end < since:
            continue
        for uuid in lease.devices:
            if uuid in spans:
                named = personal or lease.active
                spans[uuid].append({"user": (lease.holder.user or str(lease.holder.uid)) if named else "",
                                    "lease_id": lease.id if named else "", "start": max(lease.granted_at, since),
                                    "end": end})
    return {
        "since": since,
        "until": now,
        "devices": [{"index": d.index, "label": d.label, "uuid": d.uuid,
                     "spans": sorted(spans[d.uuid], key=lambda s: s["start"])} for d in devices],
    }


class ReportSource:
    """The usage report through the accounting (brokerd/state/accounting.py), when the daemon
    keeps one, shaped by brokerd/state/report.py's `report_json`. Results are cached per
    question for a few seconds."""

    def __init__(self, accounting: Reporter | None, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.accounting = accounting
        self._clock = clock
        self._cache: dict[tuple[float, str], tuple[float, dict[str, Any]]] = {}

    def available(self) -> bool:
        return self.accounting is not None

    async def report(self, since_s: float, by: str) -> dict[str, Any] | None:
        """The report of the last `since_s` seconds grouped `by`; None without accounting.
        The query runs on the accounting's own thread (`areport`), never on the loop."""
        accounting = self.accounting
        if accounting is None:
            return None
        key = (since_s, by)
        cached = self._cache.get(key)
        if cached is not None and self._clock() - cached[0] < REPORT_CACHE_S:
            return cached[1]
        until = time.time()
        shaped = report_json(await accounting.areport(since=until - since_s, until=until, by=by,
                                                      viewer_uid=ANONYMOUS.uid, viewer_is_admin=False))
        if len(self._cache) > 64:  # the keys come from query strings: keep them few
            self._cache.clear()
        self._cache[key] = (self._clock(), shaped)
        return shaped

"""Keep the device picture current and honest: re-probe on a timer (off the event loop),
distrust a probe that suddenly finds nothing until that persists (at start-up as on every
refresh: one ProbeDoubt rule), and (if configured) signal GPU processes that hold no lease.
Which processes belong to a lease is the core's to say (brokerd/core/inventory.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable

from brokerd.base.journal import log_event
from brokerd.devices.model import Snapshot
from brokerd.devices.occupancy import Occupancy, to_signal

log = logging.getLogger("vaccel.brokerd")

PROBE_FAILURES_BEFORE_BELIEVED = 3


class ProbeDoubt:
    """A probe that worked a moment ago and now misses devices is usually a transient
    driver hiccup: ending every lease on them would be worse. Believe it only when it
    persists for PROBE_FAILURES_BEFORE_BELIEVED probes in a row."""

    def __init__(self) -> None:
        self.failures = 0

    def believe(self, missing: list[str]) -> bool:
        """Whether to adopt a snapshot that misses `missing` (vendors or devices)."""
        if not missing:
            self.failures = 0
            return True
        self.failures += 1
        if self.failures < PROBE_FAILURES_BEFORE_BELIEVED:
            log.warning("the probe missed %s this time; not believing it yet", ", ".join(missing))
            return False
        self.failures = 0
        return True


async def boot_snapshot(refresh: Callable[[], Snapshot], held: set[str], pause_s: float) -> Snapshot:
    """The first picture, under the same rule as every refresh: the state says leases
    hold `held`, so a probe that misses some of them is believed only once it persists.
    Probes run in an executor (they block)."""
    loop = asyncio.get_running_loop()
    doubt = ProbeDoubt()
    while True:
        snapshot = await loop.run_in_executor(None, refresh)
        if doubt.believe(sorted(held - {d.uuid for d in snapshot.devices})):
            return snapshot
        await asyncio.sleep(pause_s)


async def probe_forever(
    refresh: Callable[[], Snapshot],
    apply: Callable[[Snapshot], None],
    *,
    current: Callable[[], Snapshot],
    interval_s: Callable[[], float],
) -> None:
    """Every `interval_s()` seconds, probe with `refresh` in an executor (probes block) and
    hand the result to `apply`, unless it cannot be believed yet."""
    loop = asyncio.get_running_loop()
    doubt = ProbeDoubt()
    while True:
        await asyncio.sleep(interval_s())
        try:
            snapshot = await loop.run_in_executor(None, refresh)
        except Exception as exc:  # a failing refresh keeps the last good picture
            log.warning("device refresh failed, keeping the previous inventory: %s", exc)
            continue
        if doubt.believe(lost_probes(current(), snapshot)):
            apply(snapshot)


def lost_probes(before: Snapshot, after: Snapshot) -> list[str]:
    """Vendors whose probe found devices before and finds none now."""
    had = {v.vendor for v in before.verdicts if v.available}
    has = {v.vendor for v in after.verdicts if v.available}
    return sorted((had - has) - {"cpu"})


class UnleasedSignaller:
    """SIGTERM to processes that have used a GPU without a lease for longer than the grace
    period (`probe.unleased_processes = "signal"`)."""

    def __init__(self) -> None:
        self._first_seen: dict[int, float] = {}  # unleased GPU pid -> first sighting

    def signal(self, occupancy: Occupancy, grace_s: float) -> None:
        """Count this sighting; signal those seen unleased for over `grace_s` seconds."""
        now = time.time()
        current = {p.pid for p in occupancy.unleased}
        self._first_seen = {pid: t for pid, t in self._first_seen.items() if pid in current}
        for pid in current:
            self._first_seen.setdefault(pid, now)
        for pid in to_signal(occupancy, self._first_seen, now, grace_s, protected={os.getpid()}):
            proc = next(p for p in occupancy.unleased if p.pid == pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
                log_event("signal", f"sent SIGTERM to {proc.user}'s pid {pid} ({proc.command}): it used "
                          f"{proc.device_uuid} without a lease for over {grace_s:.0f}s",
                          user=proc.user, pid=pid, device_uuids=(proc.device_uuid,), level=logging.WARNING)

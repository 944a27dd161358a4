"""The daemon's two clocks: the wall clock for what it records (grants, ends, the store, the
accounting, the times status shows) and the monotonic clock for what it waits for (time
limits, heartbeat TTLs, ages in the queue). The lease core keeps its deadlines in wall-clock
numbers (they are stored, shown and restored across a restart), so `StepWatch` notices when
the wall clock jumps (NTP stepping it, an admin's `date -s`) and the manager moves every live
deadline by the jump: what was due in 20 minutes is still due in 20 minutes.

A test steps the daemon's wall clock, and only the daemon's, through a file named by
VACCEL_TEST_WALL_STEP_FILE: seconds added to the machine's clock, read at each look. Why not
the usual tools: libfaketime 0.9.10 (Debian 12) either steps CLOCK_MONOTONIC with the wall
clock or, told not to, makes every time.sleep fail with EINVAL; a time namespace offsets only
the monotonic and boot clocks. Without the variable `wall` is time.time itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A jump smaller than this is NTP's slewing or the time between two reads, not a step
# (chrony steps at 1 s by default, ntpd at 0.128 s).
STEP_S = 0.5


def _stepped_file(path: str) -> Callable[[], float]:
    def wall() -> float:
        try:
            with open(path) as f:
                return time.time() + float(f.read().strip() or 0)
        except (OSError, ValueError):
            return time.time()
    return wall


_STEP_FILE = os.environ.get("VACCEL_TEST_WALL_STEP_FILE", "")
wall: Callable[[], float] = _stepped_file(_STEP_FILE) if _STEP_FILE else time.time


class StepWatch:
    """The wall clock's jumps, as the distance between it and the monotonic clock moving."""

    def __init__(self, wall_clock: Callable[[], float] = wall,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._wall, self._monotonic = wall_clock, monotonic
        self._offset = self._read()

    def _read(self) -> float:
        # Read between two monotonic reads, again if something took the CPU in between:
        # a pause there would look like a step.
        while True:
            before = self._monotonic()
            offset = self._wall() - before
            if self._monotonic() - before < STEP_S / 10:
                return offset

    def step(self) -> float:
        """How far the wall clock jumped since the last look (0.0: it did not)."""
        offset = self._read()
        jump, self._offset = offset - self._offset, offset
        if abs(jump) < STEP_S:
            return 0.0
        log.warning("the wall clock stepped by %+.1fs: live time limits, heartbeats and waits move with it", jump)
        return jump

"""How much each user has used the devices lately, for the fair queue and the limits.

Two measures, both in device-hours:
- `recent(uid)`: past use with exponential decay (half-life `half_life_s`): an hour of one
  device `half_life_s` ago counts half. The fair queue serves the waiting user with the
  least of it first.
- `in_window(uid)`: plain use inside the rolling window (`max_device_hours` limits it).

Ended leases are folded in as they end (`add`); the leases running now are counted from
their start to `now` at each question, so a user's use grows while they hold devices. A
memory share counts as its part of its device (Lease.weight): a quarter of a GPU for an
hour is a quarter of a device-hour.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from brokerd.leasing.model import Lease

_HOUR = 3600.0


def _decayed_hours(start: float, end: float, now: float, half_life_s: float) -> float:
    """Integral of 2^-((now - t)/h) over [start, end], in hours: use long ago fades."""
    if end <= start:
        return 0.0
    if half_life_s <= 0:
        return (end - start) / _HOUR
    rate = math.log(2) / half_life_s
    return (math.exp(-rate * (now - end)) - math.exp(-rate * (now - start))) / rate / _HOUR


class UsageBook:
    def __init__(self, half_life_s: float = 86400.0, window_s: float = 7 * 86400.0) -> None:
        self.half_life_s = half_life_s
        self.window_s = window_s
        # uid -> (decayed device-hours, as of this time): decays on read, grows on add
        self._recent: dict[int, tuple[float, float]] = {}
        # uid -> (start, end, devices) of ended leases still inside the longest window asked
        self._spans: dict[int, deque[tuple[float, float, float]]] = {}

    def add(self, lease: Lease) -> None:
        """An ended lease's use, folded in once."""
        uid, n = lease.holder.uid, lease.weight
        start, end = lease.granted_at, lease.ended_at or lease.granted_at
        value, at = self._recent.get(uid, (0.0, end))
        ref = max(at, end)
        self._recent[uid] = (self._decay(value, ref, at) + n * _decayed_hours(start, end, ref, self.half_life_s),
                             ref)
        self._spans.setdefault(uid, deque()).append((start, end, n))

    def _decay(self, value: float, now: float, since: float) -> float:
        if self.half_life_s <= 0 or now <= since:
            return value
        return value * 0.5 ** ((now - since) / self.half_life_s)

    def recent(self, uid: int, now: float, active: Iterable[Lease] = ()) -> float:
        value, at = self._recent.get(uid, (0.0, now))
        total = self._decay(value, now, at)
        for lease in active:
            if lease.holder.uid == uid:
                total += lease.weight * _decayed_hours(lease.granted_at, now, now, self.half_life_s)
        return total

    def in_window(self, uid: int, now: float, window_s: float, active: Iterable[Lease] = ()) -> float:
        """Device-hours of `uid` in [now - window_s, now], ended and running leases."""
        start_of_window = now - window_s
        spans = self._spans.get(uid, deque())
        longest = max(window_s, self.window_s)  # window_s: the longest any policy table asks for
        while spans and spans[0][1] < now - longest:  # older than any window asked: gone
            spans.popleft()
        total = sum(n * max(0.0, min(end, now) - max(start, start_of_window)) for start, end, n in spans)
        total += sum(lease.weight * max(0.0, now - max(lease.granted_at, start_of_window))
                     for lease in active if lease.holder.uid == uid)
        return total / _HOUR

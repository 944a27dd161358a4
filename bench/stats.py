"""Summary statistics the benchmarks print: percentiles and a one-line summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in 0..100: the smallest value with at least q% of the
    values at or below it (the ceil(q/100 * n)-th smallest; q=0 gives the minimum).
    p50 of 1..10 is 5, p90 of 1..10 is 9, p99 of 1..100 is 99, p100 is the maximum;
    0.0 for no values. Exact arithmetic, so p29 of 1..100 is 29, not 30."""
    if not values:
        return 0.0
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = math.ceil(Fraction(q) * len(ordered) / 100)
    return ordered[max(rank, 1) - 1]


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    """p50 (the median), p90, min and max of latencies in seconds, as milliseconds."""
    return {"n": len(values_s), "p50_ms": median(values_s) * 1000.0, "p90_ms": percentile(values_s, 90) * 1000.0,
            "min_ms": min(values_s, default=0.0) * 1000.0, "max_ms": max(values_s, default=0.0) * 1000.0}

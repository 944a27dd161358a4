"""The benchmarks' percentile: nearest rank, exact (the old one rounded and was off by one)."""

from __future__ import annotations

import pytest

from bench import leases
from bench.stats import median, percentile, summary_ms

ONE_TO_TEN = [float(i) for i in range(1, 11)]
ONE_TO_HUNDRED = [float(i) for i in range(1, 101)]


@pytest.mark.parametrize(("values", "q", "expected"), [
    (ONE_TO_TEN, 50, 5.0),
    (ONE_TO_TEN, 90, 9.0),
    (ONE_TO_TEN, 91, 10.0),
    (ONE_TO_TEN, 10, 1.0),
    (ONE_TO_TEN, 0, 1.0),
    (ONE_TO_TEN, 100, 10.0),
    (ONE_TO_HUNDRED, 99, 99.0),
    (ONE_TO_HUNDRED, 50, 50.0),
    (ONE_TO_HUNDRED, 29, 29.0),  # 0.29 * 100 is 28.999... in floating point
    (ONE_TO_HUNDRED, 99.5, 100.0),
    ([7.0], 1, 7.0),
    ([3.0, 1.0, 2.0], 50, 2.0),  # unsorted input
])
def test_nearest_rank(values, q, expected):
    assert percentile(values, q) == expected


def test_lease_benchmark_uses_the_same_definition():
    assert leases.percentile(ONE_TO_HUNDRED, 99) == 99.0
    assert leases.percentile(ONE_TO_TEN, 50) == 5.0


def test_empty_and_out_of_range():
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError):
        percentile(ONE_TO_TEN, 101)
    with pytest.raises(ValueError):
        percentile(ONE_TO_TEN, -1)


def test_median_and_summary():
    assert median(ONE_TO_TEN) == 5.5
    assert median([2.0, 9.0, 4.0]) == 4.0
    s = summary_ms([0.001 * i for i in range(1, 11)])
    assert s["n"] == 10
    assert s["p50_ms"] == pytest.approx(5.5)
    assert s["p90_ms"] == pytest.approx(9.0)
    assert s["max_ms"] == pytest.approx(10.0)

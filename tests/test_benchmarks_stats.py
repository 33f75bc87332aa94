"""The benchmarks' shared statistics (benchmarks/stats.py): each figure's definition pinned,
so that a recorded result means what its name says when it is measured again."""

from __future__ import annotations

import math
import os

import pytest

from benchmarks.stats import (
    CLK_TCK,
    cpu_seconds,
    group_cpu_seconds,
    median_ms,
    percentile,
    rank_quantile,
)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(20, 0, -1)]  # 20 .. 1, unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 11.0  # rank round(9.5) = 10 (half to even)
    assert percentile(values, 90) == 18.0  # rank round(17.1) = 17
    assert percentile(values, 99) == 20.0
    assert percentile(values, 100) == 20.0
    assert math.isnan(percentile([], 50))


def test_rank_quantile_keeps_its_own_rank() -> None:
    values = [float(v) for v in range(1, 21)]
    assert rank_quantile(values, 0.25) == 6.0  # rank floor(5.0) = 5
    assert rank_quantile(values, 0.9) == 19.0  # rank floor(18.0): one above percentile's
    assert rank_quantile(values, 1.0) == 20.0
    assert rank_quantile([1.0, 2.0, 3.0], 0.3) == 1.0  # and below it: percentile gives 2.0
    assert percentile([1.0, 2.0, 3.0], 30) == 2.0
    assert math.isnan(rank_quantile([], 0.5))


def test_median_ms() -> None:
    assert median_ms([0.003, 0.001, 0.002]) == pytest.approx(2.0)
    assert median_ms([0.001, 0.002]) == pytest.approx(1.5)
    assert math.isnan(median_ms([]))


def test_cpu_seconds_of_this_process_and_its_group() -> None:
    tick = 1 / CLK_TCK
    before = sum(os.times()[:2])
    own = cpu_seconds(os.getpid())
    after = sum(os.times()[:2])
    assert before - 2 * tick <= own <= after + 2 * tick
    assert group_cpu_seconds(os.getpgrp()) >= own - 2 * tick
    assert group_cpu_seconds(-1) == 0.0  # no process is in it
    with pytest.raises(FileNotFoundError):
        cpu_seconds(-1)

"""Statistics the benchmarks share, so that every figure of one name means the same."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _at_rank(values: Sequence[float], rank: Callable[[int], int]) -> float:
    """The sorted ``values``' element at ``rank(n)`` (capped at the last); NaN when none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, rank(len(ordered)))]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; NaN when there are none."""
    return _at_rank(values, lambda n: round(q / 100 * (n - 1)))


def rank_quantile(values: Sequence[float], q: float) -> float:
    """The value at rank ``floor(q * n)`` of the sorted ``values`` (``q`` in 0-1); NaN when
    there are none. Not ``percentile``'s rank (``round(q * (n - 1))``): the two differ for
    some ``n`` and ``q``, and connector_throughput's recorded p25/p90 use this one."""
    return _at_rank(values, lambda n: int(q * n))


def median_ms(seconds: Sequence[float]) -> float:
    """Median of ``seconds`` in milliseconds; NaN when there are none."""
    return statistics.median(seconds) * 1e3 if seconds else float("nan")


def _stat(pid: int | str) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces or ')')."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    return _cpu(_stat(pid))


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU time so far of every live process in process group ``pgid``."""
    total = 0.0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            fields = _stat(p)
        except OSError:  # gone since the listing
            continue
        if int(fields[2]) == pgid:
            total += _cpu(fields)
    return total

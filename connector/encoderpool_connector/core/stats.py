"""Counters of both transports, reported through vLLM's EC stats and metrics hooks.

Both roles count into a plain dict of numbers (picklable, so it crosses from
workers to the scheduler and on to the API server); vLLM logs the reduced
values as ``EC Transfer metrics: ...`` and we export them to Prometheus. Each
transport declares its own counters (name -> help) and subclasses these.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from typing_extensions import Self
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
    PromMetric,
    PromMetricT,
)

from encoderpool_contracts.metrics import ec_counter, family


@dataclass
class CounterStats(ECConnectorStats):  # type: ignore[misc]  # vLLM is untyped here
    """Additive counters; ``aggregate`` sums across ranks and steps.

    Each transport subclasses it with its own ``counters`` (name -> help).
    """

    counters: ClassVar[dict[str, str]] = {}

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def add(self, key: str, value: float = 1) -> None:
        assert key in self.counters, key
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> Self | None:
        """Hand over what was counted since the last take, and start afresh."""
        if self.is_empty():
            return None
        out = type(self)(data=dict(self.data))
        self.reset()
        return out


class CounterPromMetrics(ECConnectorPromMetrics):  # type: ignore[misc]
    """A Prometheus counter per key of ``counters``, ``ec_counter(key)``, per engine."""

    counters: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in self.counters.items():
            counter = self._counter_cls(
                name=family(ec_counter(key)), documentation=doc, labelnames=labelnames
            )
            self._counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)


S = TypeVar("S", bound=CounterStats)
SUMMARY_EVERY_S = 30.0


class LockedStats(Generic[S]):
    """Counters shared by a worker's threads: what was not taken yet, and running totals.

    The totals feed a producer's own periodic log line, because vLLM's V1 model
    runner (the one CPUs use) drops a producer worker's stats.
    """

    def __init__(self, stats_class: type[S]) -> None:
        self._lock = threading.Lock()
        self._pending: S = stats_class()
        self.totals: S = stats_class()
        self._last_summary = time.monotonic()

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._pending.add(key, value)
            self.totals.add(key, value)

    def add_many(self, values: dict[str, float]) -> None:
        """``add`` for several counters under one lock (zeros are skipped)."""
        pending, totals = self._pending, self.totals
        with self._lock:
            for key, value in values.items():
                if value:
                    assert key in pending.counters, key
                    pending.data[key] = pending.data.get(key, 0) + value
                    totals.data[key] = totals.data.get(key, 0) + value

    def take(self) -> S | None:
        with self._lock:
            return self._pending.take()

    def summary(self, logger: logging.Logger, what: str, force: bool = False) -> None:
        """Log the totals as ``<what> totals: k=v, ...`` at most every 30 s (or now)."""
        now = time.monotonic()
        if not force and now - self._last_summary < SUMMARY_EVERY_S:
            return
        self._last_summary = now
        with self._lock:
            totals = self.totals.reduce()
        if totals:
            logger.info("%s totals: %s", what, ", ".join(f"{k}={v}" for k, v in totals.items()))

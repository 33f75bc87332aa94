"""Counters of the shared-volume connector, reported through vLLM's EC stats and metrics hooks.

Both roles count into a plain dict of numbers (picklable, so it crosses from
workers to the scheduler and on to the API server); vLLM logs the reduced
values as ``EC Transfer metrics: ...`` and we export them to Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from typing_extensions import Self
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
    PromMetric,
    PromMetricT,
)

# name -> help; every key a connector may count. Seconds are summed.
COUNTERS: dict[str, str] = {
    "lookups": "Items the consumer looked up in the shared volume.",
    "hits": "Lookups that found a verified entry (the consumer skips its encoder).",
    "misses": "Lookups that found no entry (the consumer encodes the item itself).",
    "rejected": "Entries found but rejected: corrupt, truncated, foreign model, wrong shape.",
    "waits_timed_out": "Items a producer announced that never appeared in time.",
    "loads": "Entries loaded into the encoder cache by the worker.",
    "load_failures": "Loads that failed after verification (the request is failed, retryable).",
    "load_bytes": "Payload bytes loaded.",
    "load_seconds": "Seconds the worker spent loading (on the step path).",
    "verify_seconds": "Seconds spent verifying entries (scheduler side, off the step path).",
    "saves_queued": "Encoder outputs handed to the background writer.",
    "saves_dropped": "Saves dropped because the writer queue was full or the save failed.",
    "published": "Entries written and renamed into place.",
    "publish_skipped": "Saves skipped: an identical entry was already published.",
    "publish_bytes": "Bytes published.",
    "write_seconds": "Seconds the background writer spent writing and publishing.",
    "evicted": "Entries evicted to keep the directory under its capacity.",
    "evicted_bytes": "Bytes evicted.",
}


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
    """A Prometheus counter per key of ``counters``, ``encoderpool_ec_<key>_total``, per engine."""

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
                name=f"encoderpool_ec_{key}", documentation=doc, labelnames=labelnames
            )
            self._counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)


@dataclass
class EncoderPoolECStats(CounterStats):
    """The shared-volume connector's counters."""

    counters: ClassVar[dict[str, str]] = COUNTERS


class EncoderPoolPromMetrics(CounterPromMetrics):
    counters: ClassVar[dict[str, str]] = COUNTERS

"""Prometheus metrics of the operator, served on ``ENCODERPOOL_METRICS_PORT``.

What a platform engineer asks of a controller: is it reconciling, how long does
a pass take, does it write when nothing changes, and which pools are not Ready.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from encoderpool_operator.controller.workqueue import WorkQueue
from encoderpool_operator.kube import Kube


class _Live(Collector):
    """Values read at scrape time: API requests (from Kube), the queue, pools by readiness."""

    def __init__(self, metrics: OperatorMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        writes = GaugeMetricFamily(
            "encoderpool_operator_api_writes",
            "Write requests sent to the API server since start, by verb and kind.",
            labels=["verb", "kind"],
        )
        if self.m.kube is not None:
            for key, count in sorted(self.m.kube.writes.items()):
                verb, _, kind = key.partition(" ")
                writes.add_metric([verb, kind], count)
        yield writes
        reads = GaugeMetricFamily(
            "encoderpool_operator_api_reads",
            "Read requests sent to the API server since start (most passes read the cache).",
            labels=["kind"],
        )
        if self.m.kube is not None:
            for kind, count in sorted(self.m.kube.reads.items()):
                reads.add_metric([kind], count)
        yield reads
        if self.m.queue is not None:
            yield GaugeMetricFamily(
                "encoderpool_operator_queue_depth",
                "Pools marked and waiting for a pass (each pool at most once).",
                value=len(self.m.queue),
            )
        pools = GaugeMetricFamily(
            "encoderpool_operator_pools",
            "EncoderPools seen by this operator, by their Ready condition.",
            labels=["ready"],
        )
        with self.m.lock:
            states = list(self.m.ready.values())
        for state in ("True", "False", "Unknown"):
            pools.add_metric([state], states.count(state))
        yield pools


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.kube: Kube | None = None
        self.queue: WorkQueue[tuple[str, str]] | None = None
        self.lock = threading.Lock()
        self.ready: dict[tuple[str, str], str] = {}
        self.passes = Counter(
            "encoderpool_operator_reconciles",
            "Reconcile passes, by what triggered them and how they ended.",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "encoderpool_operator_reconcile_seconds",
            "Duration of one reconcile pass.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.registry.register(_Live(self))

    def set_ready(self, namespace: str, name: str, status: str | None) -> None:
        with self.lock:
            if status is None:
                self.ready.pop((namespace, name), None)
            else:
                self.ready[(namespace, name)] = status

    def serve(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)

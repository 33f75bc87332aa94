"""Prometheus metrics of the operator, served on ``ENCODERPOOL_METRICS_PORT``.

What a platform engineer asks of a controller: is it reconciling, how long does
a pass take, does it write when nothing changes, and which pools are not Ready. Each
pool's conditions, replica counts and measured widths are gauges too, so the chart's
alerts and dashboard read them from Prometheus (a width Job failing, a pool stalled).
Only the replica that reconciles reports pools: a standby's pass never runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from encoderpool_contracts.metrics import (
    OPERATOR_POOL_CONDITION,
    OPERATOR_POOL_ENCODER_WIDTH,
    OPERATOR_POOL_REPLICAS,
)
from encoderpool_operator.api.status import READY, EncoderPoolStatus, ReplicaStatus
from encoderpool_operator.controller.workqueue import WorkQueue
from encoderpool_operator.kube import Kube

PoolKey = tuple[str, str]


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
            seen = sorted(self.m.status.items())
        states = [_ready(status) for _, status in seen]
        for state in ("True", "False", "Unknown"):
            pools.add_metric([state], states.count(state))
        yield pools
        yield from _pool_families(seen)


def _ready(status: EncoderPoolStatus) -> str:
    found = [c for c in status.conditions if c.type == READY]
    return found[0].status if found else "Unknown"


def _pool_families(seen: list[tuple[PoolKey, EncoderPoolStatus]]) -> Iterator[GaugeMetricFamily]:
    """Each pool's status as gauges; label names match the pods' series (``namespace``,
    ``pool``), so a scrape must keep them (``honor_labels``, as for kube-state-metrics)."""
    conditions = GaugeMetricFamily(
        OPERATOR_POOL_CONDITION,
        "1 for each condition of each pool, with its status and reason (as in the pool's "
        "status.conditions).",
        labels=["namespace", "pool", "condition", "status", "reason"],
    )
    replicas = GaugeMetricFamily(
        OPERATOR_POOL_REPLICAS,
        "Pods per role of each pool: desired (the spec or its autoscaler) and ready.",
        labels=["namespace", "pool", "role", "state"],
    )
    widths = GaugeMetricFamily(
        OPERATOR_POOL_ENCODER_WIDTH,
        "The encoder output width measured for each pool, per modality.",
        labels=["namespace", "pool", "modality"],
    )
    for (namespace, name), status in seen:
        for c in status.conditions:
            conditions.add_metric([namespace, name, c.type, c.status, c.reason], 1)
        roles: tuple[tuple[str, ReplicaStatus | None], ...] = (
            ("producer", status.producers),
            ("consumer", status.consumers),
            ("router", status.router),
        )
        for role, counts in roles:
            if counts is not None:
                replicas.add_metric([namespace, name, role, "desired"], counts.desired)
                replicas.add_metric([namespace, name, role, "ready"], counts.ready)
        for modality, width in sorted(status.encoder_output_widths.items()):
            widths.add_metric([namespace, name, modality], width)
    yield conditions
    yield replicas
    yield widths


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.kube: Kube | None = None
        self.queue: WorkQueue[tuple[str, str]] | None = None
        self.lock = threading.Lock()
        self.status: dict[PoolKey, EncoderPoolStatus] = {}
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

    def set_status(self, namespace: str, name: str, status: EncoderPoolStatus | None) -> None:
        """The pool's status as its last pass computed it; None: the pool is gone."""
        with self.lock:
            if status is None:
                self.status.pop((namespace, name), None)
            else:
                self.status[(namespace, name)] = status

    def serve(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)

"""The pool's Grafana dashboard and Prometheus alerts, as tables: the chart ships what these
render (files/dashboard.json, files/alerts.json), and the kind test bed runs every panel's
query and every alert's expression on a real Prometheus after traffic.

Queries select a pool by the labels the scrape configuration gives its series
(``namespace``, ``pool``, ``component``; docs/autoscaling.md), so the dashboard works on
any Prometheus that scrapes the pools that way. Every metric name comes from the contracts
(``metrics``, ``signals``), where the components that register them take it too;
tests/monitoring/test_metric_names.py fails on a name no component registers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from encoderpool_contracts.metrics import (
    EC_EVICTED_BYTES,
    EC_HITS,
    EC_LOAD_SECONDS,
    EC_LOADS,
    EC_MISSES,
    EC_PUBLISH_BYTES,
    EC_REJECTED,
    EC_VOLUME_AVAILABLE_BYTES,
    EC_VOLUME_FILES,
    EC_VOLUME_FILES_AVAILABLE,
    EC_VOLUME_SIZE_BYTES,
    OPERATOR_POOL_CONDITION,
    OPERATOR_POOL_ENCODER_WIDTH,
    OPERATOR_POOL_REPLICAS,
    ROUTER_BACKENDS,
    ROUTER_CONSUMER_LATENCY,
    ROUTER_ERRORS,
    ROUTER_MEDIA_ITEMS,
    ROUTER_REQUESTS,
    VLLM_INTER_TOKEN_LATENCY,
)
from encoderpool_contracts.signals import (
    DISPATCH_DECISIONS,
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    VLLM_KV_CACHE_USAGE,
    VLLM_REQUESTS_RUNNING,
    VLLM_REQUESTS_WAITING,
)

POOL = 'namespace="$namespace",pool="$pool"'
RATE = "[5m]"


@dataclass(frozen=True)
class Panel:
    title: str
    expr: str
    unit: str = "short"
    legend: str = ""
    description: str = ""
    # More queries drawn on the panel, (expr, legend) each.
    more: tuple[tuple[str, str], ...] = ()

    @property
    def targets(self) -> tuple[tuple[str, str], ...]:
        return ((self.expr, self.legend), *self.more)


def _ec_rate(counter: str) -> str:
    return f"sum(rate({counter}{{{POOL}}}{RATE}))"


def _quantile(q: float, metric: str, extra: str = "") -> str:
    sel = f"{POOL}{extra}"
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{sel}}}{RATE})))"


PANELS: tuple[Panel, ...] = (
    Panel(
        "Requests by route and status",
        f"sum by (endpoint, code) (rate({ROUTER_REQUESTS}{{{POOL}}}{RATE}))",
        "reqps",
        "{{endpoint}} {{code}}",
    ),
    Panel(
        "Router errors by kind",
        f"sum by (kind) (rate({ROUTER_ERRORS}{{{POOL}}}{RATE}))",
        "ops",
        "{{kind}}",
    ),
    Panel(
        "Time to first byte (p50, p95)",
        _quantile(0.95, ROUTER_CONSUMER_LATENCY, ',phase="first_byte"'),
        "s",
        "p95",
        "From the router's request to the consumer's first byte: TTFT as clients see it.",
    ),
    Panel(
        "Time per output token (p95)",
        _quantile(0.95, VLLM_INTER_TOKEN_LATENCY, ',component="consumer"'),
        "s",
        "p95",
    ),
    Panel(
        "Media items by where they were encoded",
        f"sum by (encoded) (rate({ROUTER_MEDIA_ITEMS}{{{POOL}}}{RATE}))",
        "ops",
        "{{encoded}}",
        "remote: a producer; local: the consumer; reused: encoded moments ago.",
    ),
    Panel(
        "Encoder demand per producer group (items in flight)",
        f"sum by (group) (rate({ENCODER_INFLIGHT_SECONDS}{{{POOL}}}{RATE}))",
        "short",
        "{{group}}",
        "The producers' autoscaling signal: mean media items in flight to the group.",
    ),
    Panel(
        "Items that found no producer",
        f"sum by (group) (rate({ENCODER_UNSERVED_ITEMS}{{{POOL}}}{RATE}))",
        "ops",
        "{{group}}",
        "A group at zero or all ejected; the consumer encoded them. Wakes a group at zero.",
    ),
    Panel(
        "Dispatch decisions",
        f"sum by (to, reason) (rate({DISPATCH_DECISIONS}{{{POOL}}}{RATE}))",
        "ops",
        "{{to}} {{reason}}",
    ),
    Panel(
        "Encoder cache: hits, misses, rejected",
        _ec_rate(EC_HITS),
        "ops",
        "hits",
        more=((_ec_rate(EC_MISSES), "misses"), (_ec_rate(EC_REJECTED), "rejected")),
    ),
    Panel(
        "Encoder cache: bytes published and evicted",
        _ec_rate(EC_PUBLISH_BYTES),
        "Bps",
        "published",
        more=((_ec_rate(EC_EVICTED_BYTES), "evicted"),),
    ),
    Panel(
        "Connector: load and write time per item",
        f"{_ec_rate(EC_LOAD_SECONDS)} / {_ec_rate(EC_LOADS)}",
        "s",
        "load",
    ),
    Panel(
        "Cache volume: space and files left",
        f"min({EC_VOLUME_AVAILABLE_BYTES}{{{POOL}}}) / min({EC_VOLUME_SIZE_BYTES}{{{POOL}}})",
        "percentunit",
        "space",
        "Shared volume only: what the pods can still write. Full, every save fails.",
        more=(
            (
                f"min({EC_VOLUME_FILES_AVAILABLE}{{{POOL}}}) / min({EC_VOLUME_FILES}{{{POOL}}})",
                "files",
            ),
        ),
    ),
    Panel(
        "Replicas per role: desired and ready",
        f"max by (role, state) ({OPERATOR_POOL_REPLICAS}{{{POOL}}})",
        "short",
        "{{role}} {{state}}",
        "From the pool's status (the operator): desired is the spec's or its autoscaler's.",
    ),
    Panel(
        "Encoder output width (measured)",
        f"max by (modality) ({OPERATOR_POOL_ENCODER_WIDTH}{{{POOL}}})",
        "short",
        "{{modality}}",
        "What the width Job measured; a change of model re-measures.",
    ),
    Panel(
        "Pods per role (ready backends the router sees)",
        f"sum by (role) ({ROUTER_BACKENDS}{{{POOL}}})",
        "short",
        "{{role}}",
    ),
    Panel(
        "LM demand: requests running and waiting",
        f'sum({VLLM_REQUESTS_RUNNING}{{{POOL},component="consumer"}}) + '
        f'sum({VLLM_REQUESTS_WAITING}{{{POOL},component="consumer"}})',
        "short",
        "running + waiting",
        "The consumers' autoscaling signal.",
    ),
    Panel(
        "KV-cache use per consumer",
        f'{VLLM_KV_CACHE_USAGE}{{{POOL},component="consumer"}}',
        "percentunit",
        "{{pod}}",
    ),
)


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str


def _ratio(num: str, den: str) -> str:
    return f"({num}) / ({den} > 0)"


BY_POOL = "sum by (namespace, pool)"
# The operator's condition gauge, one series per pool and condition (only the active
# replica reports pools; ``max`` also folds a standby's empty scrape away).
_CONDITION = "max by (namespace, pool) (" + OPERATOR_POOL_CONDITION + "{{{}}})"
_WIDTH_REASONS = "WidthJobFailed|WidthReportInvalid"


def _volume_left(left: str, total: str) -> str:
    return _ratio(f"min by (namespace, pool) ({left})", f"min by (namespace, pool) ({total})")


ALERTS: tuple[Alert, ...] = (
    Alert(
        "EncoderPoolNoConsumerReady",
        f'{BY_POOL} ({ROUTER_BACKENDS}{{role="consumer"}}) == 0',
        "2m",
        "critical",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }}: the router sees no ready consumer; "
        "every request fails with 503.",
    ),
    Alert(
        "EncoderPoolProducersFailing",
        _ratio(
            f'{BY_POOL} (rate({ROUTER_ERRORS}{{kind=~"producer_(error|timeout)"}}{RATE}))',
            f"{BY_POOL} (rate({ROUTER_MEDIA_ITEMS}{RATE}))",
        )
        + " > 0.2",
        "5m",
        "warning",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }}: over 20% of media items failed on "
        "a producer (the consumers encode them: slower, not failed).",
    ),
    Alert(
        "EncoderPoolLocalEncodeFallbackHigh",
        # Decisions, not the wake signal: that one counts an item once per window and
        # only for requests a consumer accepted, so it would under-report the share.
        _ratio(
            f'{BY_POOL} (rate({DISPATCH_DECISIONS}{{reason="no_producer"}}{RATE}))',
            f"{BY_POOL} (rate({DISPATCH_DECISIONS}{RATE}))",
        )
        + " > 0.5",
        "15m",
        "warning",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }}: most media items find no producer "
        "ready (scaled to zero for long, or all ejected); the consumers encode them.",
    ),
    Alert(
        "EncoderPoolCacheEvicting",
        f"{BY_POOL} (rate({EC_EVICTED_BYTES}{RATE})) > 0",
        "30m",
        "info",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }}: the encoder cache has been full "
        "and evicting for 30 minutes; raise connector.sharedVolume.capacity for more reuse.",
    ),
    Alert(
        "EncoderPoolWidthMeasurementFailing",
        _CONDITION.format(f'condition="WidthsMeasured",status="False",reason=~"{_WIDTH_REASONS}"')
        + " == 1",
        "1m",
        "critical",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }}: its width Job failed or wrote an "
        "invalid report, so the pool cannot start; `kubectl describe epool` and the Job's "
        "logs say why (often the model's path or the image).",
    ),
    Alert(
        "EncoderPoolStalled",
        _CONDITION.format(f'condition="Stalled",status="True",reason!~"{_WIDTH_REASONS}"')
        + " == 1",
        "10m",
        "warning",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }} needs a person: its Stalled "
        "condition names the reason (docs/operations.md lists each and what to do).",
    ),
    Alert(
        "EncoderPoolCacheVolumeNearlyFull",
        "("
        + _volume_left(EC_VOLUME_AVAILABLE_BYTES, EC_VOLUME_SIZE_BYTES)
        + " < 0.1) or ("
        + _volume_left(EC_VOLUME_FILES_AVAILABLE, EC_VOLUME_FILES)
        + " < 0.1)",
        "5m",
        "warning",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }}: under 10% of its cache volume's "
        "space or files is left; when it is full every save fails and consumers encode "
        "each item themselves. Grow the volume or lower connector.sharedVolume.capacity.",
    ),
    Alert(
        "EncoderPoolRouter5xx",
        _ratio(
            f'{BY_POOL} (rate({ROUTER_REQUESTS}{{code=~"5.."}}{RATE}))',
            f"{BY_POOL} (rate({ROUTER_REQUESTS}{RATE}))",
        )
        + " > 0.05",
        "5m",
        "critical",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }}: over 5% of requests answered 5xx.",
    ),
)


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard: one timeseries panel per ``PANELS`` entry, two per row."""
    variables = [
        {
            "name": "datasource",
            "type": "datasource",
            "query": "prometheus",
            "label": "Prometheus",
        },
        {
            "name": "namespace",
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": f"label_values({ROUTER_REQUESTS}, namespace)",
            "refresh": 2,
        },
        {
            "name": "pool",
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": f'label_values({ROUTER_REQUESTS}{{namespace="$namespace"}}, pool)',
            "refresh": 2,
        },
    ]
    panels = [
        {
            "id": i + 1,
            "type": "timeseries",
            "title": p.title,
            "description": p.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "targets": [
                {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                for j, (expr, legend) in enumerate(p.targets)
            ],
        }
        for i, p in enumerate(PANELS)
    ]
    return {
        "uid": "encoderpool",
        "title": "encoderpool: pool",
        "tags": ["encoderpool", "vllm"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": variables},
        "panels": panels,
    }


def rule_groups() -> list[dict[str, Any]]:
    """The alerts as Prometheus rule groups (a rule file's, or a PrometheusRule's spec)."""
    return [
        {
            "name": "encoderpool",
            "rules": [
                {
                    "alert": a.name,
                    "expr": a.expr,
                    "for": a.for_,
                    "labels": {"severity": a.severity},
                    "annotations": {"summary": a.summary},
                }
                for a in ALERTS
            ],
        }
    ]


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def alerts_json() -> str:
    return json.dumps({"groups": rule_groups()}, indent=2, sort_keys=True) + "\n"

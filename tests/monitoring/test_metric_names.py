"""Every metric a dashboard panel, an alert or an autoscaler query reads is one a component
registers, collected from the components' own registries built here (no Prometheus): a
renamed counter or a misspelt panel fails here instead of drawing an empty graph."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram

from encoderpool_codegen import monitoring
from encoderpool_contracts import metrics
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.controller.metrics import OperatorMetrics
from encoderpool_operator.render.autoscaling import scalers
from encoderpool_router.demand import EncoderDemand
from encoderpool_router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]

# What a series of each family type is called on the wire.
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gauge": ("",),
}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def _series(registry: CollectorRegistry) -> set[str]:
    """The series names a registry exposes, whether or not it has samples yet."""
    return {f.name + s for f in registry.collect() for s in _SUFFIXES[f.type]}


def _connector_series() -> set[str]:
    """Both transports' counters, built as vLLM builds them (prometheus_client's types)."""
    pytest.importorskip("vllm")
    from encoderpool_connector.programs.volume_metrics import VolumeCollector
    from encoderpool_connector.rdma.stats import RdmaPromMetrics
    from encoderpool_connector.shared_volume.stats import SharedVolumePromMetrics

    out: set[str] = set()
    for cls in (SharedVolumePromMetrics, RdmaPromMetrics):
        registry = CollectorRegistry()

        def counter(
            name: str, documentation: str, labelnames: list[str], into: CollectorRegistry = registry
        ) -> PromCounter:
            return PromCounter(name, documentation, labelnames, registry=into)

        # vLLM keys the types by prometheus_client's classes (ray's wrappers under Ray).
        types: dict[Any, Any] = {PromCounter: counter, PromGauge: PromGauge}
        types[PromHistogram] = PromHistogram
        config = type("Config", (), {"ec_transfer_config": None})()
        cls(config, types, ["engine"], {0: ["0"]})
        out |= _series(registry)
    registry = CollectorRegistry()
    registry.register(VolumeCollector(str(ROOT)))  # any readable directory
    return out | _series(registry)


@pytest.fixture(scope="module")
def registered() -> set[str]:
    """Every series the router, the operator and the connector register, and vLLM's."""
    router = RouterMetrics()
    EncoderDemand(["tiny-producer"], registry=router.registry)
    operator = OperatorMetrics()
    vllm = {m + s for m in metrics.VLLM for s in ("", "_bucket", "_sum", "_count")}
    return _series(router.registry) | _series(operator.registry) | _connector_series() | vllm


def names_in(query: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana label_values query) reads."""
    query = re.sub(r"<<[^>]*>>", "", query)  # prometheus-adapter's templates
    query = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)  # label values
    query = re.sub(r"label_values\(([^,)]+)(?:,[^)]*)?\)", r"\1", query)
    query = re.sub(r"\{[^}]*\}", "", query)  # label matchers
    query = re.sub(r"\[[^\]]*\]", "", query)  # range selectors
    query = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", query)
    names = set()
    for match in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*(?=\s*(\(?))", query):
        if match.group(1) != "(" and match.group(0).lower() not in _KEYWORDS:
            names.add(match.group(0))
    return names


def _queries() -> Iterator[tuple[str, str]]:
    """(where, query) of every panel, dashboard variable, alert and autoscaler query."""
    for panel in monitoring.PANELS:
        for expr, _ in panel.targets:
            yield f"panel {panel.title!r}", expr
    for variable in monitoring.dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']}", variable["query"]
    for alert in monitoring.ALERTS:
        yield f"alert {alert.name}", alert.expr
    for scaler in scalers(_autoscaled_pool()):
        for trigger in scaler.triggers:
            yield f"{scaler.component} trigger {trigger.name}", trigger.query
    adapter = yaml.safe_load((ROOT / "examples" / "prometheus-adapter.yaml").read_text())
    for rule in adapter["externalRules"]:
        series = re.search(r'__name__="([^"]+)"', rule["seriesQuery"])
        assert series, rule
        yield f"prometheus-adapter {rule['name']['as']}", series.group(1)
        query = rule["metricsQuery"].replace("<<.Series>>", series.group(1))
        yield f"prometheus-adapter {rule['name']['as']}", query


def _autoscaled_pool() -> EncoderPool:
    """The example pool with every signal on: producers, a group, consumers with KV cache."""
    obj = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "pool-shared-volume.yaml").read_text()))
    obj["metadata"] = {"name": "tiny", "namespace": "ml"}
    spec = obj["spec"]
    spec["producer"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 4}
    spec["producerGroups"] = [{"name": "images", "modalities": ["image"]}]
    spec["consumer"]["autoscaling"] = {"maxReplicas": 4, "targetKvCacheUsage": 0.8}
    return EncoderPool.model_validate(obj)


QUERIES = list(_queries())


def test_the_parser_finds_names_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(a_bucket{pool="$pool",x=~"5.."}[5m]))) '
        "/ (sum without (pod) (b_total offset 5m) > 0) or vector(0) and on (namespace) "
        "vllm:c"
    )
    assert names_in(expr) == {"a_bucket", "b_total", "vllm:c"}
    assert names_in('label_values(d_total{namespace="$namespace"}, pool)') == {"d_total"}


def test_every_kind_of_query_is_read() -> None:
    kinds = {re.sub(r"-images$", "", where.split(" ")[0]) for where, _ in QUERIES}
    assert {"panel", "variable", "alert", "producer", "consumer", "prometheus-adapter"} <= kinds
    assert all(names_in(query) for _, query in QUERIES)


@pytest.mark.parametrize(("where", "query"), QUERIES, ids=[w for w, _ in QUERIES])
def test_every_metric_read_is_registered(where: str, query: str, registered: set[str]) -> None:
    unknown = names_in(query) - registered
    assert not unknown, f"{where} reads metrics no component registers: {sorted(unknown)}"


def test_a_misspelt_panel_fails(registered: set[str]) -> None:
    panel = monitoring.PANELS[0]
    misspelt = panel.expr.replace(metrics.ROUTER_REQUESTS, "encoderpool_router_request_total")
    assert misspelt != panel.expr
    assert names_in(misspelt) - registered == {"encoderpool_router_request_total"}


def test_every_name_in_contracts_is_registered(registered: set[str]) -> None:
    """The contracts list no name that nothing exports (histograms by their buckets)."""
    for name in metrics.READ:
        assert name in registered or f"{name}_bucket" in registered, name


def test_the_components_use_the_contracts_names() -> None:
    """No metric name written out in a component: each comes from the contracts."""
    sources = [
        ROOT / "router" / "encoderpool_router" / "metrics.py",
        ROOT / "router" / "encoderpool_router" / "demand.py",
        ROOT / "operator" / "encoderpool_operator" / "controller" / "metrics.py",
        ROOT / "operator" / "encoderpool_operator" / "render" / "autoscaling.py",
        ROOT / "operator" / "encoderpool_codegen" / "monitoring.py",
        ROOT / "connector" / "encoderpool_connector" / "core" / "stats.py",
        ROOT / "connector" / "encoderpool_connector" / "programs" / "volume_metrics.py",
    ]
    for path in sources:
        text = path.read_text()
        for name in metrics.READ:
            for spelt in (name, metrics.family(name)):
                assert f'"{spelt}"' not in text, (path, spelt)
                assert f"'{spelt}'" not in text, (path, spelt)

"""The Helm chart's values as a pydantic model, and the generator of the chart's derived files.

    python -m encoderpool_codegen.chart charts/encoderpool-operator          # write (make crds)
    python -m encoderpool_codegen.chart --check charts/encoderpool-operator  # 1 if stale

It writes files that must never be edited by hand, so that they cannot drift
from their sources:

- ``values.schema.json`` from ``ChartValues``: Helm validates every install,
  upgrade, lint and template against it, so an unknown key or a bad value fails
  with a message naming it;
- ``files/rbac.json`` from ``rbac.PERMISSIONS`` (the templates render it);
- ``files/dashboard.json`` and ``files/alerts.json``, the pools' Grafana dashboard
  and Prometheus alerts (``encoderpool_codegen.monitoring``);
- ``crds/encoderpool.io_encoderpools.yaml``, byte-identical to ``crds/`` at the
  repository root (``encoderpool_codegen.crd``).

``values.yaml`` is written by hand for its comments; tests/chart/test_chart.py checks
that it equals ``ChartValues()``'s defaults, and that every derived file is what this
module writes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from encoderpool_codegen import crd, monitoring
from encoderpool_operator import rbac
from encoderpool_operator.settings import OperatorSettings

_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a DNS-1123 label
# A label key (optional DNS-subdomain prefix, then a name) and a label value.
_LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
_CHART_LABELS = r"^(app\.kubernetes\.io|helm\.sh)/"  # the chart's own labels: not overridable
# A Prometheus duration, hours to milliseconds in that order ("30s", "1m30s", "500ms").
_DURATION = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?$"
_DURATION_MS = {"h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}
HEALTH_PORT = 8080  # kopf's --liveness endpoint in templates/deployment.yaml


class _Values(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Image(_Values):
    repository: str = Field(
        default="ghcr.io/encoderpool/encoderpool-operator",
        min_length=1,
        max_length=255,
        description="Operator image (docker/operator.Dockerfile); it also runs each pool's router.",
    )
    tag: str = Field(
        default="", max_length=128, description="Image tag; empty means the chart's appVersion."
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", alias="pullPolicy"
    )


class LocalObjectReference(_Values):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")


class ServiceAccount(_Values):
    # `helm lint` tolerates a template's `required`; the schema makes lint fail too.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"create": {"const": False}}},
            "then": {"properties": {"name": {"minLength": 1}}},
        }
    )

    create: bool = Field(default=True, description="Create the operator's ServiceAccount.")
    name: str = Field(
        default="",
        max_length=63,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        description="Its name; empty means the release's full name. Required to be an existing "
        "ServiceAccount when create is false.",
    )
    annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _named_when_not_created(self) -> ServiceAccount:
        if not self.create and not self.name:
            raise ValueError("serviceAccount.name: name an existing ServiceAccount")
        return self


class Rbac(_Values):
    create: bool = Field(
        default=True,
        description="Create the (Cluster)Role and binding from files/rbac.json; turn off only "
        "if you grant exactly those rules another way.",
    )


class LeaderElection(_Values):
    lease_name: str = Field(
        default="",
        max_length=63,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        alias="leaseName",
        description="coordination.k8s.io Lease in the release namespace the replicas elect "
        "their leader on (ENCODERPOOL_LEASE_NAME); empty means the release's full name. "
        "The first replica creates it.",
    )


_SETTINGS = OperatorSettings.model_fields


class Operator(_Values):
    resync_seconds: float = Field(
        default=60, ge=5, le=3600, alias="resyncSeconds", description="ENCODERPOOL_RESYNC_SECONDS"
    )
    width_retry_seconds: float = Field(
        default=30,
        ge=1,
        le=600,
        alias="widthRetrySeconds",
        description="ENCODERPOOL_WIDTH_RETRY_SECONDS",
    )
    router_image: str = Field(
        default="",
        max_length=512,
        alias="routerImage",
        description="ENCODERPOOL_ROUTER_IMAGE; empty means the operator image.",
    )
    # For big installs (docs/benchmarks-operator.md); defaults are OperatorSettings'.
    workers: int = Field(
        default=_SETTINGS["workers"].default,
        ge=1,
        le=64,
        description="ENCODERPOOL_WORKERS: pools reconciled at once.",
    )
    write_concurrency: int = Field(
        default=_SETTINGS["write_concurrency"].default,
        ge=1,
        le=128,
        alias="writeConcurrency",
        description="ENCODERPOOL_WRITE_CONCURRENCY: API writes in flight at once.",
    )
    api_qps: float = Field(
        default=_SETTINGS["api_qps"].default,
        gt=0,
        le=10000,
        alias="apiQps",
        description="ENCODERPOOL_API_QPS: average API requests a second (client-side limit).",
    )
    api_burst: int = Field(
        default=_SETTINGS["api_burst"].default,
        ge=1,
        le=20000,
        alias="apiBurst",
        description="ENCODERPOOL_API_BURST: requests allowed at once above apiQps.",
    )


Quantity = str | int


def _requests() -> dict[str, Quantity]:
    return {"cpu": "50m", "memory": "128Mi"}


def _limits() -> dict[str, Quantity]:
    return {"memory": "256Mi"}


class Resources(_Values):
    requests: dict[str, Quantity] = Field(default_factory=_requests, max_length=16)
    limits: dict[str, Quantity] = Field(default_factory=_limits, max_length=16)


def duration_ms(text: str) -> int:
    """A Prometheus duration matching _DURATION, in milliseconds."""
    return sum(int(n) * _DURATION_MS[unit] for n, unit in re.findall(r"([0-9]+)(ms|h|m|s)", text))


_PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")


def _scrapers() -> list[dict[str, Any]]:
    # kube-prometheus-stack's Prometheus pods, in any namespace.
    return [
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]


class MetricsNetworkPolicy(_Values):
    enabled: bool = Field(
        default=True,
        description="Render a NetworkPolicy on the operator pods: the metrics port only from "
        "scrapers; kopf's health port stays open (the kubelet probes it); nothing else gets "
        "in. Effective only where the network plugin enforces NetworkPolicy.",
    )
    scrapers: list[dict[str, Any]] = Field(
        default_factory=_scrapers,
        max_length=16,
        json_schema_extra={
            "items": {
                "type": "object",
                "minProperties": 1,
                "additionalProperties": False,
                "properties": {
                    "podSelector": {"type": "object"},
                    "namespaceSelector": {"type": "object"},
                    "ipBlock": {"type": "object", "required": ["cidr"]},
                },
            }
        },
        description="Who may scrape /metrics: NetworkPolicy peers (podSelector, "
        "namespaceSelector, ipBlock). Default: pods labelled app.kubernetes.io/name: prometheus "
        "in any namespace. Empty: nobody.",
    )

    @model_validator(mode="after")
    def _peers(self) -> MetricsNetworkPolicy:
        for i, peer in enumerate(self.scrapers):
            if not peer or set(peer) - set(_PEER_KEYS):
                raise ValueError(
                    f"metrics.networkPolicy.scrapers[{i}]: give podSelector, namespaceSelector "
                    f"and/or ipBlock, nothing else (got {sorted(peer)})"
                )
        return self


class Metrics(_Values):
    enabled: bool = Field(
        default=True,
        description="Serve the operator's Prometheus /metrics (ENCODERPOOL_METRICS_PORT; 0 when "
        "false) on the container port named metrics, behind a ClusterIP Service. Every replica "
        "serves it; only the Lease holder reconciles, so a standby reports zero reconciles and "
        "no pools.",
    )
    port: int = Field(
        default=8081,
        ge=1024,
        le=65535,
        json_schema_extra={"not": {"const": HEALTH_PORT}},
        description=f"Container and Service port of /metrics; unprivileged (the pod runs as "
        f"uid 1000), and not {HEALTH_PORT}, kopf's health port.",
    )
    network_policy: MetricsNetworkPolicy = Field(
        default_factory=MetricsNetworkPolicy, alias="networkPolicy"
    )

    @model_validator(mode="after")
    def _not_the_health_port(self) -> Metrics:
        if self.port == HEALTH_PORT:
            raise ValueError(f"metrics.port: {HEALTH_PORT} is kopf's health port")
        return self


class ServiceMonitor(_Values):
    # scrapeTimeout <= interval cannot be said in JSON Schema; the template fails on it
    # (helm template, install, upgrade; helm lint ignores a template's `fail`).
    enabled: bool = Field(
        default=False,
        description="Render a monitoring.coreos.com/v1 ServiceMonitor (prometheus-operator's "
        "CRD must be installed) for the metrics Service. Needs metrics.enabled.",
    )
    interval: str = Field(
        default="30s",
        min_length=2,
        max_length=32,
        pattern=_DURATION,
        description="How often Prometheus scrapes each replica (a duration: 30s, 1m).",
    )
    scrape_timeout: str = Field(
        default="10s",
        min_length=2,
        max_length=32,
        pattern=_DURATION,
        alias="scrapeTimeout",
        description="Scrape timeout; at most the interval.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        json_schema_extra={
            "propertyNames": {
                "maxLength": 253,
                "pattern": _LABEL_KEY,
                "not": {"pattern": _CHART_LABELS},
            },
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": _LABEL_VALUE},
        },
        description="Extra labels on the ServiceMonitor, e.g. what your Prometheus's "
        "serviceMonitorSelector matches (release: kube-prometheus-stack). Not the chart's own "
        "app.kubernetes.io/ or helm.sh/ labels.",
    )

    @model_validator(mode="after")
    def _valid(self) -> ServiceMonitor:
        if duration_ms(self.scrape_timeout) > duration_ms(self.interval):
            raise ValueError("serviceMonitor.scrapeTimeout: longer than serviceMonitor.interval")
        for key, value in self.labels.items():
            if not re.match(_LABEL_KEY, key) or re.match(_CHART_LABELS, key):
                raise ValueError(f"serviceMonitor.labels: {key!r} is not a label key of its own")
            if len(value) > 63 or not re.match(_LABEL_VALUE, value):
                raise ValueError(f"serviceMonitor.labels: {value!r} is not a label value")
        return self


class AutoscalingPrometheus(_Values):
    address: str = Field(
        default="",
        max_length=1024,
        pattern=r"^(https?://\S+)?$",
        description="ENCODERPOOL_PROMETHEUS_ADDRESS: the Prometheus KEDA queries; empty: none.",
    )


class Autoscaling(_Values):
    engine: Literal["keda", "hpa"] = Field(
        default=_SETTINGS["autoscaling_engine"].default,
        description="ENCODERPOOL_AUTOSCALING_ENGINE: keda (ScaledObjects) or hpa "
        "(HorizontalPodAutoscalers on External metrics).",
    )
    prometheus: AutoscalingPrometheus = Field(default_factory=AutoscalingPrometheus)


class GrafanaDashboard(_Values):
    enabled: bool = Field(
        default=False,
        description="A ConfigMap holding the pools' Grafana dashboard (files/dashboard.json), "
        "labelled for the Grafana sidecar.",
    )
    labels: dict[str, str] = Field(
        default_factory=lambda: {"grafana_dashboard": "1"},
        max_length=16,
        description="Labels the Grafana sidecar looks for.",
    )


class PrometheusRuleValues(_Values):
    enabled: bool = Field(
        default=False,
        description="A monitoring.coreos.com/v1 PrometheusRule with the pools' alerts "
        "(files/alerts.json); needs the Prometheus Operator's CRDs.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description="Extra labels, e.g. what the Prometheus' ruleSelector matches.",
    )


class PodDisruptionBudget(_Values):
    enabled: bool = Field(
        default=True,
        description="With replicaCount > 1, a policy/v1 PodDisruptionBudget with minAvailable: 1, "
        "so a node drain never evicts every operator replica at once.",
    )


class ChartValues(_Values):
    """values.yaml of charts/encoderpool-operator."""

    # The schema's half of _service_monitor_needs_metrics (helm lint ignores a template's fail).
    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "properties": {"serviceMonitor": {"properties": {"enabled": {"const": True}}}},
                "required": ["serviceMonitor"],
            },
            "then": {"properties": {"metrics": {"properties": {"enabled": {"const": True}}}}},
        }
    )

    name_override: str = Field(default="", max_length=63, alias="nameOverride")
    fullname_override: str = Field(default="", max_length=63, alias="fullnameOverride")
    scope: Literal["cluster", "namespace"] = Field(
        default="cluster",
        description="cluster: watch EncoderPools in every namespace (ClusterRole). namespace: "
        "only in the release namespace (a Role; no cluster-scoped permission at all).",
    )
    replica_count: int = Field(
        default=2,
        ge=1,
        le=5,
        alias="replicaCount",
        description="Operator pods; all watch, the holder of the Lease reconciles.",
    )
    image: Image = Field(default_factory=Image)
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, alias="imagePullSecrets"
    )
    service_account: ServiceAccount = Field(default_factory=ServiceAccount, alias="serviceAccount")
    rbac: Rbac = Field(default_factory=Rbac)
    leader_election: LeaderElection = Field(default_factory=LeaderElection, alias="leaderElection")
    operator: Operator = Field(default_factory=Operator)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    metrics: Metrics = Field(default_factory=Metrics)
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor, alias="serviceMonitor")
    grafana_dashboard: GrafanaDashboard = Field(
        default_factory=GrafanaDashboard, alias="grafanaDashboard"
    )
    prometheus_rule: PrometheusRuleValues = Field(
        default_factory=PrometheusRuleValues, alias="prometheusRule"
    )
    pod_disruption_budget: PodDisruptionBudget = Field(
        default_factory=PodDisruptionBudget, alias="podDisruptionBudget"
    )
    resources: Resources = Field(
        default_factory=Resources, description="The operator container's resources."
    )
    pod_annotations: dict[str, str] = Field(default_factory=dict, alias="podAnnotations")
    pod_labels: dict[str, str] = Field(default_factory=dict, alias="podLabels")
    priority_class_name: str = Field(default="", max_length=253, alias="priorityClassName")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, max_length=32)
    affinity: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _service_monitor_needs_metrics(self) -> ChartValues:
        if self.service_monitor.enabled and not self.metrics.enabled:
            raise ValueError("serviceMonitor.enabled: needs metrics.enabled")
        return self


def schema() -> dict[str, Any]:
    out = ChartValues.model_json_schema(by_alias=True, mode="validation")
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return out


def rbac_json() -> str:
    """files/rbac.json: each install mode's rules, with each rule's reason (the chart prints it)."""
    return json.dumps({mode: rbac.rules(mode) for mode in rbac.MODES}, indent=2) + "\n"


def _derived() -> dict[str, str]:
    """Chart-relative path -> the text it must hold."""
    return {
        "values.schema.json": json.dumps(schema(), indent=2, sort_keys=True) + "\n",
        "files/rbac.json": rbac_json(),
        "files/dashboard.json": monitoring.dashboard_json(),
        "files/alerts.json": monitoring.alerts_json(),
        f"crds/{crd.FILENAME}": crd.render(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m encoderpool_codegen.chart")
    parser.add_argument("chart", type=Path, help="charts/encoderpool-operator")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in _derived().items():
        path = args.chart / rel
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run {parser.prog} {args.chart}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

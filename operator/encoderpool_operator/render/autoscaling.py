"""Each autoscaling role's autoscaler: a KEDA ScaledObject, or a plain HorizontalPodAutoscaler.

One per role that sets ``autoscaling`` (the producers or each producer group, the
consumers), named like the role's Deployment. KEDA (the default engine) queries the
cluster's Prometheus itself and takes a role to and from zero; the HPA engine reads
External metrics through the cluster's own adapter. The queries and metric names come
from ``encoderpool_contracts.signals`` (docs/autoscaling.md says why each signal).

KEDA makes a HorizontalPodAutoscaler for each ScaledObject, and takes over one of that
name that exists already, whoever owns it: the operator names it itself (like the
Deployment, ``hpa_name``) and reads it as a child, so the plan withholds a ScaledObject
whose HPA name is someone else's (``withheld`` in ``autoscaler_objects``).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any

from encoderpool_contracts.signals import (
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_NAMESPACE,
    LABEL_POOL,
    VLLM_KV_CACHE_USAGE,
    VLLM_REQUESTS_RUNNING,
    VLLM_REQUESTS_WAITING,
)
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.api.autoscaling import (
    DEFAULT_CONSUMER_TARGET,
    DEFAULT_PRODUCER_TARGET,
    Autoscaling,
    ScalingRate,
)
from encoderpool_operator.kinds import HORIZONTAL_POD_AUTOSCALER, SCALED_OBJECT, Engine
from encoderpool_operator.naming import (
    CONSUMER,
    ROUTER,
    Ref,
    child_meta,
    group_component,
    name_of,
    producer_components,
)
from encoderpool_operator.render.family import Defaults, Family, Inputs

# The window the rates are taken over: at least four samples at a 15 s scrape interval.
RATE_WINDOW = "1m"
# The window of the wake signal (items that found no producer): a group woken from zero
# stays up at least this long. A vLLM encoder takes minutes to start; with a shorter
# window the signal fades while the first pod loads, and the group sleeps again before
# it ever serves (seen in kind under load: woken, then scaled to zero 80 s later).
WAKE_WINDOW = "5m"
# How often KEDA evaluates a trigger (its activation, 0 <-> 1, is KEDA's own loop; the
# HPA controller does the rest on its sync period).
KEDA_POLLING_SECONDS = 10
# The External metric names the HPA engine asks the cluster's adapter for
# (docs/autoscaling.md has prometheus-adapter rules that serve them).
HPA_ENCODER_DEMAND = "encoderpool_encoder_demand"
HPA_ENCODER_UNSERVED = "encoderpool_encoder_unserved"
HPA_LM_DEMAND = "encoderpool_lm_demand"
HPA_KV_CACHE_USAGE = "encoderpool_kv_cache_usage"
# The wake signal's target: its query is clamped to 1, so it asks for one pod at most.
WAKE_TARGET = 1.0


@dataclass(frozen=True)
class Trigger:
    """One signal of one role: its query, the KEDA trigger name and the HPA metric name."""

    name: str
    query: str
    target: float
    hpa_metric: str
    hpa_selector: dict[str, str]
    # Above this value KEDA wakes a role at zero (its activation threshold).
    activation: float = 0.0


@dataclass(frozen=True)
class Scaler:
    """One role's autoscaler, before it is rendered for an engine."""

    component: str
    deployment: str
    settings: Autoscaling
    triggers: tuple[Trigger, ...]
    group: str | None = None  # the producer group, if the role is one

    @property
    def name(self) -> str:
        """The ScaledObject or HPA: named like its Deployment."""
        return self.deployment

    @property
    def hpa_name(self) -> str:
        """The HorizontalPodAutoscaler either engine drives the Deployment through (KEDA's
        named by the operator, not ``keda-hpa-<name>``), one name for both engines."""
        return self.deployment


def _selector(pool: EncoderPool, **extra: str) -> str:
    labels = _hpa_selector(pool, **extra)
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def _hpa_selector(pool: EncoderPool, **extra: str) -> dict[str, str]:
    """The labels a signal is selected by: the pool's namespace and name, the component
    (and group) that exports it. Both engines select by all of them: pool names repeat
    across namespaces, and the router and vLLM export series of one pool."""
    return {LABEL_NAMESPACE: pool.namespace, LABEL_POOL: pool.name, **extra}


def producer_triggers(pool: EncoderPool, component: str, settings: Autoscaling) -> list[Trigger]:
    """Mean items in flight to the group, and the items that found it at zero (which wake it:
    an item that found no producer counts as one producer's worth of demand)."""
    group = name_of(pool, component)  # the router labels a group by its producer Service
    labels = {LABEL_COMPONENT: ROUTER, LABEL_GROUP: group}
    sel = _selector(pool, **labels)
    hpa_sel = _hpa_selector(pool, **labels)
    return [
        Trigger(
            "encoder-demand",
            f"sum(rate({ENCODER_INFLIGHT_SECONDS}{{{sel}}}[{RATE_WINDOW}])) or vector(0)",
            settings.target or DEFAULT_PRODUCER_TARGET,
            HPA_ENCODER_DEMAND,
            hpa_sel,
        ),
        Trigger(
            "encoder-unserved",
            # Clamped to 1 with a target of 1 (AverageValue): the wake signal takes a role
            # from zero to one and never past it; demand above one pod is encoder-demand's.
            f"clamp_max(sum(rate({ENCODER_UNSERVED_ITEMS}{{{sel}}}[{WAKE_WINDOW}])), 1)"
            " or vector(0)",
            WAKE_TARGET,
            HPA_ENCODER_UNSERVED,
            hpa_sel,
        ),
    ]


def _gauge_mean(name: str, sel: str) -> str:
    """A gauge summed over the consumers, each pod's value its mean over ``RATE_WINDOW``.

    vLLM serves /metrics from its API server, which answers late under load; a scrape
    that fails marks the pod's series stale at once, and an instant ``sum()`` would read
    the pool as idle until the next scrape: the autoscaler then removed the very pod that
    was starting (seen on kind under load: three new consumers killed in a row). The
    mean over the window keeps the samples it has."""
    return f"sum(avg_over_time({name}{{{sel}}}[{RATE_WINDOW}]))"


def consumer_triggers(pool: EncoderPool, settings: Autoscaling) -> list[Trigger]:
    """vLLM's running plus waiting requests over the consumers; optionally KV-cache use."""
    sel = _selector(pool, **{LABEL_COMPONENT: CONSUMER})
    hpa_sel = _hpa_selector(pool, **{LABEL_COMPONENT: CONSUMER})
    out = [
        Trigger(
            "lm-demand",
            f"({_gauge_mean(VLLM_REQUESTS_RUNNING, sel)} + "
            f"{_gauge_mean(VLLM_REQUESTS_WAITING, sel)}) or vector(0)",
            settings.target or DEFAULT_CONSUMER_TARGET,
            HPA_LM_DEMAND,
            hpa_sel,
        )
    ]
    if settings.target_kv_cache_usage is not None:
        # Summed over the consumers like the others: AverageValue divides by the pods,
        # so the target is the mean use of one pod.
        out.append(
            Trigger(
                "kv-cache-usage",
                f"{_gauge_mean(VLLM_KV_CACHE_USAGE, sel)} or vector(0)",
                settings.target_kv_cache_usage,
                HPA_KV_CACHE_USAGE,
                hpa_sel,
            )
        )
    return out


def scalers(pool: EncoderPool) -> list[Scaler]:
    """Every role of ``pool`` that autoscales, producers first."""
    out: list[Scaler] = []
    groups = {group_component(g): g.name for g in pool.spec.producer_groups}
    for component, role in producer_components(pool):
        if role.autoscaling is not None:
            triggers = producer_triggers(pool, component, role.autoscaling)
            group = groups.get(component)
            out.append(
                Scaler(
                    component, name_of(pool, component), role.autoscaling, tuple(triggers), group
                )
            )
    consumer = pool.spec.consumer.autoscaling
    if consumer is not None:
        triggers = consumer_triggers(pool, consumer)
        out.append(Scaler(CONSUMER, name_of(pool, CONSUMER), consumer, tuple(triggers)))
    return out


def _rate(rate: ScalingRate, policy_type: str = "Pods") -> dict[str, Any]:
    """One direction of the HPA's ``behavior``."""
    out: dict[str, Any] = {"stabilizationWindowSeconds": rate.stabilization_window_seconds}
    if rate.max_replicas_per_step is not None:
        out["policies"] = [
            {
                "type": policy_type,
                "value": rate.max_replicas_per_step,
                "periodSeconds": rate.period_seconds,
            }
        ]
        out["selectPolicy"] = "Max"
    return out


def behavior(settings: Autoscaling) -> dict[str, Any]:
    return {"scaleUp": _rate(settings.scale_up), "scaleDown": _rate(settings.scale_down)}


def _number(value: float) -> str:
    """KEDA's trigger metadata takes strings; whole numbers without a trailing .0."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def scaled_object(pool: EncoderPool, scaler: Scaler, prometheus: str) -> dict[str, Any]:
    """A KEDA ScaledObject: Prometheus triggers, the role's bounds and behaviour.

    ``cooldownPeriod`` (KEDA's wait before 1 -> 0) follows the scale-down window, so a
    role sleeps no sooner than it would shrink.
    """
    s = scaler.settings
    return {
        "apiVersion": SCALED_OBJECT.api_version,
        "kind": "ScaledObject",
        "metadata": child_meta(pool, scaler.deployment, scaler.component),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": scaler.deployment,
            },
            "minReplicaCount": s.min_replicas,
            "maxReplicaCount": s.max_replicas,
            "pollingInterval": KEDA_POLLING_SECONDS,
            "cooldownPeriod": max(s.scale_down.stabilization_window_seconds, KEDA_POLLING_SECONDS),
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "name": scaler.hpa_name,
                    "behavior": behavior(s),
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "name": t.name,
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": prometheus,
                        "query": t.query,
                        "threshold": _number(t.target),
                        "activationThreshold": _number(t.activation),
                        "ignoreNullValues": "true",
                    },
                }
                for t in scaler.triggers
            ],
        },
    }


def horizontal_pod_autoscaler(pool: EncoderPool, scaler: Scaler) -> dict[str, Any]:
    """A plain HPA on External metrics (AverageValue: the metric over the pods)."""
    s = scaler.settings
    return {
        "apiVersion": HORIZONTAL_POD_AUTOSCALER.api_version,
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_meta(pool, scaler.deployment, scaler.component),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": scaler.deployment,
            },
            # An HPA cannot take a Deployment to zero (without an alpha feature gate):
            # plan refuses minReplicas 0 with this engine before this renders.
            "minReplicas": max(s.min_replicas, 1),
            "maxReplicas": s.max_replicas,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": t.hpa_metric,
                            "selector": {"matchLabels": dict(t.hpa_selector)},
                        },
                        "target": {"type": "AverageValue", "averageValue": _number(t.target)},
                    },
                }
                for t in scaler.triggers
            ],
            "behavior": behavior(s),
        },
    }


def rendered_scalers(
    pool: EncoderPool, engine: Engine, prometheus: str | None, withheld: Set[str] = frozenset()
) -> list[Scaler]:
    """The scalers rendered: none when KEDA has no Prometheus to ask (plan reports that
    instead), none whose component the plan ``withheld`` (their Deployment or a name is
    not the pool's)."""
    if engine == "keda" and prometheus is None:
        return []
    return [s for s in scalers(pool) if s.component not in withheld]


def autoscaler_objects(
    pool: EncoderPool, engine: Engine, prometheus: str | None, withheld: Set[str] = frozenset()
) -> list[dict[str, Any]]:
    """The autoscalers of ``pool``'s autoscaling roles (``rendered_scalers``)."""
    found = rendered_scalers(pool, engine, prometheus, withheld)
    if engine == "hpa":
        return [horizontal_pod_autoscaler(pool, s) for s in found]
    return [scaled_object(pool, s, prometheus) for s in found if prometheus is not None]


def scaler_ref(engine: Engine, scaler: Scaler) -> Ref:
    """(apiVersion, kind, name) of ``scaler``'s autoscaler with ``engine``."""
    if engine == "hpa":
        return HORIZONTAL_POD_AUTOSCALER.ref(scaler.name)
    return SCALED_OBJECT.ref(scaler.name)


def hpa_ref(scaler: Scaler) -> Ref:
    """The HorizontalPodAutoscaler that drives ``scaler``'s Deployment (either engine's)."""
    return HORIZONTAL_POD_AUTOSCALER.ref(scaler.hpa_name)


def autoscaler_refs(
    pool: EncoderPool, engine: Engine, prometheus: str | None, withheld: Set[str] = frozenset()
) -> list[Ref]:
    """(apiVersion, kind, name) of what ``autoscaler_objects`` returns."""
    return [scaler_ref(engine, s) for s in rendered_scalers(pool, engine, prometheus, withheld)]


def keda_hpa_refs(pool: EncoderPool, engine: Engine, prometheus: str | None) -> list[Ref]:
    """The HorizontalPodAutoscalers KEDA makes for the pool's ScaledObjects: not the
    operator's to write, but read like its children (whose they are, what they report)."""
    if engine != "keda":
        return []
    return [hpa_ref(s) for s in rendered_scalers(pool, engine, prometheus)]


def autoscaling_problem(pool: EncoderPool, engine: Engine, prometheus: str | None) -> str | None:
    """What keeps this pool's autoscaling from working with this operator's settings."""
    found = scalers(pool)
    if not found:
        return None
    if engine == "keda" and prometheus is None:
        return (
            "spec autoscaling needs a Prometheus for KEDA to query, and the operator has none: "
            "set the chart's autoscaling.prometheus.address (ENCODERPOOL_PROMETHEUS_ADDRESS)"
        )
    if engine == "hpa":
        zero = [s.component for s in found if s.settings.min_replicas == 0]
        if zero:
            return (
                f"autoscaling.minReplicas 0 ({', '.join(zero)}) needs the KEDA engine: a "
                "HorizontalPodAutoscaler cannot scale to zero; set minReplicas to 1 or "
                "install KEDA and set the chart's autoscaling.engine to keda"
            )
    return None


def _objects(pool: EncoderPool, inputs: Inputs) -> list[dict[str, Any]]:
    d = inputs.defaults
    return autoscaler_objects(
        pool, d.autoscaling_engine, d.prometheus_address, inputs.observed.withheld
    )


def _refs(pool: EncoderPool, defaults: Defaults | None, withheld: frozenset[str]) -> list[Ref]:
    if defaults is None:
        return []
    return autoscaler_refs(pool, defaults.autoscaling_engine, defaults.prometheus_address, withheld)


FAMILY = Family("autoscaling", (SCALED_OBJECT, HORIZONTAL_POD_AUTOSCALER), _objects, _refs)

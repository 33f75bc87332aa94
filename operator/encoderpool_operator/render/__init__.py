"""Pure functions from an EncoderPool (plus what was measured) to the objects it needs.

No I/O here: the reconcile applies what these return, and tests read them
directly. Every child has a fixed name derived from the pool's, the pool as
its controller owner (so deleting the pool deletes them), the
``app.kubernetes.io/*`` labels (all three from ``naming``), and only the
fields we mean to own (they are server-side applied).

One module per family of children:

    transport  what differs between sharedVolume and rdma (the one place that asks)
    vllm       producer and consumer Deployments and Services, vLLM's args
    router     the router's Deployment, Service, RBAC and args
    network    the NetworkPolicies
    widths     the width Job, the report ConfigMap, the report key
    secret     the pool's internal Secret
    pod        building blocks every pod shares (security, podTemplate merge, ...)

    autoscaling  each autoscaling role's ScaledObject or HorizontalPodAutoscaler

A new family is a module of its own, added to ``workload_objects`` and
``child_refs`` below and its kinds to ``naming.CHILD_KINDS`` (so that the
reconcile prunes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from encoderpool_contracts import WidthReport
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.naming import (
    ANNOTATION_DIGEST,
    CACHE,
    CONSUMER,
    Ref,
    config_hash,
    name_of,
    producer_components,
    ref_of,
)
from encoderpool_operator.render.autoscaling import (
    Engine,
    autoscaler_objects,
    autoscaler_refs,
)
from encoderpool_operator.render.network import network_policies
from encoderpool_operator.render.router import router_objects, router_refs
from encoderpool_operator.render.transport import cache_claim
from encoderpool_operator.render.vllm import vllm_deployments, vllm_services

__all__ = ["Defaults", "Observed", "child_refs", "with_digest", "workload_objects"]


@dataclass(frozen=True)
class Observed:
    """What rendering takes from the live world, read by the plan, so that rendering
    stays a pure function of its arguments."""

    # The pool's own Deployments by name: an autoscaling role keeps its live replicas
    # applied until its autoscaler holds them (render.vllm.deployment_replicas).
    deployments: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Components whose autoscaler is not rendered: its Deployment, or a name it needs,
    # is not the pool's (reconcile.scaling.withheld_autoscalers).
    withheld: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Defaults:
    """Operator-wide settings a reconcile needs (from OperatorSettings)."""

    router_image: str
    width_retry_seconds: float = 30.0  # first back-off after a failed width Job
    autoscaling_engine: Engine = "keda"  # what drives autoscaling roles
    prometheus_address: str | None = None  # what KEDA queries (the cluster's Prometheus)


def with_digest(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with ANNOTATION_DIGEST: a hash of the object as it is applied."""
    meta = obj["metadata"]
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k != ANNOTATION_DIGEST}
    body = {**obj, "metadata": {**meta, "annotations": annotations}}
    annotations = {**annotations, ANNOTATION_DIGEST: config_hash(body)}
    return {**obj, "metadata": {**meta, "annotations": annotations}}


def workload_objects(
    pool: EncoderPool, report: WidthReport, defaults: Defaults, observed: Observed | None = None
) -> list[dict[str, Any]]:
    """Everything that serves traffic, for a measured model: in apply order, each with
    its digest."""
    observed = observed or Observed()
    config = pool.spec.connector_config(
        report.fingerprint, report.encoder_output_widths, report.identity
    )
    claim = cache_claim(pool)
    objects = [
        *([claim] if claim is not None else []),
        *vllm_services(pool),
        *vllm_deployments(pool, config, observed.deployments),
        *router_objects(pool, defaults.router_image, report.encode_seconds),
        *network_policies(pool),
        *autoscaler_objects(
            pool, defaults.autoscaling_engine, defaults.prometheus_address, observed.withheld
        ),
    ]
    return [with_digest(o) for o in objects]


def child_refs(
    pool: EncoderPool, defaults: Defaults | None = None, withheld: frozenset[str] = frozenset()
) -> list[Ref]:
    """(apiVersion, kind, name) of what ``workload_objects`` returns, without a report.

    The reconcile reads these before it knows the report; a test keeps the two in step.
    Without ``defaults`` no autoscaler is named (as for KEDA with no Prometheus).
    """
    refs: list[Ref] = []
    if cache_claim(pool) is not None:
        refs.append(("v1", "PersistentVolumeClaim", name_of(pool, CACHE)))
    producers = [name_of(pool, c) for c, _ in producer_components(pool)]
    refs += [("v1", "Service", name) for name in producers]
    refs.append(("v1", "Service", name_of(pool, CONSUMER)))
    refs += [("apps/v1", "Deployment", name) for name in producers]
    refs.append(("apps/v1", "Deployment", name_of(pool, CONSUMER)))
    refs += router_refs(pool)
    refs += [ref_of(p) for p in network_policies(pool)]
    if defaults is not None:
        refs += autoscaler_refs(
            pool, defaults.autoscaling_engine, defaults.prometheus_address, withheld
        )
    return refs

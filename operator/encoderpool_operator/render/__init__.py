"""Pure functions from an EncoderPool (plus what was measured) to the objects it needs.

No I/O here: the reconcile applies what these return, and tests read them
directly. Every child has a fixed name derived from the pool's, the pool as
its controller owner (so deleting the pool deletes them), the
``app.kubernetes.io/*`` labels (all three from ``naming``), and only the
fields we mean to own (they are server-side applied).

One module per family of children, each ending with its ``FAMILY`` (the kinds it
renders, its objects and their refs: ``family.Family``):

    transport  what differs between sharedVolume and rdma (the one place that asks)
    vllm       producer and consumer Deployments and Services, vLLM's args
    router     the router's Deployment, Service, RBAC and args
    network    the NetworkPolicies
    widths     the width Job, the report ConfigMap, the report key
    secret     the pool's internal Secret
    pod        building blocks every pod shares (security, podTemplate merge, ...)

    autoscaling  each autoscaling role's ScaledObject or HorizontalPodAutoscaler

``FAMILIES`` lists them; ``workload_objects``, ``child_refs``, ``WORKLOAD_KINDS`` (what
the reconcile prunes) and ``FAMILY_KINDS`` (what the read cache keeps) derive from it.
A new family is a module of its own and one entry there; a new kind is a
``kinds.Kind`` its family names.
"""

from __future__ import annotations

from typing import Any

from encoderpool_contracts import WidthReport
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kinds import Kind
from encoderpool_operator.naming import ANNOTATION_DIGEST, Ref, config_hash
from encoderpool_operator.render import (
    autoscaling,
    network,
    router,
    secret,
    transport,
    vllm,
    widths,
)
from encoderpool_operator.render.family import Defaults, Family, Inputs, Observed

__all__ = [
    "FAMILIES",
    "FAMILY_KINDS",
    "WORKLOAD_KINDS",
    "Defaults",
    "Family",
    "Observed",
    "child_refs",
    "with_digest",
    "workload_objects",
]

# Every family, the workload's in apply order (the PVC and Services before the
# Deployments that use them, a Deployment before its autoscaler).
FAMILIES: tuple[Family, ...] = (
    transport.FAMILY,
    vllm.FAMILY,
    router.FAMILY,
    network.FAMILY,
    autoscaling.FAMILY,
    widths.FAMILY,
    secret.FAMILY,
)
_WORKLOAD = tuple(f for f in FAMILIES if f.workload)


def _kinds(families: tuple[Family, ...]) -> tuple[Kind, ...]:
    return tuple(dict.fromkeys(k for f in families for k in f.kinds))


# Every kind the families render or read, in the order of FAMILIES.
FAMILY_KINDS: tuple[Kind, ...] = _kinds(FAMILIES)
# Every kind a pool's workload can hold, (apiVersion, kind): what the reconcile lists
# (by the pool's label, kept only with the pool as controller) to prune what the spec
# no longer asks for. Width Jobs and report ConfigMaps have their own rules
# (reconcile/widths.py).
WORKLOAD_KINDS: tuple[tuple[str, str], ...] = tuple(k.key for k in _kinds(_WORKLOAD))


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
    inputs = Inputs(report, defaults, observed or Observed())
    return [with_digest(o) for f in _WORKLOAD if f.objects for o in f.objects(pool, inputs)]


def child_refs(
    pool: EncoderPool, defaults: Defaults | None = None, withheld: frozenset[str] = frozenset()
) -> list[Ref]:
    """(apiVersion, kind, name) of what ``workload_objects`` returns, without a report.

    The reconcile reads these before it knows the report; tests/operator/test_registry.py
    keeps each family's refs and objects in step. Without ``defaults`` no autoscaler is
    named (as for KEDA with no Prometheus).
    """
    return [r for f in _WORKLOAD if f.refs for r in f.refs(pool, defaults, withheld)]

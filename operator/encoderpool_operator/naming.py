"""What names and marks a pool's children: names, labels, annotation keys, owners.

The render modules stamp these on what they build; the reconcile, the read cache
and the kopf wiring find children by them. Defined once here so that what is
written and what is looked for cannot drift.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from encoderpool_operator.api import API_VERSION, KIND, EncoderPool, ProducerGroup, RoleSpec

# (apiVersion, kind, name) of an object in the pool's namespace.
Ref = tuple[str, str, str]

# Components: the value of LABEL_COMPONENT and the suffix of the child's name.
PRODUCER, CONSUMER, ROUTER, WIDTH_JOB = "producer", "consumer", "router", "width-job"
# The vLLM container of a producer or consumer pod (what the operator reads back from
# its pods: a refusal's termination message).
VLLM_CONTAINER = "vllm"
CACHE = "cache"  # the shared-volume PVC
INTERNAL = "internal"  # the pool's Secret of random keys
REPORT_COMPONENT = "width-report"  # the report ConfigMaps (shared by pools, named by key)

LABEL_POOL = "encoderpool.io/pool"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "encoderpool-operator"
# On width reports and Jobs: the key reports are named and shared by (render.widths.report_key).
LABEL_REPORT_KEY = "encoderpool.io/width-report-key"
# On a vLLM pod template: a digest of its container and pod spec (a change rolls the pods).
ANNOTATION_CONFIG_HASH = "encoderpool.io/config-hash"
# On every child: a digest of everything the operator applies to it. A field removed
# from the spec changes the digest, so the pass sees the change and re-applies, and
# server-side apply drops the field (is_subset alone cannot see a removal).
ANNOTATION_DIGEST = "encoderpool.io/spec-digest"
# On a report the operator stored: render.widths.report_digest of its data.
ANNOTATION_REPORT_DIGEST = "encoderpool.io/width-report-digest"
# The one field manager the operator applies as (server-side apply): what it owns of a
# child is what it last sent under this name.
FIELD_MANAGER = "encoderpool-operator"
# The longest object name the children may take (Services and Job names: DNS-1035 labels;
# a Job's name is also a label value on its pods).
MAX_CHILD_NAME = 63


def selector_labels(pool: EncoderPool, component: str) -> dict[str, str]:
    """Labels that select a component's pods; they never change for a pool."""
    return {
        "app.kubernetes.io/name": "encoderpool",
        "app.kubernetes.io/instance": pool.name,
        LABEL_COMPONENT: component,
    }


def labels(pool: EncoderPool, component: str) -> dict[str, str]:
    """Every label of a child: the selector's, plus who manages it and which pool it is."""
    return {
        **selector_labels(pool, component),
        LABEL_MANAGED_BY: MANAGED_BY,
        "app.kubernetes.io/part-of": "encoderpool",
        LABEL_POOL: pool.name,
    }


def owner_reference(pool: EncoderPool) -> dict[str, Any]:
    """The pool as controller: deleting the pool deletes the child."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pool.name,
        "uid": pool.metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def report_owner_reference(pool: EncoderPool) -> dict[str, Any]:
    """A pool's reference on a report it uses: an owner, not the controller (reports are shared)."""
    return {**owner_reference(pool), "controller": False}


def child_meta(pool: EncoderPool, name: str, component: str, **extra: Any) -> dict[str, Any]:
    """A child's metadata: its name, the pool's namespace, labels and controller reference."""
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": labels(pool, component),
        "ownerReferences": [owner_reference(pool)],
        **extra,
    }


def name_of(pool: EncoderPool, component: str) -> str:
    """Fixed child names: <pool>-producer, <pool>-consumer, <pool>-router; the Service is <pool>.

    A producer group's component (producer-<group>) can make the name longer than 63
    characters: then it is cut as ``bounded_name`` cuts it."""
    return bounded_name(pool.name, f"-{component}")


# Hex digits of the hash that keeps cut names apart: 64 bits, so that finding a second
# pool name with the same cut name takes about 2**64 tries, not seconds.
NAME_TAG_LENGTH = 16


def bounded_name(pool_name: str, suffix: str) -> str:
    """<pool><suffix>, at most 63 characters: a long pool name is cut and a hash of the
    whole name keeps two long names with one prefix apart."""
    name = pool_name + suffix
    if len(name) <= MAX_CHILD_NAME:
        return name
    tag = hashlib.sha256(pool_name.encode()).hexdigest()[:NAME_TAG_LENGTH]
    head = pool_name[: MAX_CHILD_NAME - len(suffix) - len(tag) - 1].rstrip("-")
    return f"{head}-{tag}{suffix}"


def width_job_name(pool: EncoderPool, key: str) -> str:
    """<pool>-width-<report key>, at most 63 characters (``bounded_name``)."""
    return bounded_name(pool.name, f"-width-{key[:10]}")


def group_component(group: ProducerGroup) -> str:
    """The component (label value and name suffix) of a producer group's children."""
    return f"{PRODUCER}-{group.name}"


def producer_components(pool: EncoderPool) -> list[tuple[str, RoleSpec]]:
    """Each producer Deployment as (component, its pod settings): ``producer`` alone, or
    one ``producer-<group>`` per spec.producerGroups entry (and then no ``producer``)."""
    spec = pool.spec
    if not spec.producer_groups:
        return [(PRODUCER, spec.producer)]
    return [(group_component(g), g.role(spec.producer)) for g in spec.producer_groups]


def vllm_components(pool: EncoderPool) -> list[str]:
    """The components of the pool's vLLM Deployments: each producer one, the consumers."""
    return [*(c for c, _ in producer_components(pool)), CONSUMER]


def replicas_managers(obj: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Field managers that own ``spec.replicas`` of ``obj`` (from metadata.managedFields).

    The HPA controller (``kube-controller-manager``) and KEDA write replicas through the
    scale subresource: an entry of theirs owns the field once they changed it."""
    entries = ((obj or {}).get("metadata") or {}).get("managedFields") or []
    return tuple(
        str(e.get("manager", ""))
        for e in entries
        if isinstance(e, Mapping)
        and isinstance(spec := (e.get("fieldsV1") or {}).get("f:spec"), Mapping)
        and "f:replicas" in spec
    )


def replicas_entries(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """metadata.managedFields cut to who owns ``spec.replicas``: all a pass reads of them
    (``replicas_managers``), kept by the read cache instead of the whole list."""
    out = []
    for e in meta.get("managedFields") or []:
        if isinstance(e, Mapping) and replicas_managers({"metadata": {"managedFields": [e]}}):
            kept = {k: e[k] for k in ("manager", "operation", "subresource") if k in e}
            out.append({**kept, "fieldsV1": {"f:spec": {"f:replicas": {}}}})
    return out


def ref_of(obj: Mapping[str, Any]) -> Ref:
    """(apiVersion, kind, name) of a child in the pool's namespace."""
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


def config_hash(*parts: Any) -> str:
    """A short digest of JSON-able ``parts`` (key order does not matter): the value of
    the digest annotations, and of the report key."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]

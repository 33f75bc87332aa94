"""Observe: every read of one pass, done before any decision, into one ``Snapshot``.

Reading everything first means the plan sees one consistent picture and can
be tested without a cluster: a test builds a ``Snapshot`` (snapshot.py) by hand.
Reads that depend on earlier reads stay here too (a completed width Job's pods
are read only when its report is not in the ConfigMap yet), so the plan never
asks for more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from encoderpool_contracts import (
    TERMINATION_MESSAGE_LIMIT,
    WIDTH_MISMATCH,
    WidthMismatch,
    configmap_name,
)
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.cache import Reader, controller_uid
from encoderpool_operator.naming import (
    LABEL_COMPONENT,
    LABEL_POOL,
    VLLM_CONTAINER,
    WIDTH_JOB,
    Ref,
    vllm_components,
)
from encoderpool_operator.reconcile.snapshot import Snapshot
from encoderpool_operator.reconcile.widths import job_state, parse_report
from encoderpool_operator.render import WORKLOAD_KINDS, Defaults, child_refs
from encoderpool_operator.render.autoscaling import keda_hpa_refs
from encoderpool_operator.render.widths import report_key

# The label the Job controller puts on each of a Job's pods: the Job's uid, so the
# pods of a deleted and recreated Job of the same name are never mistaken for its own.
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"


def observe(kube: Reader, obj: Mapping[str, Any], defaults: Defaults | None = None) -> Snapshot:
    """Read one pool's world. Raises ValueError (naming the field) for an invalid spec.

    Children come from one list per kind (by the pool's label, kept when the pool is
    their controller); a wanted child missing from those lists is read by name, so an
    object of someone else's with that name is seen (and left alone). ``kube`` is the
    API server itself or, in the operator, the read cache (``cache.PassView``).
    """
    pool = EncoderPool.from_object(obj)
    ns = pool.namespace
    uid = pool.metadata.get("uid")
    fingerprint = pool.spec.model_identity(pool.spec.image).fingerprint()
    key = report_key(pool)
    report_cm = kube.get("v1", "ConfigMap", ns, configmap_name(key))
    pool_selector = f"{LABEL_POOL}={pool.name}"
    owned: dict[Ref, Mapping[str, Any]] = {}
    for api_version, kind in WORKLOAD_KINDS:
        for item in kube.list(api_version, kind, ns, pool_selector):
            if controller_uid(item) == uid:  # a list's items carry no apiVersion/kind
                owned[(api_version, kind, item["metadata"]["name"])] = {
                    **item,
                    "apiVersion": api_version,
                    "kind": kind,
                }
    refs = child_refs(pool, defaults)
    if defaults is not None:  # the HPAs KEDA makes: whose they are decides the ScaledObject
        refs += keda_hpa_refs(pool, defaults.autoscaling_engine, defaults.prometheus_address)
    live: dict[Ref, Mapping[str, Any] | None] = {
        ref: owned[ref] if ref in owned else kube.get(ref[0], ref[1], ns, ref[2]) for ref in refs
    }
    jobs = kube.list("batch/v1", "Job", ns, f"{pool_selector},{LABEL_COMPONENT}={WIDTH_JOB}")
    snap = Snapshot(
        pool=pool,
        fingerprint=fingerprint,
        report_cm=report_cm,
        width_jobs=tuple(j for j in jobs if controller_uid(j) == uid),
        live=live,
        owned=owned,
    )
    has_report = parse_report(report_cm, key, fingerprint)[0] is not None
    job = snap.job
    if job is None and not has_report:  # about to create it: is the name someone else's?
        ref = ("batch/v1", "Job", snap.job_name)
        snap = replace(snap, live={**live, ref: kube.get(*ref[:2], ns, ref[2])})
    if job is not None and job_state(job)[0] == "Complete" and not has_report:
        pods = kube.list("v1", "Pod", ns, f"{JOB_UID_LABEL}={job['metadata']['uid']}")
        snap = replace(snap, job_pods=tuple(pods))
    if refusals := width_refusals(kube, snap):
        snap = replace(snap, refusals=refusals)
    return snap


# How many pods of one Deployment are read for a refusal: a crash-looping Deployment's
# pods all say the same, and one is enough to name it.
REFUSAL_PODS_READ = 8


def width_refusals(kube: Reader, snap: Snapshot) -> dict[str, tuple[str, WidthMismatch]]:
    """For each vLLM Deployment of the pool that is not fully available, the first of its
    pods (at most ``REFUSAL_PODS_READ``) whose vLLM refused to start because the width
    report does not match its encoder (``WidthMismatch``, the container's termination
    message). Pods are read only while a Deployment lacks pods, so a healthy pool costs
    no list."""
    out: dict[str, tuple[str, WidthMismatch]] = {}
    for component in vllm_components(snap.pool):
        dep = snap.deployment(component)
        if dep is None:
            continue
        want = dep.get("spec", {}).get("replicas", 1)
        if dep.get("status", {}).get("availableReplicas", 0) >= want:
            continue
        labels = dep.get("spec", {}).get("selector", {}).get("matchLabels") or {}
        if not labels:
            continue
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        for pod in kube.list("v1", "Pod", snap.pool.namespace, selector)[:REFUSAL_PODS_READ]:
            if (said := width_mismatch_of(pod)) is not None:
                out[component] = (str(pod["metadata"]["name"]), said)
                break
    return out


def width_mismatch_of(pod: Mapping[str, Any]) -> WidthMismatch | None:
    """A refusal the pod's vLLM container left as its termination message (current state
    or the last one), or None. Anything else in a message is not ours to read."""
    for status in (pod.get("status", {}).get("containerStatuses") or [])[:4]:
        if status.get("name") != VLLM_CONTAINER:
            continue
        for state in (status.get("state"), status.get("lastState")):
            message = ((state or {}).get("terminated") or {}).get("message") or ""
            if WIDTH_MISMATCH not in message[:TERMINATION_MESSAGE_LIMIT]:
                continue
            try:
                return WidthMismatch.from_termination_message(message[:TERMINATION_MESSAGE_LIMIT])
            except ValueError:
                continue
    return None

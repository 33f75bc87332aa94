"""Observe: every read of one pass, done before any decision, into one ``Snapshot``.

Reading everything first means the plan sees one consistent picture and can
be tested without a cluster: a test builds a ``Snapshot`` by hand. Reads that
depend on earlier reads stay here too (a completed width Job's pods are read
only when its report is not in the ConfigMap yet), so the plan never asks for
more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import cached_property
from typing import Any

from encoderpool_contracts import configmap_name
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.cache import Reader, controller_uid
from encoderpool_operator.naming import (
    LABEL_COMPONENT,
    LABEL_POOL,
    WIDTH_JOB,
    Ref,
    name_of,
    width_job_name,
)
from encoderpool_operator.reconcile.widths import job_state, parse_report
from encoderpool_operator.render import WORKLOAD_KINDS, Defaults, child_refs
from encoderpool_operator.render.autoscaling import keda_hpa_refs
from encoderpool_operator.render.widths import report_key

# The label the Job controller puts on each of a Job's pods: the Job's uid, so the
# pods of a deleted and recreated Job of the same name are never mistaken for its own.
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"


@dataclass(frozen=True)
class Snapshot:
    """What one pass knows about one pool and its children, as read from the API server."""

    pool: EncoderPool
    fingerprint: str
    report_cm: Mapping[str, Any] | None = None
    # This pool's width Jobs (controlled by it), of any model (the current one among them).
    width_jobs: tuple[Mapping[str, Any], ...] = ()
    # Pods of the current width Job: read only once it completed and no report is stored.
    job_pods: tuple[Mapping[str, Any], ...] = ()
    # Each object the spec names (``render.child_refs``, the HPAs KEDA makes for the
    # ScaledObjects, and the width Job while there is no report): the live object,
    # whoever owns it, or None.
    live: Mapping[Ref, Mapping[str, Any] | None] = field(default_factory=dict)
    # Every object of ``render.WORKLOAD_KINDS`` this pool controls, wanted or not (for pruning).
    owned: Mapping[Ref, Mapping[str, Any]] = field(default_factory=dict)
    # When this operator last wrote the pool's status (its memory; None: not since start).
    status_written_at: datetime | None = None

    @cached_property
    def report_key(self) -> str:
        """What the width report and Job are named by (``render.widths.report_key``)."""
        return report_key(self.pool)

    @property
    def job_name(self) -> str:
        return width_job_name(self.pool, self.report_key)

    @property
    def job(self) -> Mapping[str, Any] | None:
        """The width Job of the current model, if it exists."""
        return next((j for j in self.width_jobs if j["metadata"]["name"] == self.job_name), None)

    def ours(self, obj: Mapping[str, Any] | None) -> bool:
        return obj is not None and controller_uid(obj) == self.pool.metadata.get("uid")

    def made_by_ours(self, obj: Mapping[str, Any] | None) -> bool:
        """Controlled by one of the pool's children (the HPA KEDA makes for a ScaledObject
        of the pool's): the pool's too, one step removed."""
        uid = controller_uid(obj) if obj is not None else None
        return bool(uid) and any(uid == c["metadata"].get("uid") for c in self.owned.values())

    def child(self, ref: Ref) -> Mapping[str, Any] | None:
        return self.live.get(ref)

    def deployment(self, component: str) -> Mapping[str, Any] | None:
        """This pool's Deployment of ``component`` (never a foreign one of the same name)."""
        dep = self.child(("apps/v1", "Deployment", name_of(self.pool, component)))
        return dep if self.ours(dep) else None

    def foreign(self) -> list[Ref]:
        """Objects with a child's name that neither this pool nor a child of it controls:
        never touched."""
        return sorted(
            ref
            for ref, obj in self.live.items()
            if obj is not None and not self.ours(obj) and not self.made_by_ours(obj)
        )


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
    return snap

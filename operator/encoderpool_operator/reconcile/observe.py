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
from typing import Any

from encoderpool_connector.contracts import configmap_name
from encoderpool_operator import render
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kube import Kube
from encoderpool_operator.reconcile.widths import job_state, parse_report

# (apiVersion, kind, name) of a child in the pool's namespace.
Ref = tuple[str, str, str]
# The label the Job controller puts on each of a Job's pods: the Job's uid, so the
# pods of a deleted and recreated Job of the same name are never mistaken for its own.
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"


def ref_of(obj: Mapping[str, Any]) -> Ref:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


@dataclass(frozen=True)
class Snapshot:
    """What one pass knows about one pool and its children, as read from the API server."""

    pool: EncoderPool
    fingerprint: str
    report_cm: Mapping[str, Any] | None = None
    # This pool's width Jobs, of any model (the current one among them, if it exists).
    width_jobs: tuple[Mapping[str, Any], ...] = ()
    # Pods of the current width Job: read only once it completed and no report is stored.
    job_pods: tuple[Mapping[str, Any], ...] = ()
    # Each child the spec can ask for (render.child_refs): the live object, or None.
    live: Mapping[Ref, Mapping[str, Any] | None] = field(default_factory=dict)

    @property
    def job_name(self) -> str:
        return render.width_job_name(self.pool, self.fingerprint)

    @property
    def job(self) -> Mapping[str, Any] | None:
        """The width Job of the current model, if it exists."""
        return next((j for j in self.width_jobs if j["metadata"]["name"] == self.job_name), None)

    def child(self, ref: Ref) -> Mapping[str, Any] | None:
        return self.live.get(ref)

    def deployment(self, component: str) -> Mapping[str, Any] | None:
        return self.child(("apps/v1", "Deployment", render.name_of(self.pool, component)))


def observe(kube: Kube, obj: Mapping[str, Any]) -> Snapshot:
    """Read one pool's world. Raises ValueError (naming the field) for an invalid spec."""
    pool = EncoderPool.from_object(obj)
    ns = pool.namespace
    fingerprint = pool.spec.model_identity(pool.spec.image).fingerprint()
    report_cm = kube.get("v1", "ConfigMap", ns, configmap_name(fingerprint))
    selector = f"{render.LABEL_POOL}={pool.name},{render.LABEL_COMPONENT}={render.WIDTH_JOB}"
    snap = Snapshot(
        pool=pool,
        fingerprint=fingerprint,
        report_cm=report_cm,
        width_jobs=tuple(kube.list("batch/v1", "Job", ns, selector)),
        live={ref: kube.get(ref[0], ref[1], ns, ref[2]) for ref in render.child_refs(pool)},
    )
    job = snap.job
    if (
        job is not None
        and job_state(job)[0] == "Complete"
        and parse_report(report_cm, fingerprint)[0] is None
    ):
        uid = job["metadata"]["uid"]
        pods = kube.list("v1", "Pod", ns, f"{JOB_UID_LABEL}={uid}")
        snap = replace(snap, job_pods=tuple(pods))
    return snap

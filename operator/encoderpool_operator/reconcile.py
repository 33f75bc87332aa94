"""One level-triggered reconcile of an EncoderPool: observe, render, apply what differs, report.

    spec -> validate -> width report (reuse, or run the Job and wait)
         -> render children (pure) -> apply only what differs (server-side apply)
         -> observe children -> status (written only when it changed)

It is idempotent: a pass over a pool whose children already match writes
nothing. A changed model changes the fingerprint, so its report is missing:
the Job measures the new model while the old pods keep serving, and only then
do both roles roll to the new config. No kopf here (``handlers`` adapts it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from encoderpool_connector.contracts import WidthReport, configmap_name
from encoderpool_operator import render
from encoderpool_operator.api import (
    API_VERSION,
    CONSUMERS_AVAILABLE,
    KIND,
    PRODUCERS_AVAILABLE,
    READY,
    ROUTER_AVAILABLE,
    WIDTHS_MEASURED,
    ConditionUpdate,
    EncoderPool,
    EncoderPoolStatus,
    ReplicaStatus,
    parse_quantity,
)
from encoderpool_operator.conditions import ready_condition, set_condition
from encoderpool_operator.kube import Kube

log = logging.getLogger(__name__)

ANNOTATION_FAILURES = "encoderpool.io/width-job-failures"
MEASURING_POLL_SECONDS = 15.0


@dataclass
class Outcome:
    """What one pass decided: the status written (or kept), when to look again, what changed."""

    status: EncoderPoolStatus
    requeue_after: float | None = None  # a Job to wait for or a back-off; None: events will do
    transitions: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, msg)
    applied: list[str] = field(default_factory=list)  # "Kind/name" of children written


# -------------------------------------------------------- comparing objects


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    if isinstance(want, (str, int)) and isinstance(have, (str, int)):
        try:  # "500m" == "0.5": the API server canonicalizes quantities
            return parse_quantity(want) == parse_quantity(have)
        except ValueError:
            return False
    return False


def is_subset(want: Any, have: Any) -> bool:
    """Does the live object already carry every field we would apply?

    Fields the server or other controllers add are ignored; lists must match
    element by element. This is what keeps a no-op reconcile free of writes,
    while a hand edit of a field we own is still put back.
    """
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            k in have and is_subset(v, have[k]) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(is_subset(w, h) for w, h in zip(want, have, strict=True))
        )
    return _same_scalar(want, have)


def apply_if_changed(kube: Kube, obj: dict[str, Any], outcome: Outcome) -> dict[str, Any]:
    meta = obj["metadata"]
    live = kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
    if live is not None and is_subset(obj, live):
        return live
    outcome.applied.append(f"{obj['kind']}/{meta['name']}")
    return kube.apply(obj)


# ------------------------------------------------------------ width report


def read_report(
    cm: Mapping[str, Any] | None, namespace: str, fingerprint: str
) -> WidthReport | None:
    """The report in the ConfigMap ``cm``, or None while it is missing or unusable."""
    if cm is None or not cm.get("data"):
        return None
    try:
        report = WidthReport.from_configmap_data(cm["data"])
    except (ValueError, ValidationError) as e:
        log.warning(
            "ConfigMap %s/%s holds no usable width report: %s",
            namespace,
            configmap_name(fingerprint),
            e,
        )
        return None
    if report.fingerprint != fingerprint:
        log.warning(
            "ConfigMap %s/%s reports fingerprint %s; ignoring it",
            namespace,
            configmap_name(fingerprint),
            report.fingerprint,
        )
        return None
    return report


def _adopt_report(
    kube: Kube,
    pool: EncoderPool,
    fingerprint: str,
    live: Mapping[str, Any] | None,
    outcome: Outcome,
) -> None:
    """Make this pool one of the report's owners (the last owner's deletion removes it)."""
    stub = render.width_report_stub(pool, fingerprint)
    uids = {ref.get("uid") for ref in (live or {}).get("metadata", {}).get("ownerReferences", [])}
    if live is not None and pool.metadata["uid"] in uids:
        return
    if live is None:
        kube.create(stub, exist_ok=True)
    else:
        owners = [
            *live["metadata"].get("ownerReferences", []),
            *stub["metadata"]["ownerReferences"],
        ]
        kube.request(
            "PATCH",
            f"/api/v1/namespaces/{pool.namespace}/configmaps/{stub['metadata']['name']}",
            body={
                "metadata": {
                    "ownerReferences": owners,
                    "resourceVersion": live["metadata"]["resourceVersion"],
                }
            },
            content_type="application/merge-patch+json",
            kind="ConfigMap",
        )
    outcome.applied.append(f"ConfigMap/{stub['metadata']['name']}")


def _job_state(job: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """("Running"|"Complete"|"Failed", reason, message) from a Job's conditions."""
    if job is None:
        return "Absent", "", ""
    for cond in job.get("status", {}).get("conditions", []):
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"], cond.get("reason", ""), cond.get("message", "")
    return "Running", "", ""


def backoff_seconds(failures: int, base: float = 30.0) -> float:
    """base, 2x base, 4x base, ... capped at 10 minutes between width Job attempts."""
    return float(min(600.0, base * 2 ** max(0, failures - 1)))


def _measure(
    kube: Kube,
    pool: EncoderPool,
    fingerprint: str,
    report_cm: Mapping[str, Any] | None,
    now: datetime,
    outcome: Outcome,
    retry_base: float,
) -> ConditionUpdate:
    """Run (or wait for, or retry) the width Job; the WidthsMeasured condition it implies."""
    gen = pool.generation
    identity = pool.spec.model_identity(pool.spec.image)
    _adopt_report(kube, pool, fingerprint, report_cm, outcome)
    objects = render.width_job_objects(pool, identity, fingerprint)
    job_obj = objects[-1]
    job_name = job_obj["metadata"]["name"]
    job = kube.get("batch/v1", "Job", pool.namespace, job_name)
    state, reason, message = _job_state(job)
    if state in ("Failed", "Complete"):
        # Complete without a usable report counts as a failure too.
        if state == "Complete":
            reason, message = "NoReport", "the Job succeeded but wrote no usable width report"
        annotations = (report_cm or {}).get("metadata", {}).get("annotations", {})
        failures = int(annotations.get(ANNOTATION_FAILURES, "0"))
        assert job is not None
        finished = _job_finished_at(job) or now
        wait = backoff_seconds(failures + 1, retry_base) - (now - finished).total_seconds()
        text = (
            f"width Job {job_name} failed ({reason or 'Failed'}): {message or 'see its pod'}; "
            f"attempt {failures + 1}"
        )
        if wait > 0:
            outcome.requeue_after = wait
            return ConditionUpdate(
                type=WIDTHS_MEASURED,
                status="False",
                reason="WidthJobFailed",
                message=f"{text}, retrying in {wait:.0f}s",
                observed_generation=gen,
            )
        # Backoff elapsed: count the failure where it survives the Job, then retry.
        kube.request(
            "PATCH",
            f"/api/v1/namespaces/{pool.namespace}/configmaps/{configmap_name(fingerprint)}",
            body={"metadata": {"annotations": {ANNOTATION_FAILURES: str(failures + 1)}}},
            content_type="application/merge-patch+json",
            kind="ConfigMap",
        )
        kube.delete("batch/v1", "Job", pool.namespace, job_name)
        outcome.applied.append(f"Job/{job_name} (deleted to retry)")
        outcome.requeue_after = 1.0
        return ConditionUpdate(
            type=WIDTHS_MEASURED,
            status="False",
            reason="WidthJobFailed",
            message=f"{text}, retrying now",
            observed_generation=gen,
        )
    for obj in objects:
        apply_if_changed(kube, obj, outcome)
    outcome.requeue_after = MEASURING_POLL_SECONDS
    return ConditionUpdate(
        type=WIDTHS_MEASURED,
        status="False",
        reason="Measuring",
        message=f"width Job {job_name} is measuring {pool.spec.model.name}",
        observed_generation=gen,
    )


def _job_finished_at(job: Mapping[str, Any]) -> datetime | None:
    for cond in job.get("status", {}).get("conditions", []):
        if cond.get("type") in ("Complete", "Failed") and cond.get("lastTransitionTime"):
            return datetime.fromisoformat(cond["lastTransitionTime"].replace("Z", "+00:00"))
    return None


def _delete_stale_width_objects(kube: Kube, pool: EncoderPool, fingerprint: str) -> None:
    """Width Jobs (and their RBAC) of earlier models: their reports are not ours any more."""
    selector = f"{render.LABEL_POOL}={pool.name},{render.LABEL_COMPONENT}={render.WIDTH_JOB}"
    for api_version, kind in (
        ("batch/v1", "Job"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        ("rbac.authorization.k8s.io/v1", "Role"),
        ("v1", "ServiceAccount"),
    ):
        for obj in kube.list(api_version, kind, pool.namespace, selector):
            if obj["metadata"]["name"] != render.width_job_name(pool, fingerprint):
                kube.delete(api_version, kind, pool.namespace, obj["metadata"]["name"])


# --------------------------------------------------------------- observing


def replica_status(deployment: Mapping[str, Any] | None, desired: int) -> ReplicaStatus:
    st = (deployment or {}).get("status", {})
    return ReplicaStatus(
        desired=desired, ready=st.get("readyReplicas", 0), available=st.get("availableReplicas", 0)
    )


def availability(
    type_: str, what: str, deployment: Mapping[str, Any] | None, desired: int, gen: int | None
) -> ConditionUpdate:
    """Available when every desired pod is updated and available (a finished rollout)."""
    if deployment is None:
        return ConditionUpdate(
            type=type_,
            status="False",
            reason="NotCreated",
            message=f"{what} Deployment not created yet",
            observed_generation=gen,
        )
    st = deployment.get("status", {})
    if st.get("observedGeneration", 0) < deployment["metadata"].get("generation", 0):
        reason, text, ok = "RollingOut", "rollout not observed yet", False
    elif st.get("updatedReplicas", 0) < desired:
        reason, ok = "RollingOut", False
        text = f"{st.get('updatedReplicas', 0)}/{desired} pods updated"
    elif st.get("availableReplicas", 0) < desired:
        reason, ok = "PodsNotReady", False
        text = f"{st.get('availableReplicas', 0)}/{desired} pods available"
    else:
        reason, text, ok = "Available", f"{desired}/{desired} pods available", True
    return ConditionUpdate(
        type=type_,
        status="True" if ok else "False",
        reason=reason,
        message=f"{what}: {text}",
        observed_generation=gen,
    )


# ------------------------------------------------------------------ the pass


def invalid_status(obj: Mapping[str, Any], message: str, now: datetime) -> EncoderPoolStatus:
    """Status for a pool the operator cannot parse: Ready=False naming the field."""
    current = _current_status(obj)
    gen = obj.get("metadata", {}).get("generation")
    update = ConditionUpdate(
        type=READY,
        status="False",
        reason="InvalidSpec",
        message=message[:32000],
        observed_generation=gen,
    )
    return current.model_copy(
        update={
            "conditions": set_condition(current.conditions, update, now),
            "observed_generation": gen,
        }
    )


def _current_status(obj: Mapping[str, Any]) -> EncoderPoolStatus:
    try:
        return EncoderPoolStatus.model_validate(dict(obj.get("status") or {}))
    except ValidationError:
        return EncoderPoolStatus()  # foreign or stale fields: start afresh


def reconcile(
    kube: Kube, obj: Mapping[str, Any], defaults: render.Defaults, now: datetime
) -> Outcome:
    """One pass for one pool. Raises ValueError (naming the field) for an invalid spec."""
    pool = EncoderPool.from_object(obj)
    gen = pool.generation
    ns = pool.namespace
    identity = pool.spec.model_identity(pool.spec.image)
    fingerprint = identity.fingerprint()
    outcome = Outcome(status=pool.status)

    report_cm = kube.get("v1", "ConfigMap", ns, configmap_name(fingerprint))
    report = read_report(report_cm, ns, fingerprint)
    updates: list[ConditionUpdate] = []
    status_fields: dict[str, Any] = {
        "observed_generation": gen,
        "model_fingerprint": fingerprint,
        "width_report_name": configmap_name(fingerprint),
        "router_endpoint": render.router_endpoint(pool),
    }
    if report is None:
        updates.append(
            _measure(kube, pool, fingerprint, report_cm, now, outcome, defaults.width_retry_seconds)
        )
    else:
        _adopt_report(kube, pool, fingerprint, report_cm, outcome)
        updates.append(
            ConditionUpdate(
                type=WIDTHS_MEASURED,
                status="True",
                reason="Measured",
                message=", ".join(
                    f"{m}: {w}" for m, w in sorted(report.encoder_output_widths.items())
                ),
                observed_generation=gen,
            )
        )
        for child in render.workload_objects(pool, report, defaults):
            apply_if_changed(kube, child, outcome)
        _delete_stale_width_objects(kube, pool, fingerprint)
        status_fields.update(
            transport=pool.spec.connector.transport,
            encoder_output_widths=dict(report.encoder_output_widths),
            bytes_per_token=dict(report.bytes_per_token),
            hidden_size=report.hidden_size,
        )

    roles: Sequence[tuple[str, str, str, int]] = [
        (PRODUCERS_AVAILABLE, "producers", render.PRODUCER, pool.spec.producer.replicas),
        (CONSUMERS_AVAILABLE, "consumers", render.CONSUMER, pool.spec.consumer.replicas),
    ]
    if pool.spec.router.enabled:
        roles = [*roles, (ROUTER_AVAILABLE, "router", render.ROUTER, pool.spec.router.replicas)]
    for type_, what, component, desired in roles:
        dep = kube.get("apps/v1", "Deployment", ns, render.name_of(pool, component))
        status_fields[what] = replica_status(dep, desired)
        cond = availability(type_, what, dep, desired, gen)
        if report is None and dep is not None:
            cond = cond.model_copy(
                update={
                    "status": "False",
                    "reason": "WaitingForWidths",
                    "message": f"{what}: waiting for the new model's widths",
                }
            )
        # No requeue for a rollout: each Deployment status change is an event that
        # runs the next pass (and the resync timer catches anything missed).
        updates.append(cond)
    if not pool.spec.router.enabled:
        status_fields["router"] = None

    conditions = pool.status.conditions
    for update in updates:
        conditions = set_condition(conditions, update, now)
    conditions = tuple(
        c for c in conditions if c.type != ROUTER_AVAILABLE or pool.spec.router.enabled
    )
    ready = ready_condition(
        conditions, router_enabled=pool.spec.router.enabled, observed_generation=gen
    )
    conditions = set_condition(conditions, ready, now)
    new_status = pool.status.model_copy(update={**status_fields, "conditions": conditions})
    new_status = EncoderPoolStatus.model_validate(new_status.model_dump(by_alias=True))

    old = {c.type: (c.status, c.reason) for c in pool.status.conditions}
    for c in new_status.conditions:
        if old.get(c.type) != (c.status, c.reason):
            outcome.transitions.append((c.type, c.reason, c.message))
    outcome.status = new_status
    write_status(kube, ns, pool.name, pool.status, new_status)
    return outcome


def status_body(status: EncoderPoolStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def write_status(
    kube: Kube,
    namespace: str,
    name: str,
    current: EncoderPoolStatus | Mapping[str, Any],
    status: EncoderPoolStatus,
) -> bool:
    """Patch status only if it differs from what the object carries; True if written."""
    old = status_body(current) if isinstance(current, EncoderPoolStatus) else dict(current)
    body = status_body(status)
    if body == old:
        return False
    # A merge patch cannot remove keys by omission: null out what we no longer report.
    for key in old:
        body.setdefault(key, None)
    kube.patch_status(API_VERSION, KIND, namespace, name, body)
    return True

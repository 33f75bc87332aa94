"""The width report, decided purely: reuse the stored report, take it from the Job, or measure.

    report ConfigMap not the operator's     -> WidthsMeasured=False naming it; never touched
    report ConfigMap holds a usable report  -> use it (and own it with the other pools)
    width Job Complete                      -> its pod's termination message is the report:
                                               validate it, store it in the ConfigMap
    width Job Failed, or its message bad    -> WidthsMeasured=False, back off, then rerun
    otherwise                               -> (re)apply the Job and wait for it

The Job writes nothing to the API server (it has no token): ``measure`` leaves
the report as its container's termination message, and the operator, which
reads the Job's pod, stores it. No I/O here: ``observe`` has read the
ConfigMap, the Jobs and (only when needed) the Job's pods.

The report ConfigMap is shared by name inside the namespace, so anyone who may
write ConfigMaps there can make one first or edit it. The operator cannot stop
that (the namespace is the trust boundary), so it reads such a ConfigMap as
input: one it did not write (``foreign_reason``) is never used, patched or
adopted; every number in a report is bounded (``WidthReport``), and the failure
count is parsed with bounds (``parse_failures``). Each of these is a condition
naming the ConfigMap, never an exception or a wedged pass.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from encoderpool_contracts import TERMINATION_LOG, ModelIdentity, WidthReport
from encoderpool_operator.api import WIDTHS_MEASURED, ConditionUpdate, format_errors
from encoderpool_operator.naming import (
    ANNOTATION_REPORT_DIGEST,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_REPORT_KEY,
    MANAGED_BY,
    REPORT_COMPONENT,
    report_owner_reference,
)
from encoderpool_operator.reconcile.actions import Action, Apply, Create, Delete, MergePatch
from encoderpool_operator.reconcile.compare import is_subset
from encoderpool_operator.reconcile.snapshot import Snapshot
from encoderpool_operator.render.widths import (
    MEASURE_CONTAINER,
    report_digest,
    width_job,
    width_report_configmap,
)

# Failed attempts of the current model's Job, kept on the report ConfigMap so the
# count survives the Job, which is deleted to retry.
ANNOTATION_FAILURES = "encoderpool.io/width-job-failures"
MEASURING_POLL_SECONDS = 15.0
# How often a pool blocked by a foreign report looks again (it may have been deleted).
FOREIGN_POLL_SECONDS = 60.0
# The most failures counted: 30 s x 2**15 is far past the back-off's 10-minute cap.
MAX_FAILURES = 16
_FAILURE_COUNT = re.compile(r"[0-9]{1,3}")
BACKOFF_CAP_SECONDS = 600.0


@dataclass(frozen=True)
class WidthsPlan:
    """What the widths step decided: the report to render with (None: not yet), and how."""

    report: WidthReport | None
    condition: ConditionUpdate
    actions: tuple[Action, ...] = ()
    requeue_after: float | None = None
    warnings: tuple[str, ...] = ()


def _where(cm: Mapping[str, Any]) -> str:
    meta = cm.get("metadata") or {}
    return f"ConfigMap {meta.get('namespace', '')}/{meta.get('name', '')}"


def foreign_reason(cm: Mapping[str, Any], key: str) -> str | None:
    """Why ``cm`` is not a report ConfigMap this operator wrote; None when it is.

    Ours carries the managed-by, component and report-key labels the operator
    renders and, once it holds data, the digest the operator stored with that data
    (``render.widths.report_digest``). Neither is a secret: a same-namespace user who
    forges both gets a report the operator reads, bounded like any other. What
    they catch is a ConfigMap made or edited by hand (or another tool's object of
    that name), which the operator must never overwrite or own (its owners would
    make the garbage collector delete it with the pools).
    """
    meta = cm.get("metadata") or {}
    labels = meta.get("labels") or {}
    want = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_COMPONENT: REPORT_COMPONENT,
        LABEL_REPORT_KEY: key,
    }
    missing = [f"{k}={v}" for k, v in want.items() if labels.get(k) != v]
    if missing:
        return "it lacks the operator's labels " + ", ".join(missing)
    data = cm.get("data")
    if data:
        digest = (meta.get("annotations") or {}).get(ANNOTATION_REPORT_DIGEST)
        if digest != report_digest(key, data):
            return (
                f"its data does not match the {ANNOTATION_REPORT_DIGEST} annotation the "
                "operator stores with a report (made or edited by hand?)"
            )
    return None


def parse_report(
    cm: Mapping[str, Any] | None, key: str, fingerprint: str
) -> tuple[WidthReport | None, str | None]:
    """The report stored in ``cm``; else None and why (no why while there is simply none).

    A ConfigMap the operator did not write holds no report for it (``foreign_reason``).
    """
    if cm is None:
        return None, None
    where = _where(cm)
    if why := foreign_reason(cm, key):
        return None, f"{where} was not written by the operator: {why}"
    if not cm.get("data"):
        return None, None
    try:
        report = WidthReport.from_configmap_data(cm["data"])
    except ValidationError as e:
        return None, f"{where} holds no usable width report: {format_errors(e)}"
    except ValueError as e:
        return None, f"{where} holds no usable width report: {e}"
    if report.fingerprint != fingerprint or report.identity.fingerprint() != fingerprint:
        return None, (
            f"{where} reports fingerprint {report.fingerprint} (identity "
            f"{report.identity.fingerprint()}), not the pool's {fingerprint}; ignoring it"
        )
    return report, None


def parse_failures(annotations: Mapping[str, Any]) -> tuple[int, str | None]:
    """The failure count kept in ``ANNOTATION_FAILURES``, and what was wrong with it.

    Only a short digit string is read (never ``int`` on any length), and the count
    is clamped to ``MAX_FAILURES``. Anything else (a sign, spaces, a long number
    such as "10000000000") reads as ``MAX_FAILURES``: a count the operator cannot
    trust must never make a Job rerun sooner than the back-off's cap.
    """
    text = annotations.get(ANNOTATION_FAILURES)
    if text is None:
        return 0, None
    if isinstance(text, str) and _FAILURE_COUNT.fullmatch(text):
        return min(int(text), MAX_FAILURES), None
    shown = repr(text)[:34]
    return MAX_FAILURES, (
        f"annotation {ANNOTATION_FAILURES}={shown} is not a count of 0 to {MAX_FAILURES}: "
        f"read as {MAX_FAILURES}"
    )


def job_state(job: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """("Absent"|"Running"|"Complete"|"Failed", reason, message) from a Job's conditions."""
    if job is None:
        return "Absent", "", ""
    for cond in job.get("status", {}).get("conditions", []):
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"], cond.get("reason", ""), cond.get("message", "")
    return "Running", "", ""


def job_finished_at(job: Mapping[str, Any]) -> datetime | None:
    for cond in job.get("status", {}).get("conditions", []):
        if cond.get("type") in ("Complete", "Failed") and cond.get("lastTransitionTime"):
            return datetime.fromisoformat(cond["lastTransitionTime"].replace("Z", "+00:00"))
    return None


def backoff_seconds(failures: int, base: float = 30.0) -> float:
    """base, 2x base, 4x base, ... capped at 10 minutes between width Job attempts.

    The exponent is clamped first, so any count costs the same (a float power of at
    most ``MAX_FAILURES``), never a huge integer power.
    """
    exponent = min(max(0, failures - 1), MAX_FAILURES)
    return float(min(BACKOFF_CAP_SECONDS, base * 2.0**exponent))


def report_from_pods(
    job_name: str, pods: tuple[Mapping[str, Any], ...], identity: ModelIdentity
) -> tuple[WidthReport | None, str]:
    """The report a succeeded pod of the Job left as its termination message, or what is wrong.

    The message must parse as a ``WidthReport`` of exactly the identity the pool
    asked for: a report of another model must never key this model's config.
    """
    succeeded = [p for p in pods if p.get("status", {}).get("phase") == "Succeeded"]
    if not succeeded:
        return None, f"no succeeded pod of Job {job_name} is left to read the report from"
    pod = succeeded[0]
    name = pod["metadata"]["name"]
    statuses = {c.get("name"): c for c in pod["status"].get("containerStatuses", [])}
    terminated = statuses.get(MEASURE_CONTAINER, {}).get("state", {}).get("terminated")
    message = (terminated or {}).get("message", "")
    if not message.strip():
        return None, (
            f"pod {name} left no termination message (container {MEASURE_CONTAINER} "
            f"writes its report to {TERMINATION_LOG})"
        )
    try:
        report = WidthReport.from_termination_message(message)
    except ValidationError as e:
        return None, f"the termination message of pod {name} is not a width report: " + (
            format_errors(e)
        )
    want = identity.fingerprint()
    if report.fingerprint != want or report.identity != identity:
        return None, (
            f"pod {name} reported {report.identity.model} with fingerprint {report.fingerprint}, "
            f"not the pool's model with fingerprint {want}"
        )
    return report, ""


def _owner_uids(cm: Mapping[str, Any]) -> set[str]:
    return {ref.get("uid", "") for ref in cm["metadata"].get("ownerReferences", [])}


def store_report(
    snap: Snapshot, data: dict[str, str] | None = None, failures: int | None = None
) -> Action | None:
    """The write that puts this pool among the report ConfigMap's owners, with ``data``
    and/or a failure count; None when the live ConfigMap already has all of it.

    A missing ConfigMap is created (labels, this pool as a non-controller owner); an
    existing one gets a strategic merge patch, which merges ownerReferences by uid on
    the server: many pools of one model add themselves at once without a conflict or
    a resourceVersion guard, and none drops another's owner.
    """
    pool, cm = snap.pool, snap.report_cm
    key = snap.report_key
    if cm is None:
        obj = width_report_configmap(pool, key, snap.fingerprint, data=data)
        if failures is not None:
            obj["metadata"].setdefault("annotations", {})[ANNOTATION_FAILURES] = str(failures)
        return Create(obj)
    assert foreign_reason(cm, key) is None, "a foreign report is never written"
    meta: dict[str, Any] = {}
    body: dict[str, Any] = {}
    annotations: dict[str, str] = {}
    if pool.metadata["uid"] not in _owner_uids(cm):
        meta["ownerReferences"] = [report_owner_reference(pool)]
    if data is not None:
        body["data"] = data
        annotations[ANNOTATION_REPORT_DIGEST] = report_digest(key, data)
    if failures is not None:
        annotations[ANNOTATION_FAILURES] = str(failures)
    if annotations:
        meta["annotations"] = annotations
    if not meta and data is None:
        return None
    if meta:
        body["metadata"] = meta
    why = (
        "report stored"
        if data is not None
        else f"failure {failures} counted"
        if failures is not None
        else "owner added"
    )
    return MergePatch("v1", "ConfigMap", cm["metadata"]["name"], why, body, strategic=True)


def _condition(reason: str, message: str, gen: int | None, ok: bool = False) -> ConditionUpdate:
    return ConditionUpdate(
        type=WIDTHS_MEASURED,
        status="True" if ok else "False",
        reason=reason,
        message=message,
        observed_generation=gen,
    )


def _measured(report: WidthReport, gen: int | None) -> ConditionUpdate:
    widths = ", ".join(f"{m}: {w}" for m, w in sorted(report.encoder_output_widths.items()))
    return _condition("Measured", widths, gen, ok=True)


def plan_widths(snap: Snapshot, retry_base: float, now: datetime) -> WidthsPlan:
    """Decide the width report's step for one pass (see the module docstring)."""
    pool = snap.pool
    gen = pool.generation
    cm = snap.report_cm
    if cm is not None and (why := foreign_reason(cm, snap.report_key)):
        ns, name = pool.namespace, cm["metadata"]["name"]
        text = (
            f"{_where(cm)} holds this pool's width report name but was not written by the "
            f"operator ({why}); it is never used, patched or adopted. Delete it "
            f"(kubectl delete configmap -n {ns} {name}) and the operator measures the model "
            "and stores its report there"
        )
        return WidthsPlan(
            None, _condition("WidthReportForeign", text, gen), (), FOREIGN_POLL_SECONDS
        )
    report, problem = parse_report(cm, snap.report_key, snap.fingerprint)
    warnings = (problem,) if problem else ()
    if report is not None:
        adopt = store_report(snap)
        return WidthsPlan(report, _measured(report, gen), (adopt,) if adopt else (), None, warnings)

    identity = pool.spec.model_identity(pool.spec.image)
    job, name = snap.job, snap.job_name
    state, reason, message = job_state(job)
    if state == "Complete":
        report, why = report_from_pods(name, snap.job_pods, identity)
        if report is not None:
            store = store_report(snap, data=report.to_configmap_data())
            stored = (store,) if store else ()
            return WidthsPlan(report, _measured(report, gen), stored, None, warnings)
        text = f"width Job {name} succeeded, but {why}"
        return _retry(snap, "WidthReportInvalid", text, now, retry_base, warnings)
    if state == "Failed":
        text = f"width Job {name} failed ({reason or 'Failed'}): {message or 'see its pod'}"
        return _retry(snap, "WidthJobFailed", text, now, retry_base, warnings)

    actions: list[Action] = []
    if snap.report_cm is not None and (adopt := store_report(snap)):
        actions.append(adopt)  # a failure count kept there, or another pool's stored report
    want = width_job(pool, identity, snap.report_key)
    if job is None or not is_subset(want, job):
        actions.append(Apply(want))
    measuring = f"width Job {name} is measuring {pool.spec.model.name}"
    if problem:  # a stored report of ours that is out of bounds: the Job's replaces it
        condition = _condition("WidthReportInvalid", f"{problem}; {measuring} again", gen)
    else:
        condition = _condition("Measuring", measuring, gen)
    return WidthsPlan(
        None,
        condition,
        tuple(actions),
        MEASURING_POLL_SECONDS,
        warnings,
    )


def _retry(
    snap: Snapshot,
    reason: str,
    text: str,
    now: datetime,
    retry_base: float,
    warnings: tuple[str, ...],
) -> WidthsPlan:
    """A failed attempt: wait out the back-off, then count it and delete the Job to rerun it."""
    gen = snap.pool.generation
    annotations = (snap.report_cm or {}).get("metadata", {}).get("annotations") or {}
    failures, unreadable = parse_failures(annotations)
    assert snap.job is not None, "only a finished Job fails"
    finished = job_finished_at(snap.job) or now
    wait = backoff_seconds(failures + 1, retry_base) - (now - finished).total_seconds()
    text = f"{text}; attempt {failures + 1}"
    if unreadable and snap.report_cm is not None:
        text = f"{text} ({_where(snap.report_cm)}: {unreadable})"
    if wait > 0:
        return WidthsPlan(
            None, _condition(reason, f"{text}, retrying in {wait:.0f}s", gen), (), wait, warnings
        )
    count = store_report(snap, failures=min(failures + 1, MAX_FAILURES))
    assert count is not None, "a new failure count is always a write"
    retry = Delete("batch/v1", "Job", snap.job_name, "to retry")
    return WidthsPlan(
        None, _condition(reason, f"{text}, retrying now", gen), (count, retry), 1.0, warnings
    )

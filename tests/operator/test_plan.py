"""The reconcile's plan, pure: a Snapshot (what observe read) in, actions and status out.

Many cases, no cluster; tests/operator/test_operator.py runs the same passes on
the real control plane.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from encoderpool_contracts import WidthReport
from encoderpool_operator import render
from encoderpool_operator.api import MAX_NAME_LENGTH, EncoderPool
from encoderpool_operator.naming import ANNOTATION_DIGEST, ref_of, width_job_name
from encoderpool_operator.reconcile.actions import (
    Apply,
    Create,
    CreateSecret,
    Delete,
    MergePatch,
    PatchStatus,
)
from encoderpool_operator.reconcile.plan import PROGRESS_SECONDS, Plan, plan
from encoderpool_operator.reconcile.snapshot import Snapshot
from encoderpool_operator.reconcile.widths import ANNOTATION_FAILURES, MEASURING_POLL_SECONDS
from encoderpool_operator.render.widths import (
    report_digest,
    report_key,
    width_job,
)
from tests.operator.fixtures import (
    DEFAULTS,
    NOW,
    UID,
    job,
    live_children,
    plan_condition,
    pool_object,
    report_cm,
    report_of,
    settled,
    settled_snapshot,
    snapshot,
    writes,
)


def pod(message: str | None, phase: str = "Succeeded") -> dict[str, Any]:
    terminated: dict[str, Any] = {"exitCode": 0, "reason": "Completed"}
    if message is not None:
        terminated["message"] = message
    return {
        "metadata": {"name": "tiny-width-abc-x1"},
        "status": {
            "phase": phase,
            "containerStatuses": [{"name": "measure", "state": {"terminated": terminated}}],
        },
    }


def kinds(p: Plan) -> list[str]:
    return [f"{type(a).__name__} {a.describe()}" for a in p.actions]


def test_a_new_model_runs_the_job_and_creates_no_configmap() -> None:
    obj = pool_object()
    p = plan(snapshot(obj), DEFAULTS, NOW)
    (apply_job,) = writes(p)
    assert isinstance(apply_job, Apply)
    assert apply_job.obj["kind"] == "Job"
    assert plan_condition(p, "WidthsMeasured")[:2] == ("False", "Measuring")
    assert plan_condition(p, "Ready")[0] == "False"
    assert p.requeue_after == MEASURING_POLL_SECONDS
    assert isinstance(p.actions[-1], PatchStatus)


def test_a_running_job_that_matches_is_left_alone() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    p = plan(snapshot(obj, width_jobs=(job(pool, None),)), DEFAULTS, NOW)
    assert writes(p) == []
    assert plan_condition(p, "WidthsMeasured")[1] == "Measuring"


def test_a_settled_pool_plans_nothing() -> None:
    obj = settled(pool_object())
    report = report_of(obj)
    pool = EncoderPool.from_object(obj)
    snap = snapshot(
        obj,
        report_cm=report_cm(report),
        width_jobs=(job(pool, "Complete"),),
        live=live_children(pool, report),
    )
    p = plan(snap, DEFAULTS, NOW + timedelta(minutes=5))
    assert p.actions == ()
    assert plan_condition(p, "Ready")[:2] == ("True", "AllAvailable")
    assert p.requeue_after is None


def test_a_hand_edited_child_is_applied_again_and_only_it() -> None:
    obj = settled(pool_object())
    report = report_of(obj)
    pool = EncoderPool.from_object(obj)
    live = live_children(pool, report)
    consumer = live[("apps/v1", "Deployment", "tiny-consumer")]
    consumer["spec"]["template"]["spec"]["containers"][0]["args"][1] = "/models/edited"
    p = plan(snapshot(obj, report_cm=report_cm(report), live=live), DEFAULTS, NOW)
    # A pass that writes a Deployment also (re)creates the internal Secret it refers to.
    assert kinds(p) == [
        "CreateSecret Secret/tiny-internal (created unless it exists)",
        "Apply Deployment/tiny-consumer",
    ]


def test_the_first_measured_pass_creates_the_internal_secret_before_any_deployment() -> None:
    obj = pool_object()
    report = report_of(obj)
    p = plan(snapshot(obj, report_cm=report_cm(report)), DEFAULTS, NOW)
    secrets = [a for a in p.actions if isinstance(a, CreateSecret)]
    assert len(secrets) == 1
    (secret,) = secrets
    first_deployment = next(
        i for i, a in enumerate(p.actions) if isinstance(a, Apply) and a.obj["kind"] == "Deployment"
    )
    assert p.actions.index(secret) == first_deployment - 1
    assert secret.random_keys == ("vllm-api-key", "channel-key")
    obj_ = secret.obj
    assert (obj_["kind"], obj_["type"], obj_["metadata"]["name"]) == (
        "Secret",
        "Opaque",
        "tiny-internal",
    )
    (owner,) = obj_["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == (UID, True)  # garbage-collected with the pool
    # The plan never holds a value: act makes them when it writes.
    assert not {"data", "stringData"} & set(obj_)


def test_passes_that_write_no_deployment_send_no_secret() -> None:
    obj = pool_object()
    assert not any(isinstance(a, CreateSecret) for a in plan(snapshot(obj), DEFAULTS, NOW).actions)
    settled_obj = settled(obj)
    report = report_of(settled_obj)
    pool = EncoderPool.from_object(settled_obj)
    live = live_children(pool, report)
    policy = live[("networking.k8s.io/v1", "NetworkPolicy", "tiny-router")]
    policy["spec"]["policyTypes"] = ["Ingress", "Egress"]  # a hand edit of a non-Deployment
    p = plan(snapshot(settled_obj, report_cm=report_cm(report), live=live), DEFAULTS, NOW)
    assert kinds(p) == ["Apply NetworkPolicy/tiny-router"]


def test_a_report_of_another_pool_is_adopted_by_a_strategic_merge_of_owners() -> None:
    obj = pool_object()
    report = report_of(obj)
    cm = report_cm(report, owners=("other-pool",))
    p = plan(snapshot(obj, report_cm=cm), DEFAULTS, NOW)
    adopt = p.actions[0]
    assert isinstance(adopt, MergePatch)
    assert adopt.kind == "ConfigMap"
    meta = adopt.body["metadata"]
    # Merged by uid on the server: only this pool's reference is sent, no version guard,
    # so many pools of one model adopt it at once without conflicts.
    assert adopt.strategic
    assert [r["uid"] for r in meta["ownerReferences"]] == [UID]
    assert meta["ownerReferences"][0]["controller"] is False  # shared, not controlled
    assert "resourceVersion" not in meta
    # Measured: every child is applied (none exists yet).
    children = render.child_refs(EncoderPool.from_object(obj))
    assert sum(isinstance(a, Apply) for a in p.actions) == len(children)


def test_a_completed_job_s_termination_message_becomes_the_report_configmap() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    report = report_of(obj)
    snap = snapshot(
        obj,
        width_jobs=(job(pool, "Complete"),),
        job_pods=(pod(None, phase="Failed"), pod(report.to_termination_message())),
    )
    p = plan(snap, DEFAULTS, NOW)
    create = p.actions[0]
    assert isinstance(create, Create)
    cm = create.obj
    key = report_key(pool)
    assert cm["metadata"]["name"] == f"encoderpool-widths-{key}"
    assert WidthReport.from_configmap_data(cm["data"]) == report
    assert cm["metadata"]["labels"]["encoderpool.io/model-fingerprint"] == report.fingerprint
    assert cm["metadata"]["labels"]["encoderpool.io/width-report-key"] == key
    assert cm["metadata"]["annotations"] == {
        "encoderpool.io/width-report-digest": report_digest(key, cm["data"])
    }
    (owner,) = cm["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == (UID, False)
    # The same pass renders the workload with what was measured.
    assert plan_condition(p, "WidthsMeasured")[:2] == ("True", "Measured")
    applied = {a.describe() for a in p.actions if isinstance(a, Apply)}
    assert "Deployment/tiny-producer" in applied
    assert p.requeue_after is None


def test_a_report_for_a_configmap_holding_a_failure_count_is_patched_in() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    report = report_of(obj)
    cm = report_cm(report, annotations={ANNOTATION_FAILURES: "1"})
    del cm["data"]
    snap = snapshot(
        obj,
        report_cm=cm,
        width_jobs=(job(pool, "Complete"),),
        job_pods=(pod(report.to_termination_message()),),
    )
    store = plan(snap, DEFAULTS, NOW).actions[0]
    assert isinstance(store, MergePatch)
    assert store.body["data"] == report.to_configmap_data()
    # Already an owner: only the digest that marks the data as the operator's.
    key = report_key(pool)
    assert store.body["metadata"] == {
        "annotations": {
            "encoderpool.io/width-report-digest": report_digest(key, store.body["data"])
        }
    }


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (None, "left no termination message"),
        ("", "left no termination message"),
        ("Traceback (most recent call last): ...", "is not a width report: <object>: Invalid JSON"),
        ('{"version": 1}', "is not a width report: fingerprint: Field required"),
        ("other-model", "not the pool's model with fingerprint"),
    ],
)
def test_a_bad_termination_message_is_a_condition_and_backs_off(
    message: str | None, expected: str
) -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    if message == "other-model":
        other = pool_object(model={**obj["spec"]["model"], "name": "other"})
        message = report_of(other).to_termination_message()
    snap = snapshot(obj, width_jobs=(job(pool, "Complete"),), job_pods=(pod(message),))
    p = plan(snap, DEFAULTS, NOW + timedelta(seconds=10))
    status, reason, text = plan_condition(p, "WidthsMeasured")
    assert (status, reason) == ("False", "WidthReportInvalid")
    assert expected in text
    assert snap.job_name in text
    assert "tiny-width-abc-x1" in text  # the pod
    assert "retrying in 20s" in text
    assert writes(p) == []
    assert p.requeue_after == pytest.approx(20)


def test_a_completed_job_without_pods_is_a_condition_too() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    p = plan(snapshot(obj, width_jobs=(job(pool, "Complete"),)), DEFAULTS, NOW)
    assert plan_condition(p, "WidthsMeasured")[1] == "WidthReportInvalid"
    assert "no succeeded pod" in plan_condition(p, "WidthsMeasured")[2]


def test_a_failed_job_waits_out_its_back_off() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    p = plan(snapshot(obj, width_jobs=(job(pool, "Failed"),)), DEFAULTS, NOW)
    status, reason, text = plan_condition(p, "WidthsMeasured")
    assert (status, reason) == ("False", "WidthJobFailed")
    assert "BackoffLimitExceeded" in text
    assert "attempt 1" in text
    assert writes(p) == []
    assert p.requeue_after == 30


def test_after_the_back_off_the_failure_is_counted_and_the_job_deleted() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    later = NOW + timedelta(seconds=31)
    p = plan(snapshot(obj, width_jobs=(job(pool, "Failed", finished=NOW),)), DEFAULTS, later)
    count, delete = writes(p)
    # No ConfigMap yet: the count creates it (owned, no data: not a report).
    assert isinstance(count, Create)
    assert count.obj["metadata"]["annotations"] == {ANNOTATION_FAILURES: "1"}
    assert "data" not in count.obj
    assert delete == Delete("batch/v1", "Job", pool.name + "-width-" + job_suffix(pool), "to retry")
    assert p.requeue_after == 1.0


def test_a_second_failure_doubles_the_back_off_and_patches_the_count() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    cm = report_cm(report_of(obj), annotations={ANNOTATION_FAILURES: "1"})
    del cm["data"]
    snap = snapshot(obj, report_cm=cm, width_jobs=(job(pool, "Failed"),))
    assert plan(snap, DEFAULTS, NOW + timedelta(seconds=31)).requeue_after == pytest.approx(29)
    p = plan(snap, DEFAULTS, NOW + timedelta(seconds=61))
    count = writes(p)[0]
    assert isinstance(count, MergePatch)
    assert count.body["metadata"]["annotations"] == {ANNOTATION_FAILURES: "2"}
    assert "attempt 2" in plan_condition(p, "WidthsMeasured")[2]


def job_suffix(pool: EncoderPool) -> str:
    return report_key(pool)[:10]


def test_width_jobs_of_earlier_models_are_deleted_once_measured() -> None:
    obj = settled(pool_object())
    report = report_of(obj)
    pool = EncoderPool.from_object(obj)
    old = job(pool, "Complete")
    old["metadata"]["name"] = "tiny-width-0123456789"
    snap = snapshot(
        obj,
        report_cm=report_cm(report),
        width_jobs=(old, job(pool, "Complete")),
        live=live_children(pool, report),
    )
    assert kinds(plan(snap, DEFAULTS, NOW)) == [
        "Delete Job/tiny-width-0123456789 (deleted: stale model)"
    ]


def test_a_changed_model_measures_before_anything_rolls() -> None:
    obj = settled(pool_object())
    report = report_of(obj)
    pool = EncoderPool.from_object(obj)
    live = live_children(pool, report)
    changed = {**obj, "spec": {**obj["spec"], "model": {**obj["spec"]["model"], "name": "x"}}}
    p = plan(snapshot(changed, report_cm=None, live=live), DEFAULTS, NOW)
    assert [a.obj["kind"] for a in writes(p) if isinstance(a, Apply)] == ["Job"]
    assert plan_condition(p, "ProducersAvailable")[1] == "WaitingForWidths"
    assert plan_condition(p, "Ready")[0] == "False"


def test_without_a_router_nothing_of_it_is_planned() -> None:
    obj = pool_object(router={"enabled": False})
    report = report_of(obj)
    p = plan(snapshot(obj, report_cm=report_cm(report)), DEFAULTS, NOW)
    applied = {a.describe() for a in p.actions if isinstance(a, Apply)}
    assert not any("router" in a for a in applied)
    assert p.status.router is None
    assert p.status.router_endpoint is None
    assert all(c.type != "RouterAvailable" for c in p.status.conditions)


# ------------------------------------------------ level-true: removals, pruning, ownership


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("nodeSelector", {"pool": "gpu"}),
        ("tolerations", [{"key": "gpu", "operator": "Exists"}]),
        ("resources", {"limits": {"memory": "8Gi"}}),
        ("podTemplate", {"spec": {"priorityClassName": "high"}}),
    ],
)
def test_a_field_removed_from_the_spec_is_a_change(field: str, value: Any) -> None:
    before = settled(pool_object())
    before["spec"]["consumer"] = {**before["spec"]["consumer"], field: value}
    after = copy.deepcopy(before)
    del after["spec"]["consumer"][field]
    p = plan(settled_snapshot(after, live_from=before), DEFAULTS, NOW)
    secret, apply = writes(p)
    assert isinstance(secret, CreateSecret)  # a Deployment write re-creates what it refers to
    assert apply.describe() == "Deployment/tiny-consumer"
    # It is the whole object as now rendered: server-side apply drops what it no longer has.
    assert isinstance(apply, Apply)
    assert json.dumps(value) not in json.dumps(apply.obj)
    # Applied, the next pass plans nothing.
    assert plan(settled_snapshot(after), DEFAULTS, NOW).actions == ()


def test_every_child_carries_the_digest_of_what_is_applied() -> None:
    obj = pool_object()
    report = report_of(obj)
    pool = EncoderPool.from_object(obj)
    for child in render.workload_objects(pool, report, DEFAULTS):
        digest = child["metadata"]["annotations"][ANNOTATION_DIGEST]
        assert render.with_digest(child)["metadata"]["annotations"][ANNOTATION_DIGEST] == digest
    env = {**obj["spec"]["model"], "env": [{"name": "A", "value": "1"}]}
    other = EncoderPool.from_object(pool_object(model=env))
    digests = {
        ref_of(c): c["metadata"]["annotations"][ANNOTATION_DIGEST]
        for c in render.workload_objects(other, report, DEFAULTS)
    }
    for child in render.workload_objects(pool, report, DEFAULTS):
        changed = digests[ref_of(child)] != child["metadata"]["annotations"][ANNOTATION_DIGEST]
        assert changed == (child["kind"] == "Deployment" and "router" not in ref_of(child)[2])


def test_a_disabled_router_is_pruned_with_its_rbac() -> None:
    with_router = settled(pool_object())
    without = {**with_router, "spec": {**with_router["spec"], "router": {"enabled": False}}}
    p = plan(settled_snapshot(without, live_from=with_router), DEFAULTS, NOW)
    assert sorted(a.describe() for a in writes(p)) == [
        "Deployment/tiny-router (deleted: no longer in the spec)",
        # without a router, the vLLM pods' port opens to the pool's clients
        "NetworkPolicy/tiny-consumer",
        "NetworkPolicy/tiny-producer",
        "NetworkPolicy/tiny-router (deleted: no longer in the spec)",
        "Role/tiny-router (deleted: no longer in the spec)",
        "RoleBinding/tiny-router (deleted: no longer in the spec)",
        "Service/tiny (deleted: no longer in the spec)",
        "ServiceAccount/tiny-router (deleted: no longer in the spec)",
    ]


def test_a_transport_switch_leaves_nothing_of_the_old_one() -> None:
    shared = settled(pool_object())
    rdma = {
        **shared,
        "spec": {**shared["spec"], "connector": {"rdma": {"ucxTransports": "tcp,sm,self"}}},
    }
    p = plan(settled_snapshot(rdma, live_from=shared), DEFAULTS, NOW)
    described = [a.describe() for a in writes(p)]
    assert described == [
        "Secret/tiny-internal (created unless it exists)",
        "Deployment/tiny-producer",
        "Deployment/tiny-consumer",
        "Deployment/tiny-router",  # no --reuse-encoded-s without a shared volume
        "NetworkPolicy/tiny-producer",  # consumers now read from producers (rdma)
        "PersistentVolumeClaim/tiny-cache (deleted: no longer in the spec)",
    ]
    rendered = json.dumps([a.obj for a in writes(p) if isinstance(a, Apply)])
    assert "ec-cache" not in rendered
    assert "sharedVolume" not in rendered


def test_children_of_another_owner_are_never_pruned() -> None:
    with_router = settled(pool_object())
    without = {**with_router, "spec": {**with_router["spec"], "router": {"enabled": False}}}
    snap = settled_snapshot(without, live_from=with_router)
    # observe keeps only what the pool controls: an object of another uid is not in owned.
    assert all(snap.ours(o) for o in snap.owned.values())
    kept = {ref: o for ref, o in snap.owned.items() if "router" not in ref[2] and ref[2] != "tiny"}
    p = plan(dataclasses.replace(snap, owned=kept), DEFAULTS, NOW)
    assert [a for a in writes(p) if isinstance(a, Delete)] == []


@pytest.mark.parametrize("owner", [None, "someone-else"])
def test_a_foreign_object_with_a_child_s_name_is_never_touched(owner: str | None) -> None:
    obj = settled(pool_object())
    snap = settled_snapshot(obj)
    ref = ("apps/v1", "Deployment", "tiny-consumer")
    foreign = copy.deepcopy(dict(snap.live[ref] or {}))
    foreign["metadata"]["ownerReferences"] = (
        [{"uid": owner, "controller": True, "kind": "X", "name": "x"}] if owner else []
    )
    foreign["spec"]["replicas"] = 7
    owned = {r: o for r, o in snap.owned.items() if r != ref}
    p = plan(
        dataclasses.replace(snap, live={**snap.live, ref: foreign}, owned=owned), DEFAULTS, NOW
    )
    assert writes(p) == []
    status, reason, message = plan_condition(p, "ChildrenOwned")
    assert (status, reason) == ("False", "NameConflict")
    assert "Deployment ml/tiny-consumer" in message
    assert "delete or rename it" in message
    assert plan_condition(p, "Ready")[:2] == ("False", "NameConflict")
    # The foreign Deployment's status is not the pool's.
    assert plan_condition(p, "ConsumersAvailable")[1] == "NotCreated"


@pytest.mark.parametrize("router_exists", [False, True])
def test_no_router_while_a_service_it_would_follow_is_foreign(router_exists: bool) -> None:
    """The router takes its backends from the Services' EndpointSlices: with one of them
    someone else's, it is not deployed (an existing one is deleted), and RouterAvailable
    names the Service."""
    obj = settled(pool_object())
    snap = settled_snapshot(obj)
    svc = ("v1", "Service", "tiny-consumer")
    router = ("apps/v1", "Deployment", "tiny-router")
    theirs = copy.deepcopy(dict(snap.live[svc] or {}))
    theirs["metadata"]["ownerReferences"] = []
    live = {**snap.live, svc: theirs}
    owned = {r: o for r, o in snap.owned.items() if r != svc}
    if not router_exists:
        live[router] = None
        owned.pop(router)
    p = plan(dataclasses.replace(snap, live=live, owned=owned), DEFAULTS, NOW)
    assert [a for a in writes(p) if getattr(a, "obj", {}).get("kind") == "Deployment"] == []
    deletes = [a.describe() for a in writes(p) if isinstance(a, Delete)]
    assert deletes == (
        ["Deployment/tiny-router (deleted: its Services are not this pool's)"]
        if router_exists
        else []
    )
    status, reason, message = plan_condition(p, "RouterAvailable")
    assert (status, reason) == ("False", "ServiceNotOwned")
    assert "Service ml/tiny-consumer is not controlled by this pool" in message
    assert plan_condition(p, "ChildrenOwned")[1] == "NameConflict"
    assert plan_condition(p, "Ready")[0] == "False"
    # Owned again: the router comes back.
    p = plan(dataclasses.replace(snap, live={**snap.live, router: None}), DEFAULTS, NOW)
    assert "Deployment/tiny-router" in [a.describe() for a in writes(p)]


def test_a_foreign_job_with_the_width_job_s_name_is_never_applied() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    theirs = job(pool, None)
    theirs["metadata"]["ownerReferences"] = []
    ref = ref_of(theirs)
    p = plan(snapshot(obj, live={ref: theirs}), DEFAULTS, NOW)
    assert writes(p) == []
    assert plan_condition(p, "ChildrenOwned")[1] == "NameConflict"
    assert f"Job ml/{ref[2]}" in plan_condition(p, "Ready")[2]


def test_names_fit_at_the_longest_pool_name() -> None:
    longest = "a" * (MAX_NAME_LENGTH - 1) + "b"
    obj = pool_object()
    obj["metadata"]["name"] = longest
    pool = EncoderPool.from_object(obj)
    report = report_of(obj)
    identity = pool.spec.model_identity(pool.spec.image)
    objects = [*render.workload_objects(pool, report, DEFAULTS)]
    objects.append(width_job(pool, identity, report_key(pool)))
    dns_label = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    for o in objects:
        name = o["metadata"]["name"]
        assert len(name) <= 63, name
        assert dns_label.match(name), name
        for value in o["metadata"]["labels"].values():
            assert len(value) <= 63, value
    # Two long names with one prefix get two Jobs.
    other = EncoderPool.from_object({**obj, "metadata": {**obj["metadata"], "name": "a" * 50}})
    assert width_job_name(pool, "f" * 16) != width_job_name(other, "f" * 16)
    assert width_job_name(EncoderPool.from_object(pool_object()), "f" * 16) == (
        "tiny-width-ffffffffff"
    )


def _rolling(obj: dict[str, Any], available: int, replicas: int = 3) -> Snapshot:
    """The pool's consumers scaled to ``replicas``, ``available`` of them up so far."""
    report = report_of(obj)
    live = live_children(EncoderPool.from_object(obj), report)
    consumer = live[("apps/v1", "Deployment", "tiny-consumer")]
    consumer["spec"]["replicas"] = replicas
    consumer["status"].update(updatedReplicas=replicas, availableReplicas=available)
    return snapshot(obj, report_cm=report_cm(report), live=live)


def test_rollout_progress_is_written_at_most_every_progress_seconds() -> None:
    obj = settled(pool_object(consumer={"replicas": 3}))
    first = plan(_rolling(obj, 0), DEFAULTS, NOW)  # Ready turns False: written at once
    assert any(isinstance(a, PatchStatus) for a in first.actions)
    assert plan_condition(first, "Ready")[0] == "False"
    rolling = {**obj, "status": first.status.model_dump(mode="json", by_alias=True)}
    # One more pod up two seconds later: progress only, held back for the rest of 10 s.
    snap = replace(_rolling(rolling, 1), status_written_at=NOW)
    later = plan(snap, DEFAULTS, NOW + timedelta(seconds=2))
    assert not any(isinstance(a, PatchStatus) for a in later.actions)
    assert later.requeue_after == PROGRESS_SECONDS - 2
    # After the interval it is written; and becoming Ready is written at once, always.
    assert any(
        isinstance(a, PatchStatus)
        for a in plan(snap, DEFAULTS, NOW + timedelta(seconds=PROGRESS_SECONDS)).actions
    )
    done = replace(_rolling(rolling, 3), status_written_at=NOW)
    ready = plan(done, DEFAULTS, NOW + timedelta(seconds=1))
    assert any(isinstance(a, PatchStatus) for a in ready.actions)
    assert plan_condition(ready, "Ready")[0] == "True"


def _status_patch(p: Plan) -> dict[str, Any]:
    (patch,) = [a for a in p.actions if isinstance(a, PatchStatus)]
    return patch.body


def test_the_status_shows_the_measured_encode_times_beside_the_widths() -> None:
    obj = pool_object()
    data = json.loads(report_of(obj).model_dump_json())
    report = WidthReport.model_validate({**data, "encode_seconds": {"image": 0.078312}})
    p = plan(snapshot(obj, report_cm=report_cm(report)), DEFAULTS, NOW)
    assert p.status.encode_seconds == {"image": 0.078312}
    body = _status_patch(p)
    assert body["encodeSeconds"] == {"image": 0.078312}
    assert body["encoderOutputWidths"] == {"image": 128}


def _router_container(p: Plan) -> dict[str, Any]:
    (deployment,) = [
        a.obj
        for a in p.actions
        if isinstance(a, Apply) and a.describe() == "Deployment/tiny-router"
    ]
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(c)


def _router_env(p: Plan) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in _router_container(p)["env"]}


@pytest.mark.parametrize("dispatch", ["WhenFaster", "Always"])
def test_when_faster_routers_get_the_encode_times_the_status_shows(
    dispatch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """status.encodeSeconds and what the router prices the consumer's encode by are one
    measurement: the router parses what the operator renders (to three digits)."""
    from encoderpool_contracts.router_args import ENCODE_SECONDS_ENV
    from encoderpool_router.config import parse_settings

    obj = pool_object()
    obj["spec"]["router"] = {**obj["spec"].get("router", {}), "dispatch": dispatch}
    data = json.loads(report_of(obj).model_dump_json())
    report = WidthReport.model_validate({**data, "encode_seconds": {"image": 0.078312}})
    p = plan(snapshot(obj, report_cm=report_cm(report)), DEFAULTS, NOW)
    assert _status_patch(p)["encodeSeconds"] == {"image": 0.078312}
    env = _router_env(p)
    if dispatch == "Always":  # nothing weighs it: not rendered, no router rolls
        assert ENCODE_SECONDS_ENV not in env
        return
    assert env[ENCODE_SECONDS_ENV] == '{"image": 0.0783}'
    monkeypatch.setenv(ENCODE_SECONDS_ENV, env[ENCODE_SECONDS_ENV])
    settings = parse_settings(_router_container(p)["args"])
    assert settings.dispatch == "when-faster"
    assert settings.encode_seconds == {"image": 0.0783}
    # A report without times (an earlier release's): nothing rendered, the router then
    # compares queues.
    p = plan(snapshot(obj, report_cm=report_cm(report_of(obj))), DEFAULTS, NOW)
    assert ENCODE_SECONDS_ENV not in _router_env(p)


def test_a_report_of_an_earlier_release_shows_no_encode_times() -> None:
    obj = pool_object()
    report = report_of(obj)
    assert report.encode_seconds == {}
    p = plan(snapshot(obj, report_cm=report_cm(report)), DEFAULTS, NOW)
    assert p.status.encode_seconds is None
    body = _status_patch(p)
    assert "encodeSeconds" not in body
    assert body["encoderOutputWidths"] == {"image": 128}
    # A status that had them (an earlier report of this pool) drops them: the patch
    # nulls the key, as a merge patch cannot remove it by omission.
    obj["status"] = {"encodeSeconds": {"image": 0.5}, "encoderOutputWidths": {"image": 128}}
    body = _status_patch(plan(snapshot(obj, report_cm=report_cm(report)), DEFAULTS, NOW))
    assert body["encodeSeconds"] is None

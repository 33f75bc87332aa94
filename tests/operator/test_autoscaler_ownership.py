"""An autoscaler as a child of the pool, planned: replicas handed over without a dip, no
autoscaler for what the pool does not own (its Deployment, the HPA KEDA would make or
take over), the other engine's autoscaler gone first, and status.autoscaling as the
autoscalers report themselves."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from encoderpool_operator.api import EncoderPool, EncoderPoolStatus, RoleSpec
from encoderpool_operator.naming import FIELD_MANAGER
from encoderpool_operator.reconcile.actions import Apply, Delete
from encoderpool_operator.reconcile.plan import plan
from encoderpool_operator.reconcile.snapshot import Snapshot
from encoderpool_operator.render.vllm import deployment_replicas
from tests.operator.fixtures import (
    DEFAULTS,
    HPA,
    HPA_HOLDS_REPLICAS,
    KEDA,
    NOW,
    live_children,
    owned_of,
    plan_condition,
    pool_object,
    report_cm,
    report_of,
    snapshot,
    writes,
)

DEPLOYMENT = ("apps/v1", "Deployment", "tiny-consumer")
SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject", "tiny-consumer")
HPA_REF = ("autoscaling/v2", "HorizontalPodAutoscaler", "tiny-consumer")
OURS_ONLY = [
    {"manager": FIELD_MANAGER, "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
]


AUTO_3_6 = {"autoscaling": {"minReplicas": 3, "maxReplicas": 6}}


def consumer_pool(**consumer: Any) -> dict[str, Any]:
    obj = pool_object()
    obj["spec"]["consumer"] = {**obj["spec"]["consumer"], **consumer}
    return obj


def deployment(replicas: int, managed: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"managedFields": managed}, "spec": {"replicas": replicas}}


def role(**spec: Any) -> RoleSpec:
    return RoleSpec.model_validate(spec)


# ---------------------------------------------------------------- the hand-over, rendered


@pytest.mark.parametrize(
    ("spec", "live", "expected"),
    [
        # Fixed: the spec's count, whatever is live.
        ({"replicas": 3}, deployment(5, HPA_HOLDS_REPLICAS), {"replicas": 3}),
        # Autoscaling, the operator still the field's only manager: the live count stays
        # applied (dropping it would let the API server default it to 1) ...
        (AUTO_3_6, deployment(3, OURS_ONLY), 3),
        ({"autoscaling": {"minReplicas": 1, "maxReplicas": 6}}, deployment(5, OURS_ONLY), 5),
        # ... never below minReplicas ...
        ({"autoscaling": {"minReplicas": 4, "maxReplicas": 6}}, deployment(3, OURS_ONLY), 4),
        # ... a new Deployment at max(minReplicas, 1) ...
        ({"autoscaling": {"minReplicas": 0, "maxReplicas": 6}}, None, 1),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 6}}, None, 2),
        # ... until the autoscaler writes it (HPA controller, KEDA: through /scale), then
        # nothing: the field stays, its manager now the autoscaler.
        (AUTO_3_6, deployment(4, HPA_HOLDS_REPLICAS), {}),
        (
            {"autoscaling": {"minReplicas": 0, "maxReplicas": 6}},
            deployment(0, [{**HPA_HOLDS_REPLICAS[0], "manager": "keda"}]),
            {},
        ),
        (AUTO_3_6, deployment(3, [*OURS_ONLY, *HPA_HOLDS_REPLICAS]), {}),
    ],
)  # fmt: skip
def test_an_autoscaling_role_keeps_its_live_replicas_until_its_autoscaler_holds_them(
    spec: dict[str, Any], live: dict[str, Any] | None, expected: Any
) -> None:
    want = {"replicas": expected} if isinstance(expected, int) else expected
    assert deployment_replicas(role(**spec), live) == want


def _settled(obj: dict[str, Any], defaults: Any, live: dict[Any, Any]) -> Snapshot:
    report = report_of(obj)
    first = plan(
        snapshot(obj, report_cm=report_cm(report), live=live, owned=owned_of(live)), defaults, NOW
    )
    status = first.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    return snapshot(
        {**obj, "status": status}, report_cm=report_cm(report), live=live, owned=owned_of(live)
    )


def _applied(p: Any, kind: str) -> dict[str, dict[str, Any]]:
    return {
        a.obj["metadata"]["name"]: a.obj
        for a in writes(p)
        if isinstance(a, Apply) and a.obj["kind"] == kind
    }


def test_fixed_to_autoscaling_keeps_the_count_then_hands_the_field_over() -> None:
    fixed = consumer_pool(replicas=3)
    live = live_children(EncoderPool.from_object(fixed), report_of(fixed))
    live[DEPLOYMENT]["metadata"]["managedFields"] = copy.deepcopy(OURS_ONLY)
    scaled = consumer_pool(autoscaling={"minReplicas": 3, "maxReplicas": 6})
    # The switch renders the consumers' Deployment as it is (3, applied by the operator):
    # no write to it at all, only the new autoscaler. (Dropping the field here is what
    # let the API server default it to 1.)
    p = plan(_settled(scaled, HPA, live), HPA, NOW)
    assert "tiny-consumer" not in _applied(p, "Deployment")
    assert list(_applied(p, "HorizontalPodAutoscaler")) == ["tiny-consumer"]
    # The HPA controller scales to 4 and so holds the field: one apply, without it.
    after = live_children(EncoderPool.from_object(scaled), report_of(scaled), HPA, scaled_to=4)
    live[HPA_REF] = after[HPA_REF]
    live[DEPLOYMENT]["metadata"]["managedFields"] = copy.deepcopy(HPA_HOLDS_REPLICAS)
    live[DEPLOYMENT]["spec"]["replicas"] = 4
    p = plan(_settled(scaled, HPA, live), HPA, NOW)
    assert "replicas" not in _applied(p, "Deployment")["tiny-consumer"]["spec"]
    # Applied (the server keeps the autoscaler's 4), the next pass writes nothing.
    assert writes(plan(_settled(scaled, HPA, after), HPA, NOW)) == []


def test_autoscaling_to_fixed_takes_the_field_back_and_prunes_the_autoscaler() -> None:
    scaled = consumer_pool(autoscaling={"minReplicas": 3, "maxReplicas": 6})
    live = live_children(EncoderPool.from_object(scaled), report_of(scaled), HPA, scaled_to=4)
    fixed = consumer_pool(replicas=2)
    p = plan(_settled(fixed, HPA, live), HPA, NOW)
    assert _applied(p, "Deployment")["tiny-consumer"]["spec"]["replicas"] == 2
    deleted = [(a.kind, a.name) for a in writes(p) if isinstance(a, Delete)]
    assert deleted == [("HorizontalPodAutoscaler", "tiny-consumer")]


# ------------------------------------------------- only for what the pool owns


def _measured(obj: dict[str, Any], defaults: Any, scaled_to: int | None = 2) -> Snapshot:
    report = report_of(obj)
    live = live_children(EncoderPool.from_object(obj), report, defaults, scaled_to)
    return snapshot(obj, report_cm=report_cm(report), live=live, owned=owned_of(live))


def _live(snap: Snapshot, ref: Any) -> dict[str, Any]:
    """A copy of the live object at ``ref`` (the test's to change)."""
    return copy.deepcopy(dict(snap.live[ref] or {}))


def _theirs(obj: dict[str, Any] | None, uid: str = "someone-else") -> dict[str, Any]:
    out = copy.deepcopy(obj or {})
    out.setdefault("metadata", {})["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "X", "name": "x", "uid": uid, "controller": True}
    ]
    return out


def _without(snap: Snapshot, *refs: Any) -> dict[Any, Any]:
    return {r: o for r, o in snap.owned.items() if r not in refs}


SCALED = {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}


@pytest.mark.parametrize(
    ("defaults", "kind"), [(KEDA, "ScaledObject"), (HPA, "HorizontalPodAutoscaler")]
)
def test_no_autoscaler_for_a_deployment_the_pool_does_not_control(defaults: Any, kind: str) -> None:
    snap = _measured(consumer_pool(**SCALED), defaults)
    live = {**snap.live, DEPLOYMENT: _theirs(_live(snap, DEPLOYMENT))}
    p = plan(dataclasses.replace(snap, live=live, owned=_without(snap, DEPLOYMENT)), defaults, NOW)
    assert not [a for a in writes(p) if isinstance(a, Apply)]
    # The pool's own autoscaler of that Deployment goes (it would scale someone else's).
    (delete,) = [a for a in writes(p) if isinstance(a, Delete)]
    assert (delete.kind, delete.name) == (kind, "tiny-consumer")
    status, reason, message = plan_condition(p, "ChildrenOwned")
    assert (status, reason) == ("False", "NameConflict")
    assert (
        "Deployment ml/tiny-consumer already exists and is not controlled by this pool" in message
    )
    assert (
        f"{kind} ml/tiny-consumer is withheld: Deployment ml/tiny-consumer is not controlled"
        in message
    )
    (entry,) = p.status.autoscaling or ()
    assert (entry.role, entry.active, entry.reason) == ("consumer", False, "NameConflict")


def test_keda_is_withheld_while_its_hpa_name_is_someone_else_s() -> None:
    snap = _measured(consumer_pool(**SCALED), KEDA)
    theirs = _theirs(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "tiny-consumer"},
        }
    )
    p = plan(dataclasses.replace(snap, live={**snap.live, HPA_REF: theirs}), KEDA, NOW)
    assert not [a for a in writes(p) if isinstance(a, Apply)]
    assert [(a.kind, a.name) for a in writes(p) if isinstance(a, Delete)] == [
        ("ScaledObject", "tiny-consumer")
    ]
    message = plan_condition(p, "ChildrenOwned")[2]
    assert "HorizontalPodAutoscaler ml/tiny-consumer already exists" in message
    assert (
        "ScaledObject ml/tiny-consumer is withheld: HorizontalPodAutoscaler ml/tiny-consumer is "
        "not controlled by this pool's ScaledObject, and KEDA would take it over"
    ) in message
    assert plan_condition(p, "Ready")[:2] == ("False", "NameConflict")


def test_the_hpa_keda_made_for_the_pool_s_scaled_object_is_the_pool_s() -> None:
    snap = _measured(consumer_pool(**SCALED), KEDA)
    scaled_object = _live(snap, SCALED_OBJECT)
    made = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": "tiny-consumer",
            "ownerReferences": [
                {
                    "kind": "ScaledObject",
                    "name": "tiny-consumer",
                    "controller": True,
                    "uid": scaled_object["metadata"]["uid"],
                }
            ],
        },
        "status": {
            "currentReplicas": 2,
            "desiredReplicas": 3,
            "lastScaleTime": "2026-12-01T11:59:00Z",
            "conditions": [
                {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"}
            ],
        },
    }
    scaled_object["status"] = {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "ScaledObjectReady", "message": "ok"},
            {
                "type": "Active",
                "status": "True",
                "reason": "ScalerActive",
                "message": "Scaling is performed because triggers are active",
            },
        ]
    }
    live = {**snap.live, HPA_REF: made, SCALED_OBJECT: scaled_object}
    owned: dict[Any, Any] = {**snap.owned, SCALED_OBJECT: scaled_object}
    p = plan(dataclasses.replace(snap, live=live, owned=owned), KEDA, NOW)
    assert not [a for a in writes(p) if isinstance(a, Delete)]
    assert plan_condition(p, "ChildrenOwned")[0] == "True"
    (entry,) = p.status.autoscaling or ()
    assert entry.model_dump(mode="json", exclude_none=True) == {
        "role": "consumer",
        "engine": "keda",
        "name": "tiny-consumer",
        "minReplicas": 1,
        "maxReplicas": 4,
        "currentReplicas": 2,
        "desiredReplicas": 3,
        "active": True,
        "reason": "ScalerActive",
        "message": "Scaling is performed because triggers are active",
        "lastScaleTime": "2026-12-01T11:59:00Z",
    }
    assert p.status.autoscaling_summary == "consumer 2/3 (1-4)"
    # KEDA at rest: Active False is why it is not active.
    scaled_object["status"]["conditions"][1].update(status="False", reason="ScalerNotActive")
    p = plan(dataclasses.replace(snap, live=live, owned=owned), KEDA, NOW)
    (entry,) = p.status.autoscaling or ()
    assert (entry.active, entry.reason) == (False, "ScalerNotActive")
    assert p.status.autoscaling_summary == "consumer 2/3 (1-4) inactive"


def test_a_new_role_gets_its_autoscaler_once_its_deployment_is_the_pool_s() -> None:
    snap = _measured(consumer_pool(**SCALED), KEDA)
    live = {**snap.live, DEPLOYMENT: None, SCALED_OBJECT: None}
    owned = _without(snap, DEPLOYMENT, SCALED_OBJECT)
    p = plan(dataclasses.replace(snap, live=live, owned=owned), KEDA, NOW)
    assert "Deployment/tiny-consumer" in [a.describe() for a in writes(p)]
    assert "ScaledObject/tiny-consumer" not in [a.describe() for a in writes(p)]
    (entry,) = p.status.autoscaling or ()
    assert (entry.reason, entry.message) == (
        "WaitingForDeployment",
        "waiting for Deployment ml/tiny-consumer to be created",
    )
    assert plan_condition(p, "ChildrenOwned")[0] == "True"  # not a conflict: it comes next


def test_after_an_engine_change_the_old_autoscaler_goes_first() -> None:
    # HPA engine -> KEDA: the pool's HPA of that name is deleted, the ScaledObject waits
    # (KEDA would otherwise take the HPA over, and lose it to the deletion).
    before = _measured(consumer_pool(**SCALED), HPA)
    p = plan(before, KEDA, NOW)
    assert [a.describe() for a in writes(p)] == [
        "HorizontalPodAutoscaler/tiny-consumer (deleted: no longer in the spec)"
    ]
    (entry,) = p.status.autoscaling or ()
    assert (entry.reason, entry.active) == ("Replacing", False)
    assert plan_condition(p, "ChildrenOwned")[0] == "True"
    # KEDA -> HPA engine: KEDA's HPA goes with the pool's ScaledObject (owner reference).
    snap = _measured(consumer_pool(**SCALED), KEDA)
    made = _theirs(
        {"metadata": {"name": "tiny-consumer"}}, _live(snap, SCALED_OBJECT)["metadata"]["uid"]
    )
    p = plan(dataclasses.replace(snap, live={**snap.live, HPA_REF: made}), HPA, NOW)
    assert [a.describe() for a in writes(p)] == [
        "ScaledObject/tiny-consumer (deleted: no longer in the spec)"
    ]
    (entry,) = p.status.autoscaling or ()
    assert entry.reason == "Replacing"
    assert "still KEDA's" in entry.message


def test_the_hpa_engine_reports_why_its_hpa_is_not_active() -> None:
    snap = _measured(consumer_pool(**SCALED), HPA)
    hpa = _live(snap, HPA_REF)
    hpa["status"] = {
        "currentReplicas": 2,
        "desiredReplicas": 2,
        "conditions": [
            {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale"},
            {
                "type": "ScalingActive",
                "status": "False",
                "reason": "FailedGetExternalMetric",
                "message": "the HPA was unable to compute the replica count: " + "x" * 5000,
            },
        ],
    }
    p = plan(dataclasses.replace(snap, live={**snap.live, HPA_REF: hpa}), HPA, NOW)
    (entry,) = p.status.autoscaling or ()
    assert (entry.engine, entry.active, entry.reason) == ("hpa", False, "FailedGetExternalMetric")
    assert (entry.current_replicas, entry.desired_replicas) == (2, 2)
    assert len(entry.message) == 1024
    assert entry.last_scale_time is None


def test_status_autoscaling_lists_every_role_and_is_absent_without_one() -> None:
    obj = pool_object()
    obj["spec"]["producer"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
    obj["spec"]["producerGroups"] = [
        {"name": "images", "modalities": ["image"]},
        {
            "name": "video",
            "modalities": ["video"],
            "autoscaling": {"minReplicas": 1, "maxReplicas": 5},
        },
    ]
    obj["spec"]["model"]["limitMmPerPrompt"] = {"image": 1, "video": 1}
    p = plan(_measured(obj, KEDA, scaled_to=None), KEDA, NOW)
    got = [(a.role, a.group, a.min_replicas, a.max_replicas) for a in p.status.autoscaling or ()]
    assert got == [("producer-images", "images", 0, 2), ("producer-video", "video", 1, 5)]
    assert p.status.producer_groups_summary == "images 1/1, video 1/1"
    # KEDA without a Prometheus renders no autoscaler, and each role says why.
    p = plan(_measured(obj, DEFAULTS, scaled_to=None), DEFAULTS, NOW)
    assert {a.reason for a in p.status.autoscaling or ()} == {"AutoscalingUnavailable"}
    assert plan(_measured(pool_object(), KEDA), KEDA, NOW).status.autoscaling is None


def test_autoscaler_counts_are_progress_and_its_activity_is_not() -> None:
    from encoderpool_operator.reconcile.plan import progress_hold

    base = {
        "role": "consumer",
        "engine": "hpa",
        "name": "tiny-consumer",
        "minReplicas": 1,
        "maxReplicas": 4,
        "active": True,
        "reason": "ValidMetricFound",
    }
    old = EncoderPoolStatus.model_validate({"autoscaling": [{**base, "currentReplicas": 1}]})
    counts = EncoderPoolStatus.model_validate({"autoscaling": [{**base, "currentReplicas": 2}]})
    inactive = EncoderPoolStatus.model_validate({"autoscaling": [{**base, "active": False}]})
    assert progress_hold(old, counts, NOW, NOW) > 0
    assert progress_hold(old, inactive, NOW, NOW) == 0


def test_a_deployment_deleted_by_hand_is_made_again_and_its_autoscaler_kept() -> None:
    snap = _measured(consumer_pool(**SCALED), KEDA)
    live = {**snap.live, DEPLOYMENT: None}
    p = plan(dataclasses.replace(snap, live=live, owned=_without(snap, DEPLOYMENT)), KEDA, NOW)
    assert [a.describe() for a in writes(p)] == [
        "Secret/tiny-internal (created unless it exists)",
        "Deployment/tiny-consumer",
    ]
    (entry,) = p.status.autoscaling or ()
    assert entry.reason == "WaitingForDeployment"

"""Per-role autoscaling, rendered and planned: the autoscalers, the replicas they own,
the drain of a producer leaving, and what the pool says when autoscaling cannot work."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from encoderpool_contracts.router_args import PRODUCER_TIMEOUT_S
from encoderpool_contracts.signals import (
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    VLLM_KV_CACHE_USAGE,
    VLLM_REQUESTS_RUNNING,
    VLLM_REQUESTS_WAITING,
)
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.reconcile.actions import Apply, Delete
from encoderpool_operator.reconcile.plan import plan
from encoderpool_operator.render import workload_objects
from encoderpool_operator.render.vllm import DRAIN_SECONDS
from tests.operator.fixtures import (
    DEFAULTS,
    GROUPS,
    HPA,
    KEDA,
    NOW,
    PROM,
    live_children,
    owned_of,
    plan_condition,
    pool_object,
    report_cm,
    report_of,
    snapshot,
    writes,
)

PRODUCER_SCALING = {"minReplicas": 0, "maxReplicas": 4}
CONSUMER_SCALING = {"minReplicas": 1, "maxReplicas": 3, "target": 4, "targetKvCacheUsage": 0.8}


def autoscaled(
    producer: Any = PRODUCER_SCALING, consumer: Any = CONSUMER_SCALING
) -> dict[str, Any]:
    obj = pool_object()
    if producer is not None:
        obj["spec"]["producer"] = {**obj["spec"]["producer"], "autoscaling": producer}
    if consumer is not None:
        obj["spec"]["consumer"] = {**obj["spec"]["consumer"], "autoscaling": consumer}
    return obj


def rendered(obj: dict[str, Any], defaults: Any = KEDA) -> dict[str, dict[str, Any]]:
    pool = EncoderPool.from_object(obj)
    return {
        f"{o['kind']}/{o['metadata']['name']}": o
        for o in workload_objects(pool, report_of(obj), defaults)
    }


def test_keda_scaled_objects_per_role_with_the_pools_signals() -> None:
    objs = rendered(autoscaled())
    producer = objs["ScaledObject/tiny-producer"]
    assert producer["spec"]["scaleTargetRef"]["name"] == "tiny-producer"
    assert (producer["spec"]["minReplicaCount"], producer["spec"]["maxReplicaCount"]) == (0, 4)
    assert producer["metadata"]["ownerReferences"][0]["controller"] is True
    demand, unserved = producer["spec"]["triggers"]
    sel = 'namespace="ml",pool="tiny",component="router",group="tiny-producer"'
    assert demand["metadata"]["query"] == (
        f"sum(rate({ENCODER_INFLIGHT_SECONDS}{{{sel}}}[1m])) or vector(0)"
    )
    assert demand["metadata"]["threshold"] == "2"  # the default: 2 items per producer
    assert demand["metadata"]["serverAddress"] == PROM
    # Any unserved item wakes the role (activation above 0) and keeps it up while its pod
    # starts (5m); clamped to 1 against a target of 1, it asks for one pod and never more.
    assert unserved["metadata"]["query"] == (
        f"clamp_max(sum(rate({ENCODER_UNSERVED_ITEMS}{{{sel}}}[5m])), 1) or vector(0)"
    )
    assert unserved["metadata"]["activationThreshold"] == "0"
    assert unserved["metadata"]["threshold"] == "1"
    # KEDA makes the HPA under the name the operator gives it (not keda-hpa-<name>).
    config = producer["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
    assert config["name"] == "tiny-producer"
    # Scale-down behaviour (default: 5 minutes, one pod a minute); KEDA's 1 -> 0 follows it.
    down = producer["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] == 300
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]
    assert producer["spec"]["cooldownPeriod"] == 300

    consumer = objs["ScaledObject/tiny-consumer"]
    lm, kv = consumer["spec"]["triggers"]
    assert VLLM_REQUESTS_RUNNING in lm["metadata"]["query"]
    assert VLLM_REQUESTS_WAITING in lm["metadata"]["query"]
    assert 'component="consumer"' in lm["metadata"]["query"]
    assert lm["metadata"]["threshold"] == "4"
    assert VLLM_KV_CACHE_USAGE in kv["metadata"]["query"]
    assert kv["metadata"]["threshold"] == "0.8"


def test_a_new_autoscaling_role_starts_at_its_minimum_and_a_producer_drains() -> None:
    objs = rendered(autoscaled(consumer={"minReplicas": 2, "maxReplicas": 3}))
    producer, consumer = objs["Deployment/tiny-producer"], objs["Deployment/tiny-consumer"]
    assert producer["spec"]["replicas"] == 1  # minReplicas 0: one pod, as a fixed role starts
    assert consumer["spec"]["replicas"] == 2
    pod = producer["spec"]["template"]["spec"]
    (vllm,) = pod["containers"]
    assert vllm["lifecycle"] == {"preStop": {"sleep": {"seconds": DRAIN_SECONDS}}}
    assert DRAIN_SECONDS > PRODUCER_TIMEOUT_S
    assert pod["terminationGracePeriodSeconds"] > DRAIN_SECONDS
    assert "lifecycle" not in consumer["spec"]["template"]["spec"]["containers"][0]
    # Without autoscaling nothing of this is rendered.
    plain = rendered(pool_object())
    assert plain["Deployment/tiny-producer"]["spec"]["replicas"] == 1
    assert (
        "lifecycle"
        not in plain["Deployment/tiny-producer"]["spec"]["template"]["spec"]["containers"][0]
    )
    assert not [k for k in plain if k.startswith("ScaledObject/")]


def test_hpa_engine_renders_external_metric_autoscalers() -> None:
    objs = rendered(autoscaled(producer={"minReplicas": 1, "maxReplicas": 2}), HPA)
    hpa = objs["HorizontalPodAutoscaler/tiny-producer"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 2)
    external = [m["external"] for m in hpa["spec"]["metrics"]]
    # Selected like the KEDA queries: namespace, pool, the exporting component, the group.
    labels = {"namespace": "ml", "pool": "tiny", "component": "router", "group": "tiny-producer"}
    assert external[0]["metric"] == {
        "name": "encoderpool_encoder_demand",
        "selector": {"matchLabels": labels},
    }
    assert external[1]["metric"]["selector"]["matchLabels"] == labels
    consumer = objs["HorizontalPodAutoscaler/tiny-consumer"]["spec"]["metrics"]
    assert {m["external"]["metric"]["name"] for m in consumer} == {
        "encoderpool_lm_demand",
        "encoderpool_kv_cache_usage",
    }
    for m in consumer:
        assert m["external"]["metric"]["selector"]["matchLabels"] == {
            "namespace": "ml",
            "pool": "tiny",
            "component": "consumer",
        }
    assert external[0]["target"] == {"type": "AverageValue", "averageValue": "2"}
    assert not [k for k in objs if k.startswith("ScaledObject/")]


def test_producer_groups_scale_each_on_their_own_demand() -> None:
    obj = pool_object()
    obj["spec"]["producer"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
    groups: list[dict[str, Any]] = copy.deepcopy(GROUPS)  # type: ignore[arg-type]
    groups[1]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 5, "target": 1}
    obj["spec"]["producerGroups"] = groups
    obj["spec"]["model"]["limitMmPerPrompt"] = {"image": 1, "video": 1}
    objs = rendered(obj)
    images = objs["ScaledObject/tiny-producer-images"]["spec"]
    video = objs["ScaledObject/tiny-producer-video"]["spec"]
    assert (images["minReplicaCount"], images["maxReplicaCount"]) == (0, 2)  # spec.producer's
    assert (video["minReplicaCount"], video["maxReplicaCount"]) == (1, 5)  # its own
    assert 'group="tiny-producer-video"' in video["triggers"][0]["metadata"]["query"]
    assert video["triggers"][0]["metadata"]["threshold"] == "1"


def measured_snapshot(obj: dict[str, Any], defaults: Any = KEDA, scaled_to: int = 1) -> Any:
    report = report_of(obj)
    live = live_children(EncoderPool.from_object(obj), report, defaults, scaled_to)
    return snapshot(obj, report_cm=report_cm(report), live=live, owned=owned_of(live))


def test_a_pass_over_what_the_autoscaler_set_writes_nothing_and_reports_its_count() -> None:
    obj = autoscaled()
    first = plan(measured_snapshot(obj, scaled_to=3), KEDA, NOW)
    settled = {**obj, "status": first.status.model_dump(mode="json", by_alias=True)}
    again = plan(measured_snapshot(settled, scaled_to=3), KEDA, NOW)
    assert writes(again) == []  # replicas 3 (the autoscaler's) is not ours to reset
    assert again.status.producers is not None
    assert again.status.producers.desired == 3
    assert plan_condition(again, "Ready")[0] == "True"


def test_a_producer_asleep_at_zero_is_available() -> None:
    p = plan(measured_snapshot(autoscaled(), scaled_to=0), KEDA, NOW)
    assert p.status.producers is not None
    assert p.status.producers.desired == 0
    assert plan_condition(p, "ProducersAvailable")[:2] == ("True", "Available")


def test_autoscaling_turned_off_hands_replicas_back_and_prunes_the_autoscaler() -> None:
    before = autoscaled(consumer=None)
    snap = measured_snapshot(before, scaled_to=3)
    after = pool_object()
    p = plan(dataclasses.replace(snap, pool=EncoderPool.from_object(after)), KEDA, NOW)
    applied = {a.obj["metadata"]["name"]: a.obj for a in writes(p) if isinstance(a, Apply)}
    assert applied["tiny-producer"]["spec"]["replicas"] == 1
    deleted = [(a.kind, a.name) for a in writes(p) if isinstance(a, Delete)]
    assert ("ScaledObject", "tiny-producer") in deleted


@pytest.mark.parametrize(
    ("defaults", "producer", "expected"),
    [
        (DEFAULTS, PRODUCER_SCALING, "autoscaling.prometheus.address"),
        (HPA, PRODUCER_SCALING, "needs the KEDA engine"),
    ],
)
def test_autoscaling_that_cannot_work_says_so_in_ready(
    defaults: Any, producer: Any, expected: str
) -> None:
    p = plan(measured_snapshot(autoscaled(producer=producer), defaults), defaults, NOW)
    status, reason, message = plan_condition(p, "Ready")
    assert (status, reason) == ("False", "AutoscalingUnavailable")
    assert expected in message

"""Producer groups (spec.producerGroups): a Deployment, headless Service and NetworkPolicy
per group, the router told each modality's Service, one connector config for all, status
per group. Pure: rendering and planning, no cluster (the CEL rules run on the API server
in test_crd_apiserver.py)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

import pytest

from encoderpool_contracts import ConnectorConfig
from encoderpool_operator import render
from encoderpool_operator.api import MAX_NAME_LENGTH, EncoderPool
from encoderpool_operator.api.roles import CHILD_NAME_WORDS, RESERVED_GROUP_WORD
from encoderpool_operator.naming import (
    CACHE,
    CONSUMER,
    INTERNAL,
    LABEL_COMPONENT,
    PRODUCER,
    ROUTER,
    WIDTH_JOB,
    name_of,
    producer_components,
    selector_labels,
    width_job_name,
)
from encoderpool_operator.reconcile.plan import plan
from encoderpool_router.config import parse_settings
from tests.operator.fixtures import (
    DEFAULTS,
    GROUPS,
    NOW,
    children,
    container,
    flag,
    grouped,
    live_children,
    load,
    owned_of,
    plan_condition,
    pool_object,
    report_cm,
    report_of,
    settled,
    settled_snapshot,
    snapshot,
    writes,
)


def pod_spec(objs: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    return dict(objs[f"Deployment/{name}"]["spec"]["template"]["spec"])


def test_each_group_gets_its_own_deployment_service_and_policy_and_no_default_producer() -> None:
    objs = children(grouped())
    for group in ("images", "video"):
        name = f"pool-producer-{group}"
        assert objs[f"Service/{name}"]["spec"]["clusterIP"] == "None"  # the router picks pods
        selector = objs[f"Deployment/{name}"]["spec"]["selector"]["matchLabels"]
        assert selector[LABEL_COMPONENT] == f"producer-{group}"
        assert objs[f"Service/{name}"]["spec"]["selector"] == selector
        assert objs[f"NetworkPolicy/{name}"]["spec"]["podSelector"]["matchLabels"] == selector
        labels = objs[f"Deployment/{name}"]["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
    assert not [k for k in objs if k.endswith("/pool-producer")]
    # Selectors apart: no group's Deployment adopts another's pods.
    selectors = [
        json.dumps(o["spec"]["selector"], sort_keys=True)
        for o in objs.values()
        if o["kind"] == "Deployment"
    ]
    assert len(set(selectors)) == len(selectors)


def test_a_group_is_spec_producer_with_its_own_replicas_resources_and_nodes() -> None:
    objs = children(grouped())
    images, video = (
        objs["Deployment/pool-producer-images"],
        objs["Deployment/pool-producer-video"],
    )
    assert images["spec"]["replicas"] == 2
    assert video["spec"]["replicas"] == 1  # spec.producer.replicas
    assert container(objs, "pool-producer-images")["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"memory": "4Gi"},
    }  # spec.producer.resources
    assert container(objs, "pool-producer-video")["resources"] == {
        "limits": {"cpu": "8", "memory": "16Gi"}
    }
    assert pod_spec(objs, "pool-producer-video")["nodeSelector"] == {"gpu": "big"}
    assert "nodeSelector" not in pod_spec(objs, "pool-producer-images")
    for name in ("pool-producer-images", "pool-producer-video"):
        assert pod_spec(objs, name)["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
        assert flag(container(objs, name)["args"], "--tensor-parallel-size") == "2"


def test_every_group_gets_the_consumer_s_connector_config() -> None:
    """One fingerprint and one set of widths: an entry any group writes loads anywhere."""
    objs = children(grouped())
    configs = {}
    for name in ("pool-producer-images", "pool-producer-video", "pool-consumer"):
        raw = json.loads(flag(container(objs, name)["args"], "--ec-transfer-config"))
        assert raw["ec_role"] == ("ec_consumer" if name == "pool-consumer" else "ec_producer")
        configs[name] = ConnectorConfig.from_extra_config(raw["ec_connector_extra_config"])
    assert len({c.model_dump_json() for c in configs.values()}) == 1


def test_the_router_is_told_each_modality_s_group_service() -> None:
    objs = children(grouped())
    settings = parse_settings(container(objs, "pool-router")["args"])
    assert settings.producer_service is None
    assert settings.producer_services_by_modality == {
        "image": "pool-producer-images",
        "video": "pool-producer-video",
    }
    assert settings.consumer_service == "pool-consumer"
    # A modality in no group: not listed, so the router leaves it to the consumers.
    only_video = children(grouped(groups=[{"name": "v", "modalities": ["video"]}]))
    settings = parse_settings(container(only_video, "pool-router")["args"])
    assert settings.producer_services_by_modality == {"video": "pool-producer-v"}


def test_one_group_may_take_several_modalities() -> None:
    objs = children(grouped(groups=[{"name": "media", "modalities": ["image", "video"]}]))
    settings = parse_settings(container(objs, "pool-router")["args"])
    assert settings.producer_services_by_modality == {
        "image": "pool-producer-media",
        "video": "pool-producer-media",
    }


@pytest.mark.parametrize("example", ["pool-shared-volume.yaml", "pool-rdma.yaml"])
def test_each_group_s_policy_lets_in_the_router_and_with_rdma_the_consumers(example: str) -> None:
    pool = grouped(example)
    objs = children(pool)
    single = children(load(example))["NetworkPolicy/pool-producer"]["spec"]["ingress"]
    for group in ("images", "video"):
        ingress = objs[f"NetworkPolicy/pool-producer-{group}"]["spec"]["ingress"]
        assert ingress == single  # the paths a single producer has, no more
    consumers = {"podSelector": {"matchLabels": selector_labels(pool, "consumer")}}
    rdma = any(consumers in rule.get("from", []) for rule in single)
    assert rdma == (example == "pool-rdma.yaml")


def report_of_pool(pool: EncoderPool) -> Any:
    return report_of(pool.model_dump(mode="json", by_alias=True, exclude={"status"}))


def test_long_pool_and_group_names_stay_within_63_characters_and_apart() -> None:
    long = "p" * MAX_NAME_LENGTH
    obj = load("pool-shared-volume.yaml").model_dump(mode="json", by_alias=True)
    obj["metadata"] = {"name": long, "namespace": "ml", "uid": "u-1"}
    obj["spec"]["producerGroups"] = [
        {"name": "a" * 16, "modalities": ["image"]},
        {"name": "a" * 15 + "b", "modalities": ["video"]},
    ]
    obj["spec"]["model"]["limitMmPerPrompt"] = {}
    pool = EncoderPool.from_object(obj)
    names = [name for _, _, name in render.child_refs(pool)]
    assert max(len(n) for n in names) <= 63
    groups = [name_of(pool, c) for c, _ in producer_components(pool)]
    assert len(set(groups)) == 2
    assert all(n.endswith(g) for n, g in zip(groups, ["a" * 16, "a" * 15 + "b"], strict=True))
    assert name_of(pool, "consumer") == f"{long}-consumer"  # short enough: unchanged


def test_no_groups_renders_exactly_what_a_single_producer_pool_always_rendered() -> None:
    for example in ("pool-shared-volume.yaml", "pool-rdma.yaml"):
        pool = load(example)
        empty = pool.model_copy(
            update={"spec": pool.spec.model_copy(update={"producer_groups": ()})}
        )
        assert children(empty) == children(pool)
        assert "Deployment/pool-producer" in children(pool)


# ----------------------------------------------------------------------------- plan


def groups_object(groups: Any = None) -> dict[str, Any]:
    obj = pool_object(producerGroups=copy.deepcopy(GROUPS if groups is None else groups))
    obj["spec"]["model"]["limitMmPerPrompt"] = {"image": 1, "video": 1}
    return obj


def test_status_counts_each_group_and_producers_available_needs_every_group() -> None:
    obj = settled(groups_object())
    p = plan(settled_snapshot(obj), DEFAULTS, NOW)
    status = p.status
    assert status.producers is not None
    assert status.producers.summary == "3/3"
    assert [(g.name, g.summary) for g in status.producer_groups or ()] == [
        ("images", "2/2"),
        ("video", "1/1"),
    ]
    assert plan_condition(p, "ProducersAvailable")[:2] == ("True", "Available")
    assert plan_condition(p, "Ready")[0] == "True"

    pool = EncoderPool.from_object(obj)
    report = report_of(obj)
    live = live_children(pool, report)
    video = live[("apps/v1", "Deployment", "tiny-producer-video")]
    video["status"] = {**video["status"], "availableReplicas": 0, "readyReplicas": 0}
    p = plan(snapshot(obj, report_cm=report_cm(report), live=live), DEFAULTS, NOW)
    status_, reason, message = plan_condition(p, "ProducersAvailable")
    assert (status_, reason) == ("False", "PodsNotReady")
    assert "producer group video: 0/1 pods available" in message
    assert "images" not in message
    assert plan_condition(p, "Ready")[0] == "False"
    assert p.status.producers is not None
    assert p.status.producers.summary == "2/3"


def test_moving_to_groups_replaces_the_single_producer_and_back() -> None:
    single = settled(pool_object())
    groups = {**single, "spec": {**groups_object()["spec"]}}
    p = plan(settled_snapshot(groups, live_from=single), DEFAULTS, NOW)
    described = sorted(a.describe() for a in writes(p))
    for gone in ("Deployment", "NetworkPolicy", "Service"):
        assert f"{gone}/tiny-producer (deleted: no longer in the spec)" in described
    for new in ("Deployment", "NetworkPolicy", "Service"):
        for group in ("images", "video"):
            assert f"{new}/tiny-producer-{group}" in described
    assert "Deployment/tiny-router" in described  # told the groups' Services
    assert p.status.producer_groups is not None

    back = plan(settled_snapshot(single, live_from=settled(groups)), DEFAULTS, NOW)
    described = sorted(a.describe() for a in writes(back))
    assert "Deployment/tiny-producer-video (deleted: no longer in the spec)" in described
    assert "Deployment/tiny-producer" in described
    assert back.status.producer_groups is None


def _with_groups(name: str, *groups: str) -> EncoderPool:
    obj = pool_object()
    obj["metadata"]["name"] = name
    obj["spec"]["producerGroups"] = [
        {"name": g, "modalities": [m]}
        for g, m in zip(groups, ["image", "video", "audio"], strict=False)
    ]
    obj["spec"]["model"]["limitMmPerPrompt"] = {}
    obj["spec"]["networkPolicy"] = {"enabled": True}
    return EncoderPool.from_object(obj)


def _child_names(pool: EncoderPool) -> set[str]:
    """Every name the pool's children take, but the router's Service (the pool's own)."""
    names = {name for _, _, name in render.child_refs(pool)} - {pool.name}
    return names | {name_of(pool, INTERNAL), width_job_name(pool, "0123456789abcdef")}


GROUP_CANDIDATES = [
    "video", "x", "images", "widths", "routers",  # allowed
    "consumer", "router", "cache", "internal", "producer", "width-job", "producer-x",
    "x-consumer", "x-router", "x-width-0123456789", "a-cache-b",  # refused
]  # fmt: skip


def test_a_group_name_the_rule_admits_is_no_other_pool_s_child_name() -> None:
    """<pool>-producer-<group> against every child name of pools whose names extend it:
    a group holding a component word is refused, and no admitted one collides."""
    admitted = [g for g in GROUP_CANDIDATES if re.search(RESERVED_GROUP_WORD, g) is None]
    assert admitted == ["video", "x", "images", "widths", "routers"]
    pools = ["a", "a-producer", "a-producer-x", "a-producer-video"]
    names = {p: _child_names(_with_groups(p, *admitted[:3])) for p in pools}
    for p in pools:
        for g in admitted:
            mine = name_of(_with_groups(p, g), f"producer-{g}")
            others = set().union(*(names[q] for q in pools if q != p))
            assert mine not in others, (p, g)
    # What the rule refuses would: a group "consumer" is pool a-producer's consumer.
    assert "a-producer-consumer" in names["a-producer"]
    assert "a-producer-x-router" in names["a-producer-x"]
    # Every component's name is made of the rule's words (a new component needs one).
    for component in (PRODUCER, CONSUMER, ROUTER, CACHE, INTERNAL, WIDTH_JOB, "width-0a1b"):
        assert set(component.split("-")) & set(CHILD_NAME_WORDS), component


def test_a_cut_name_carries_64_bits_of_the_pool_s_name() -> None:
    long = "p" * MAX_NAME_LENGTH
    pool = _with_groups(long, "a" * 16)
    name = name_of(pool, f"producer-{'a' * 16}")
    tag = hashlib.sha256(long.encode()).hexdigest()[:16]
    assert name == f"{'p' * 20}-{tag}-producer-{'a' * 16}"
    assert len(name) == 63
    assert width_job_name(pool, "f" * 16) == f"{'p' * 29}-{tag}-width-ffffffffff"


def test_children_renamed_by_a_longer_tag_are_replaced_and_the_old_ones_pruned() -> None:
    """An operator upgrade that cuts long names with a longer tag: the pool's children under
    the old names (its own, by owner reference) are deleted in the pass that applies the
    new ones; the router's arguments name the new Services, so the router rolls."""
    long = "p" * MAX_NAME_LENGTH
    obj = settled(pool_object())
    obj["metadata"]["name"] = long
    obj["spec"]["producerGroups"] = [{"name": "images", "modalities": ["image"]}]
    obj["spec"]["model"]["limitMmPerPrompt"] = {}
    pool = EncoderPool.from_object(obj)
    old_tag = hashlib.sha256(long.encode()).hexdigest()[:6]
    new_name = name_of(pool, "producer-images")
    old_name = f"{long[: 63 - len('-producer-images') - 7]}-{old_tag}-producer-images"
    assert new_name != old_name
    # What the earlier operator made: the same children, the group's under the old name
    # (and the router's arguments naming its Service so).
    live = {
        (*ref[:2], old_name if ref[2] == new_name else ref[2]): json.loads(
            json.dumps(child).replace(new_name, old_name)
        )
        for ref, child in live_children(pool, report_of(obj)).items()
    }
    snap = snapshot(obj, report_cm=report_cm(report_of(obj)), live=live, owned=owned_of(live))
    p = plan(snap, DEFAULTS, NOW)
    written = [a.describe() for a in writes(p)]
    for kind in ("Service", "Deployment", "NetworkPolicy"):
        assert f"{kind}/{new_name}" in written
        assert f"{kind}/{old_name} (deleted: no longer in the spec)" in written
    assert f"Deployment/{name_of(pool, 'router')}" in written

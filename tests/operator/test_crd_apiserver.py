"""The generated CRD on a real kube-apiserver: it is accepted (structural, CEL within
the cost budget), the samples are accepted and read back as the models parse them,
invalid pools are refused with messages that name the field, and every validation rule
refuses its sample with the message the operator gives."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import LocalCluster
from encoderpool_operator import api
from encoderpool_operator.conditions import set_condition
from tests.operator.api_cases import (
    BASE,
    INVALID,
    RULE_CASES,
    SAMPLES,
    TRANSITION_CASES,
    patched,
    refusal,
    rule_at,
)
from tests.operator.fixtures import CRD

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def crd(cluster: LocalCluster) -> LocalCluster:
    """The committed CRD, applied and Established (idempotent if others applied it too)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    cluster.wait_established(api.CRD_NAME)
    return cluster


def _create(cluster: LocalCluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(obj))


def _get(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "-n", namespace, "encoderpool", name, "-o", "json")
    return dict(json.loads(out))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_sample_is_accepted_and_reads_back_equal(
    crd: LocalCluster, namespace: str, path: Path
) -> None:
    obj = yaml.safe_load(path.read_text())
    _create(crd, namespace, obj)
    stored = api.EncoderPool.from_object(_get(crd, namespace, obj["metadata"]["name"]))
    # The server's defaults are the models' defaults: nothing changes on the way.
    assert stored.spec == api.EncoderPool.from_object(obj).spec


@pytest.mark.parametrize(("case", "patch", "field", "fix"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_pool_is_refused_naming_the_field(
    crd: LocalCluster, namespace: str, case: str, patch: dict[str, Any], field: str, fix: str
) -> None:
    with pytest.raises(RuntimeError) as info:
        _create(crd, namespace, patched(patch))
    message = str(info.value)
    assert field in message, message
    assert fix in message, message


def _names(out: str, path: str, message: str) -> bool:
    """The API server's refusal names ``path`` with ``message`` (a CEL rule's error)."""
    pattern = re.escape(path) + r': Invalid value: (?:"\w+": )?' + re.escape(message)
    return re.search(pattern, out) is not None


@pytest.mark.parametrize(("case", "patch", "path"), RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_rule_refuses_its_sample_with_the_operator_s_message(
    crd: LocalCluster, namespace: str, case: str, patch: dict[str, Any], path: str
) -> None:
    _, message = refusal(patch)  # what the operator says (test_api checks it is the rule's)
    rule = rule_at(path, message)
    with pytest.raises(RuntimeError) as info:
        _create(crd, namespace, patched(patch))
    out = str(info.value)
    if rule.cel is None:  # a list map's keys or a set's items: the server's own words
        assert re.search(re.escape(path) + r"\[[0-9]+\]: Duplicate value", out), out
    else:
        assert _names(out, path, message), out


def test_a_pool_with_producer_groups_reads_back_with_its_groups(
    crd: LocalCluster, namespace: str
) -> None:
    groups = [
        {"name": "images", "modalities": ["image"], "replicas": 3},
        {"name": "av", "modalities": ["video", "audio"], "resources": {"limits": {"cpu": "4"}}},
    ]
    _create(crd, namespace, patched({"spec": {"producerGroups": groups}}))
    stored = api.EncoderPool.from_object(_get(crd, namespace, "pool"))
    assert [(g.name, g.modalities, g.replicas) for g in stored.spec.producer_groups] == [
        ("images", ("image",), 3),
        ("av", ("video", "audio"), None),
    ]


@pytest.mark.parametrize(
    ("case", "before", "after", "path"), TRANSITION_CASES, ids=[c[0] for c in TRANSITION_CASES]
)
def test_transition_rule_refuses_its_update(
    crd: LocalCluster,
    namespace: str,
    case: str,
    before: dict[str, Any],
    after: dict[str, Any],
    path: str,
) -> None:
    _create(crd, namespace, patched({"spec": {"connector": {"sharedVolume": before}}}))
    merge = json.dumps({"spec": {"connector": {"sharedVolume": after}}})
    with pytest.raises(RuntimeError) as info:
        crd.kubectl("patch", "-n", namespace, "encoderpool", "pool", "--type=merge", "-p", merge)
    assert _names(str(info.value), path, rule_at(path).message), info.value
    # Growing the claim is fine.
    crd.kubectl(
        "patch", "-n", namespace, "encoderpool", "pool", "--type=merge",
        "-p", json.dumps({"spec": {"connector": {"sharedVolume": {"size": "5Gi"}}}}),
    )  # fmt: skip


def test_status_written_by_the_models_is_stored_and_printed(
    crd: LocalCluster, namespace: str
) -> None:
    _create(crd, namespace, BASE)
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    conditions = set_condition(
        (),
        api.ConditionUpdate(type=api.READY, status="False", reason="ProducersUnavailable"),
        now,
    )
    status = api.EncoderPoolStatus(
        observed_generation=1,
        conditions=conditions,
        transport="sharedVolume",
        producers=api.ReplicaStatus(desired=2, ready=1, available=1),
        consumers=api.ReplicaStatus(desired=1, ready=1, available=1),
        encoder_output_widths={"image": 128},
        router_endpoint="http://pool.ns.svc:8000",
        producer_groups=(api.ProducerGroupStatus(name="images", desired=2, ready=1),),
        router=api.ReplicaStatus(desired=1, ready=1, available=1),
        autoscaling=(
            api.AutoscalerStatus(
                role="consumer",
                engine="keda",
                name="pool-consumer",
                min_replicas=1,
                max_replicas=8,
                current_replicas=2,
                desired_replicas=3,
                active=True,
                reason="ScalerActive",
                last_scale_time=now,
            ),
        ),
    )
    body = json.dumps({"status": status.model_dump(mode="json", exclude_none=True)})
    crd.kubectl(
        "patch", "-n", namespace, "encoderpool", "pool", "--subresource=status",
        "--type=merge", "-p", body,
    )  # fmt: skip
    assert api.EncoderPool.from_object(_get(crd, namespace, "pool")).status == status
    row = crd.kubectl("get", "-n", namespace, "epool", "pool", "--no-headers").split()
    assert row[:6] == ["pool", "/models/tiny", "sharedVolume", "1/2", "1/1", "False"]
    # -o wide: each group's and the router's ready/desired, each autoscaler's scale.
    wide = crd.kubectl("get", "-n", namespace, "epool", "pool", "-o", "wide").splitlines()
    assert wide[0].split()[-3:] == ["GROUPS", "ROUTER", "AUTOSCALING"]
    assert re.split(r"\s{2,}", wide[1])[-3:] == ["images 1/2", "1/1", "consumer 2/3 (1-8)"]
    # Conditions are a map keyed by type: a second Ready is refused.
    twice = json.dumps(
        {"status": {"conditions": [c.model_dump(mode="json") for c in conditions * 2]}}
    )
    with pytest.raises(RuntimeError, match=r"status\.conditions\[1\]: Duplicate value"):
        crd.kubectl(
            "patch", "-n", namespace, "encoderpool", "pool", "--subresource=status",
            "--type=merge", "-p", twice,
        )  # fmt: skip


def test_explain_documents_the_fields(crd: LocalCluster) -> None:
    out = crd.kubectl("explain", "encoderpool.spec.connector.sharedVolume")
    assert "existingClaim" in out
    assert "ReadWriteMany" in out

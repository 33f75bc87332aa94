"""Objects the operator does not own, on the real control plane: others' objects with our
labels (huge, forged, unreadable as reports) cost the cache a stub at most and keep no
pool from turning Ready; a Service the router would follow that is someone else's keeps
the router away."""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from encoderpool_contracts import CONFIGMAP_KEY, CONFIGMAP_PREFIX
from encoderpool_operator.api import API_VERSION, KIND, EncoderPool
from encoderpool_operator.cache import MAX_ENTRY_BYTES
from encoderpool_operator.naming import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    MANAGED_BY,
    REPORT_COMPONENT,
)
from encoderpool_operator.render.widths import report_key, width_report_configmap
from tests.operator.fixtures import condition, get_json, report_for, sample_pool
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster


def _apply(cluster: LocalCluster, namespace: str, *objs: dict[str, Any]) -> None:
    items = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
    # create, not apply: apply keeps a copy of each object in an annotation (256 KiB at most)
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(items))


def _claim(pool: str, uid: str) -> dict[str, Any]:
    """Metadata that claims ``pool`` as controller: our labels and an EncoderPool owner."""
    return {
        "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_POOL: pool},
        "ownerReferences": [
            {"apiVersion": API_VERSION, "kind": KIND, "name": pool, "uid": uid, "controller": True}
        ],
    }


def seed_report(cluster: LocalCluster, namespace: str, pool: dict[str, Any]) -> None:
    """The pool's report, stored as the operator stores it, without owners (no width Job)."""
    meta = {"name": pool["metadata"]["name"], "namespace": namespace, "uid": "seed"}
    parsed = EncoderPool.from_object({**pool, "metadata": meta})
    report = report_for(pool)
    key = report_key(parsed)
    cm = width_report_configmap(parsed, key, report.fingerprint, report.to_configmap_data())
    del cm["metadata"]["ownerReferences"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(cm))


def _wait_ready(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pool = get_json(cluster, "encoderpool", name, "-n", namespace)
        cond = condition(pool, "Ready")
        ok = cond and cond["status"] == "True"
        gen = pool["metadata"]["generation"]
        return pool if ok and pool["status"].get("observedGeneration") == gen else None

    return dict(wait_until(f"EncoderPool {name} Ready", ready, timeout=120))


def test_others_objects_with_our_labels_cost_a_stub_and_block_no_pool(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    big = "x" * (MAX_ENTRY_BYTES + 4096)
    report_labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_COMPONENT: REPORT_COMPONENT,
    }
    # Before the pool: ConfigMaps with our labels (never kept: not named like a report), a
    # report-named one over the bound and one that is no report at all.
    junk = [
        {"apiVersion": "v1", "kind": "ConfigMap", "data": {"x": "y" * 500_000},
         "metadata": {"name": f"junk-{i}", **_claim("tiny", "forged")}}
        for i in range(4)
    ]  # fmt: skip
    huge_report = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{CONFIGMAP_PREFIX}huge", "labels": report_labels},
        "data": {CONFIGMAP_KEY: big},
    }
    garbled_report = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{CONFIGMAP_PREFIX}garbled", "labels": report_labels},
        "data": {CONFIGMAP_KEY: "{not json"},
    }
    _apply(cluster, namespace, *junk, huge_report, garbled_report)

    pool = sample_pool()
    seed_report(cluster, namespace, pool)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))
    got = _wait_ready(cluster, namespace, "tiny")
    uid = got["metadata"]["uid"]

    # Now claims with the pool's real uid (the garbage collector keeps them): one over the
    # bound, under a name the pool does not use, and one under a child's name pattern.
    env = [{"name": "BIG", "value": big}]
    forged = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "tiny-extra", **_claim("tiny", uid)},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"forged": "yes"}},
            "template": {
                "metadata": {"labels": {"forged": "yes"}},
                "spec": {"containers": [{"name": "c", "image": "x", "env": env}]},
            },
        },
    }
    _apply(cluster, namespace, forged)
    before = get_json(cluster, "deployment", "tiny-extra", "-n", namespace)
    # A change to the pool still converges: its pass reads its own children, not the forgery.
    cluster.kubectl(
        "patch", "encoderpool", "tiny", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"consumer": {"replicas": 2}}}),
    )  # fmt: skip
    _wait_ready(cluster, namespace, "tiny")
    consumers = get_json(cluster, "deployment", "tiny-consumer", "-n", namespace)
    assert consumers["spec"]["replicas"] == 2
    # Two resyncs later the forgery is untouched and each skipped object was logged once.
    marked = operator.log_text().count("resync: 1 pools marked")
    wait_until(
        "two resyncs",
        lambda: operator.log_text().count("resync: 1 pools marked") >= marked + 2,
        timeout=30,
    )
    touched = [
        (e["verb"], e["objectRef"].get("resource"))
        for e in cluster.audit_events(namespace=namespace)
        if e["objectRef"].get("name") in ("tiny-extra", *(f"junk-{i}" for i in range(4)))
    ]
    assert touched == []  # the operator never wrote any of them
    after = get_json(cluster, "deployment", "tiny-extra", "-n", namespace)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    log = operator.log_text()
    assert log.count(f"Deployment {namespace}/tiny-extra is ") == 1, operator.log_tail(80)
    assert log.count(f"ConfigMap {namespace}/{CONFIGMAP_PREFIX}huge is ") == 1
    assert "junk-" not in log  # not named like a report: never even looked at
    assert "Traceback" not in log


def test_no_router_while_a_service_it_would_follow_is_someone_else_s(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "tiny-consumer"},
        "spec": {"ports": [{"name": "http", "port": 8000}]},
    }
    _apply(cluster, namespace, theirs)
    pool = sample_pool()
    seed_report(cluster, namespace, pool)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))

    def blocked() -> dict[str, Any] | None:
        got = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
        cond = condition(got, "RouterAvailable")
        return cond if cond and cond["reason"] == "ServiceNotOwned" else None

    cond = wait_until("RouterAvailable=False/ServiceNotOwned", blocked, timeout=60)
    assert cond["status"] == "False"
    assert f"Service {namespace}/tiny-consumer is not controlled by this pool" in cond["message"]
    got = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
    assert condition(got, "ChildrenOwned")["reason"] == "NameConflict"  # type: ignore[index]
    # The producers are deployed; the router never is, and their Service is left alone.
    get_json(cluster, "deployment", "tiny-producer", "-n", namespace)
    names = cluster.kubectl("get", "deployments", "-n", namespace, "-o", "name")
    assert "tiny-router" not in names
    svc = get_json(cluster, "service", "tiny-consumer", "-n", namespace)
    assert not svc["metadata"].get("ownerReferences")
    # Gone: the pool makes its own Service, then the router, and turns Ready.
    cluster.kubectl("delete", "service", "tiny-consumer", "-n", namespace)
    _wait_ready(cluster, namespace, "tiny")
    get_json(cluster, "deployment", "tiny-router", "-n", namespace)

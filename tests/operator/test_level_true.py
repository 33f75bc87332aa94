"""Level-true reconcile on the real control plane: every spec change reaches the cluster,
nothing is left behind, nothing is taken over, and a pool deletes without the operator."""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from encoderpool_operator.api import MAX_NAME_LENGTH
from encoderpool_operator.naming import CONSUMER, PRODUCER, ROUTER
from tests.operator.fixtures import (
    apply_pool,
    condition,
    get_json,
    ready_pool,
    ready_sample_pool,
    report_for,
    running_width_pods,
    sample_pool,
    seed_report,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster

ROUTER_CHILDREN = [
    ("deployment", "tiny-router"),
    ("service", "tiny"),
    ("serviceaccount", "tiny-router"),
    ("role", "tiny-router"),
    ("rolebinding", "tiny-router"),
]


def patch_pool(cluster: LocalCluster, namespace: str, patch: Any, kind: str = "merge") -> None:
    cluster.kubectl(
        "patch", "encoderpool", "tiny", "-n", namespace, f"--type={kind}", "-p", json.dumps(patch)
    )


def exists(cluster: LocalCluster, namespace: str, kind: str, name: str) -> bool:
    out = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "name", "--ignore-not-found")
    return bool(out.strip())


def pod_spec(cluster: LocalCluster, namespace: str, role: str) -> dict[str, Any]:
    dep = get_json(cluster, "deployment", f"tiny-{role}", "-n", namespace)
    return dict(dep["spec"]["template"]["spec"])


def test_a_field_removed_from_the_spec_is_removed_from_the_child(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool = sample_pool()
    pool["spec"]["consumer"]["tolerations"] = [{"key": "lm", "operator": "Exists"}]
    pool["spec"]["consumer"]["podTemplate"] = {"spec": {"terminationGracePeriodSeconds": 45}}
    pool["spec"]["model"]["env"] = [{"name": "TEAM", "value": "vision"}]
    seed_report(cluster, namespace, pool)
    apply_pool(cluster, namespace, pool)
    ready_pool(cluster, namespace)
    spec = pod_spec(cluster, namespace, "consumer")
    assert spec["tolerations"] == [{"key": "lm", "operator": "Exists"}]
    assert spec["terminationGracePeriodSeconds"] == 45
    # Remove all three, as a GitOps tool does when the lines go from Git.
    patch_pool(
        cluster,
        namespace,
        [
            {"op": "remove", "path": "/spec/consumer/tolerations"},
            {"op": "remove", "path": "/spec/consumer/podTemplate"},
            {"op": "remove", "path": "/spec/model/env"},
        ],
        kind="json",
    )

    def removed() -> bool:
        spec = pod_spec(cluster, namespace, "consumer")
        env = {e["name"] for e in spec["containers"][0].get("env", [])}
        return (
            "tolerations" not in spec
            and spec.get("terminationGracePeriodSeconds") == 30  # the API server's default
            and "TEAM" not in env
        )

    wait_until("tolerations, the grace period and env TEAM gone from the consumer", removed)
    assert "TEAM" not in json.dumps(pod_spec(cluster, namespace, "producer"))
    ready_pool(cluster, namespace)


def test_a_disabled_router_is_pruned_and_comes_back(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    ready_sample_pool(cluster, namespace)
    assert all(exists(cluster, namespace, k, n) for k, n in ROUTER_CHILDREN)
    patch_pool(cluster, namespace, {"spec": {"router": {"enabled": False}}})
    wait_until(
        "the router, its Service and RBAC deleted",
        lambda: not any(exists(cluster, namespace, k, n) for k, n in ROUTER_CHILDREN),
    )
    got = ready_pool(cluster, namespace)
    assert "routerEndpoint" not in got["status"]  # type: ignore[operator]
    assert exists(cluster, namespace, "deployment", "tiny-consumer")
    patch_pool(cluster, namespace, {"spec": {"router": {"enabled": True}}})
    wait_until(
        "the router back",
        lambda: all(exists(cluster, namespace, k, n) for k, n in ROUTER_CHILDREN),
    )


def test_network_policies_follow_the_spec(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    ready_sample_pool(cluster, namespace)
    names = cluster.kubectl("get", "networkpolicy", "-n", namespace, "-o", "name").split()
    assert sorted(names) == [
        f"networkpolicy.networking.k8s.io/tiny-{c}"
        for c in ("consumer", "producer", "router", "width-job")
    ]
    patch_pool(cluster, namespace, {"spec": {"networkPolicy": {"enabled": False}}})
    wait_until(
        "the NetworkPolicies deleted",
        lambda: not cluster.kubectl("get", "networkpolicy", "-n", namespace, "-o", "name").strip(),
    )


def test_producer_groups_replace_the_producer_and_are_counted_each(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    ready_sample_pool(cluster, namespace)
    groups = [
        {"name": "images", "modalities": ["image"], "replicas": 2},
        {"name": "audio", "modalities": ["audio"]},
    ]
    patch_pool(cluster, namespace, {"spec": {"producerGroups": groups}})
    group_children = [
        (kind, f"tiny-producer-{g}")
        for kind in ("deployment", "service", "networkpolicy")
        for g in ("images", "audio")
    ]

    def grouped() -> dict[str, Any] | None:
        got = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
        status = got.get("status", {})
        counted = [(g["name"], g["summary"]) for g in status.get("producerGroups", [])]
        ready = condition(got, "Ready")
        done = (
            counted == [("images", "2/2"), ("audio", "1/1")]
            and status.get("observedGeneration") == got["metadata"]["generation"]
            and ready is not None
            and ready["status"] == "True"
        )
        return dict(got) if done else None

    got = wait_until("both groups Ready and counted", grouped)
    assert got["status"]["producers"]["summary"] == "3/3"
    assert all(exists(cluster, namespace, k, n) for k, n in group_children)
    wait_until(
        "the single producer deleted",
        lambda: (
            not any(
                exists(cluster, namespace, k, "tiny-producer")
                for k in ("deployment", "service", "networkpolicy")
            )
        ),
    )
    args = pod_spec(cluster, namespace, "router")["containers"][0]["args"]
    services = json.loads(args[args.index("--producer-services-by-modality") + 1])
    assert services == {"image": "tiny-producer-images", "audio": "tiny-producer-audio"}

    patch_pool(cluster, namespace, {"spec": {"producerGroups": None}})
    wait_until(
        "the groups deleted and the single producer back",
        lambda: (
            not any(exists(cluster, namespace, k, n) for k, n in group_children)
            and exists(cluster, namespace, "deployment", "tiny-producer")
        ),
    )
    wait_until(
        "status without groups",
        lambda: (
            "producerGroups"
            not in get_json(cluster, "encoderpool", "tiny", "-n", namespace)["status"]
        ),
    )


def test_a_transport_switch_leaves_nothing_of_the_old_one(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    ready_sample_pool(cluster, namespace)
    assert exists(cluster, namespace, "pvc", "tiny-cache")
    patch_pool(
        cluster,
        namespace,
        {"spec": {"connector": {"sharedVolume": None, "rdma": {"ucxTransports": "tcp,sm,self"}}}},
    )

    def switched() -> bool:
        got = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
        return bool(got["status"].get("transport") == "rdma")

    wait_until("status.transport rdma", switched)

    # The PVC may linger while pods still mount it (pvc-protection), but it is deleted.
    def pvc_deleted() -> bool:
        out = cluster.kubectl(
            "get", "pvc", "tiny-cache", "-n", namespace, "-o", "json", "--ignore-not-found"
        )
        return not out.strip() or "deletionTimestamp" in json.loads(out)["metadata"]

    wait_until("the cache PVC deleted", pvc_deleted)
    ready_pool(cluster, namespace)
    for role in ("producer", "consumer"):
        rendered = json.dumps(pod_spec(cluster, namespace, role))
        assert "ec-cache" not in rendered
        assert "EncoderPoolSharedVolumeConnector" not in rendered
        assert "EncoderPoolNixlConnector" in rendered
    args = pod_spec(cluster, namespace, "router")["containers"][0]["args"]
    assert "--reuse-encoded-s" not in args


def test_a_foreign_object_is_never_touched_and_is_named(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "tiny-consumer", "labels": {"team": "other"}},
        "spec": {"ports": [{"port": 9999}], "selector": {"app": "theirs"}},
    }
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(theirs))
    before = get_json(cluster, "service", "tiny-consumer", "-n", namespace)
    pool = sample_pool()
    seed_report(cluster, namespace, pool)
    apply_pool(cluster, namespace, pool)

    def conflict() -> dict[str, Any] | None:
        cond = condition(get_json(cluster, "encoderpool", "tiny", "-n", namespace), "Ready")
        return cond if cond and cond["reason"] == "NameConflict" else None

    cond = wait_until("Ready=False/NameConflict", conflict)
    assert cond["status"] == "False"
    assert f"Service {namespace}/tiny-consumer" in cond["message"]
    assert "delete or rename it" in cond["message"]
    assert exists(cluster, namespace, "deployment", "tiny-consumer")  # the rest is reconciled
    after = get_json(cluster, "service", "tiny-consumer", "-n", namespace)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"]
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "reason=NameConflict", "-o", "json"
    )
    assert {e["type"] for e in json.loads(events)["items"]} == {"Warning"}
    # Its owner removes it: the pool takes the name and becomes Ready.
    cluster.kubectl("delete", "service", "tiny-consumer", "-n", namespace)
    ready_pool(cluster, namespace)
    svc = get_json(cluster, "service", "tiny-consumer", "-n", namespace)
    assert svc["metadata"]["ownerReferences"][0]["name"] == "tiny"


def test_the_longest_name_measures_and_turns_ready(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    name = "p" * (MAX_NAME_LENGTH - 4) + "-max"
    pool = sample_pool(name=name)
    apply_pool(cluster, namespace, pool)
    pod = wait_until("the width Job's pod", lambda: running_width_pods(cluster, namespace))[0]
    job_name = pod["metadata"]["labels"]["batch.kubernetes.io/job-name"]
    assert len(job_name) <= 63
    message = report_for(pool).to_termination_message()
    cluster.finish_pod(namespace, pod["metadata"]["name"], 0, message)
    ready_pool(cluster, namespace, name)
    for role in (PRODUCER, CONSUMER, ROUTER):
        assert exists(cluster, namespace, "deployment", f"{name}-{role}")


def test_a_pool_deletes_while_the_operator_is_stopped(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    got = ready_sample_pool(cluster, namespace)
    assert not got["metadata"].get("finalizers")  # type: ignore[attr-defined]
    operator.stop()
    cluster.kubectl("delete", "encoderpool", "tiny", "-n", namespace, "--timeout=30s")
    wait_until(
        "the children garbage-collected",
        lambda: not exists(cluster, namespace, "deployment", "tiny-consumer"),
    )

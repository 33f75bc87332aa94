"""helm install / upgrade / uninstall of the chart on the local control plane.

Helm's CRD rules, as docs/install.md states them: the chart's crds/ are created
on the first install only, never upgraded, never deleted; so an uninstall
removes the operator but leaves the CRDs and every EncoderPool in place.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from e2e.cluster import LocalCluster
from tests.chart.fixtures import CHART, helm
from tests.operator.fixtures import get_json, sample_pool

pytestmark = pytest.mark.cluster


@pytest.fixture
def release(cluster: LocalCluster, namespace: str) -> Iterator[str]:
    name = f"ep{uuid.uuid4().hex[:6]}"
    yield name
    helm("uninstall", name, "-n", namespace, check=False, kubeconfig=cluster.kubeconfig)


def _names(cluster: LocalCluster, namespace: str, release: str) -> set[str]:
    """kind/name of everything the release labelled, namespaced and cluster-scoped."""
    selector = f"app.kubernetes.io/instance={release}"
    out = cluster.kubectl(
        "get", "deployment,serviceaccount,role,rolebinding,service,poddisruptionbudget",
        "-n", namespace,
        "-l", selector, "-o", "name",
    ) + cluster.kubectl(
        "get", "clusterrole,clusterrolebinding", "-l", selector, "-o", "name"
    )  # fmt: skip
    return set(out.split())


def test_install_upgrade_uninstall(
    cluster: LocalCluster, crd: str, namespace: str, release: str
) -> None:
    kube = cluster.kubeconfig
    full = f"{release}-encoderpool-operator"
    installed = helm("install", release, str(CHART), "-n", namespace, kubeconfig=kube).stdout
    assert "Next: apply an EncoderPool" in installed  # NOTES.txt
    assert "Prometheus /metrics on port 8081" in installed
    assert _names(cluster, namespace, release) == {
        f"deployment.apps/{full}",
        f"serviceaccount/{full}",
        f"clusterrole.rbac.authorization.k8s.io/{full}",
        f"clusterrolebinding.rbac.authorization.k8s.io/{full}",
        f"role.rbac.authorization.k8s.io/{full}-leader-election",
        f"rolebinding.rbac.authorization.k8s.io/{full}-leader-election",
        f"service/{full}-metrics",
        f"poddisruptionbudget.policy/{full}",
    }
    cluster.wait_established(crd)
    pool = sample_pool()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))

    # Upgrade: new values roll the Deployment; a scope change swaps the RBAC kinds; one
    # replica drops the PodDisruptionBudget, metrics off drops the Service.
    helm(
        "upgrade", release, str(CHART), "-n", namespace,
        "--set", "scope=namespace,replicaCount=1,operator.resyncSeconds=120,metrics.enabled=false",
        kubeconfig=kube,
    )  # fmt: skip
    assert _names(cluster, namespace, release) == {
        f"deployment.apps/{full}",
        f"serviceaccount/{full}",
        f"role.rbac.authorization.k8s.io/{full}",
        f"rolebinding.rbac.authorization.k8s.io/{full}",
        f"role.rbac.authorization.k8s.io/{full}-leader-election",
        f"rolebinding.rbac.authorization.k8s.io/{full}-leader-election",
    }
    deployment = get_json(cluster, "deployment", full, "-n", namespace)
    assert deployment["spec"]["replicas"] == 1
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert f"--namespace={namespace}" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ENCODERPOOL_RESYNC_SECONDS"] == "120"
    assert env["ENCODERPOOL_METRICS_PORT"] == "0"
    assert [p["name"] for p in container["ports"]] == ["health"]
    history = json.loads(
        helm("history", release, "-n", namespace, "-o", "json", kubeconfig=kube).stdout
    )
    assert [h["revision"] for h in history] == [1, 2]
    assert history[-1]["status"] == "deployed"

    # A bad value fails the upgrade before anything changes.
    bad = helm(
        "upgrade", release, str(CHART), "-n", namespace, "--set", "scope=everywhere",
        check=False, kubeconfig=kube,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "'/scope': value must be one of" in bad.stderr
    assert (
        get_json(cluster, "deployment", full, "-n", namespace)["metadata"]["generation"]
        == (deployment["metadata"]["generation"])
    )

    # Uninstall: the operator goes; the CRDs (Helm never deletes crds/) and the pool stay.
    helm("uninstall", release, "-n", namespace, "--wait", kubeconfig=kube)
    assert _names(cluster, namespace, release) == set()
    cluster.kubectl("get", f"crd/{crd}")
    assert get_json(cluster, "encoderpool", "tiny", "-n", namespace)["metadata"]["name"] == "tiny"

"""The chart's RBAC is exactly enough, proven on the local control plane.

`helm install` the chart (CRDs, ServiceAccount, RBAC; kwok
marks its Deployment's pods Running, nothing runs in them), then run two
operator replicas as local processes with the chart's own command line and
env, authenticated as the chart's ServiceAccount (a TokenRequest token, not
admin). They drive a pool through its life: width Job, Ready, scale, model
change (stale width Job deleted), failover to the standby, deletion.
Then the audit log must show no request of that ServiceAccount denied by RBAC,
and every verb the chart grants must have been used (rbac.DELEGATED
excepted).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import LocalCluster
from e2e.cluster.kubelet import service_account_kubeconfig
from e2e.kind.monitoring import scaled_object_crd
from encoderpool_operator import rbac
from tests.chart.fixtures import CHART, documents, helm
from tests.operator.fixtures import (
    WIDTH_JOB_PODS,
    condition,
    get_json,
    report_for,
    running_width_pods,
    sample_pool,
    seed_report,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
DECISION, REASON = "authorization.k8s.io/decision", "authorization.k8s.io/reason"  # audit
# The operator's log lines when it takes the Lease, or stops leading (controller/leader.py).
LEADS, STOPPED = " leads: acquired the lease", " stopped leading"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    """One operator pod of the chart's Deployment, played by a local process."""

    pod_id: str
    proc: subprocess.Popen[bytes]
    log: Path
    health_port: int
    metrics_port: int

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_replica(
    container: dict[str, Any], pod_id: str, namespace: str, kubeconfig: Path, workdir: Path
) -> Replica:
    """The container's command, args and env, locally: only the listen addresses differ."""
    port, metrics_port = _free_port(), _free_port()
    assert container["command"] == ["kopf"]
    args = [
        f"--liveness=http://127.0.0.1:{port}/healthz" if a.startswith("--liveness=") else a
        for a in container["args"]
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
    # The downward API's two: the pod's name and namespace (where the Lease lives).
    downward = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert downward == {
        "POD_NAME": "metadata.name",
        "ENCODERPOOL_LEASE_NAMESPACE": "metadata.namespace",
    }
    # The chart serves metrics on the container port it names so (the Service's target).
    ports = {p["name"]: str(p["containerPort"]) for p in container["ports"]}
    assert env["ENCODERPOOL_METRICS_PORT"] == ports["metrics"]
    env |= {
        "POD_NAME": pod_id,
        "ENCODERPOOL_LEASE_NAMESPACE": namespace,
        "KUBECONFIG": str(kubeconfig),
        "ENCODERPOOL_KUBECONFIG": str(kubeconfig),
        "PYTHONPATH": os.pathsep.join(
            str(REPO / p) for p in ("contracts", "operator", "connector", ".")
        ),
        "PYTHONUNBUFFERED": "1",
        # Two replicas on one machine: each its own metrics port, on loopback.
        "ENCODERPOOL_METRICS_PORT": str(metrics_port),
        "ENCODERPOOL_METRICS_ADDRESS": "127.0.0.1",
    }
    log = workdir / f"{pod_id}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kopf", *args, "--verbose"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Replica(pod_id, proc, log, port, metrics_port)


def said(replica: Replica, line: str) -> bool:
    """The replica logged ``line``."""
    return line in replica.text()


def working(replica: Replica) -> bool:
    """The replica holds the Lease (it says so in its log when that starts or stops)."""
    text = replica.text()
    return text.rfind(LEADS) > text.rfind(STOPPED)


def healthy(replica: Replica) -> bool:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{replica.health_port}/healthz", timeout=2
        ) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def scrape(replica: Replica) -> dict[str, float]:
    """The replica's /metrics: each sample as 'name{k="v",...}' -> value."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5
    ) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def reconciles(samples: dict[str, float]) -> float:
    return sum(
        v for k, v in samples.items() if k.startswith("encoderpool_operator_reconciles_total")
    )


def pool_state(cluster: LocalCluster, ns: str) -> dict[str, Any]:
    return dict(get_json(cluster, "encoderpool", "tiny", "-n", ns))


def ready_with(cluster: LocalCluster, ns: str, **status: Any) -> Any:
    def ok() -> Any:
        pool = pool_state(cluster, ns)
        cond = condition(pool, "Ready")
        matches = all(
            pool.get("status", {}).get(k) == v
            or pool.get("status", {}).get(k, {}).get("summary") == v
            for k, v in status.items()
        )
        return pool if cond and cond["status"] == "True" and matches else None

    return wait_until(f"pool Ready with {status}", ok)


def finish_width_pod(cluster: LocalCluster, ns: str, pool: dict[str, Any], width: int) -> None:
    """Play the width Job's pod: exit 0 leaving its report as the termination message."""
    pods = wait_until("the width Job's pod", lambda: running_width_pods(cluster, ns))
    message = report_for(pool, width=width).to_termination_message()
    cluster.finish_pod(ns, pods[0]["metadata"]["name"], 0, message)


def used_permissions(events: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of each request; a patch that created (201) used create too.

    Server-side apply is a PATCH that creates a missing object, and the API
    server authorizes that as create as well as patch.
    """
    used = set()
    for e in events:
        ref = e.get("objectRef")
        if not ref or not ref.get("resource"):
            continue  # discovery (/api, /apis): open to every authenticated user
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, e["verb"]))
        if e["verb"] == "patch" and e.get("responseStatus", {}).get("code") == 201:
            used.add((ref.get("apiGroup", ""), resource, "create"))
    return used


def forbidden_requests(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Requests RBAC denied. (A 403 that authorization allowed is admission's: e.g. a write
    into a namespace being deleted, which a cluster-wide operator meets when an earlier
    test's namespace still holds a pool.)"""
    return [
        (e["verb"], e.get("requestURI", ""), e.get("annotations", {}).get(REASON, ""))
        for e in events
        if e.get("annotations", {}).get(DECISION) != "allow"
    ]


@pytest.fixture
def release(cluster: LocalCluster, namespace: str) -> Iterator[str]:
    name = f"ep{uuid.uuid4().hex[:6]}"
    yield name
    helm("uninstall", name, "-n", namespace, "--wait", check=False, kubeconfig=cluster.kubeconfig)


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_the_chart_grants_exactly_what_the_operator_uses(
    cluster: LocalCluster, crd: str, namespace: str, release: str, scope: str, tmp_path: Path
) -> None:
    # KEDA's ScaledObject kind, as KEDA installs it (no KEDA runs: the operator only applies
    # and prunes ScaledObjects); the operator is told where Prometheus would be.
    cluster.kubectl("apply", "--server-side", "-f", str(scaled_object_crd()))
    helm(
        "install", release, str(CHART), "-n", namespace,
        "--set", f"scope={scope},operator.resyncSeconds=5,operator.widthRetrySeconds=2",
        "--set", "autoscaling.prometheus.address=http://prometheus.invalid:9090",
        kubeconfig=cluster.kubeconfig,
    )  # fmt: skip
    manifest = helm("get", "manifest", release, "-n", namespace, kubeconfig=cluster.kubeconfig)
    deployment = next(d for d in documents(manifest.stdout) if d["kind"] == "Deployment")
    pod_spec = deployment["spec"]["template"]["spec"]
    sa = pod_spec["serviceAccountName"]
    user = f"system:serviceaccount:{namespace}:{sa}"
    kubeconfig = service_account_kubeconfig(cluster, namespace, sa, tmp_path / "sa.kubeconfig")

    # Cluster-wide: the pool lives in another namespace than the operator.
    pool_ns = namespace
    if scope == "cluster":
        pool_ns = f"{namespace}-pools"
        cluster.kubectl("create", "namespace", pool_ns)
    replicas = [
        start_replica(pod_spec["containers"][0], f"{release}-{i}", namespace, kubeconfig, tmp_path)
        for i in "ab"
    ]
    try:
        for r in replicas:
            wait_until(f"{r.pod_id} /healthz", functools.partial(healthy, r), timeout=60)
        # Leader election: one replica holds the release's Lease (in the release namespace).
        active = wait_until("a replica to lead", lambda: next(filter(working, replicas), None))
        standby = next(r for r in replicas if r is not active)
        lease = get_json(cluster, "lease", f"{release}-encoderpool-operator", "-n", namespace)
        assert lease["spec"]["holderIdentity"].startswith(f"{active.pod_id}_")
        assert not working(standby)

        # 1. A new model: width Job; its pod's report (read by the operator, stored), then Ready.
        pool = sample_pool()
        cluster.kubectl("apply", "-n", pool_ns, "-f", "-", input=json.dumps(pool))
        finish_width_pod(cluster, pool_ns, pool, width=128)
        ready_with(cluster, pool_ns, encoderOutputWidths={"image": 128}, consumers="1/1")
        # Both replicas serve /metrics; only the active one reconciled, and counts the pool.
        wait_until(
            "the active replica's metrics to count the pool Ready",
            lambda: scrape(active).get('encoderpool_operator_pools{ready="True"}') == 1.0,
        )
        assert reconciles(scrape(active)) > 0
        assert 'encoderpool_operator_pools{ready="True"}' in scrape(standby)  # it serves /metrics
        assert reconciles(scrape(standby)) == 0  # it watched; the Lease holder reconciled
        # 2. Scale.
        cluster.kubectl(
            "patch", "encoderpool", "tiny", "-n", pool_ns, "--type=merge",
            "-p", json.dumps({"spec": {"consumer": {"replicas": 2}}}),
        )  # fmt: skip
        ready_with(cluster, pool_ns, consumers="2/2")
        # 2b. Autoscaling producers: a ScaledObject, then pruned when autoscaling is off.
        cluster.kubectl(
            "patch", "encoderpool", "tiny", "-n", pool_ns, "--type=merge",
            "-p", json.dumps({"spec": {"producer": {"autoscaling": {"maxReplicas": 2}}}}),
        )  # fmt: skip
        wait_until(
            "the producers' ScaledObject",
            lambda: (
                cluster.kubectl(
                    "get", "scaledobjects", "-n", pool_ns, "--ignore-not-found", "-o", "name"
                ).strip()
                == "scaledobject.keda.sh/tiny-producer"
            ),
        )
        cluster.kubectl(
            "patch", "encoderpool", "tiny", "-n", pool_ns, "--type=merge",
            "-p", json.dumps({"spec": {"producer": {"autoscaling": None}}}),
        )  # fmt: skip
        wait_until(
            "the ScaledObject pruned",
            lambda: (
                not cluster.kubectl(
                    "get", "scaledobjects", "-n", pool_ns, "--ignore-not-found", "-o", "name"
                ).strip()
            ),
        )
        # 3. Failover: the active replica goes (SIGTERM: it releases the Lease), the standby
        # takes over and keeps reconciling.
        active.stop()
        wait_until("the standby to take over", lambda: working(standby))
        # 4. A model whose report exists: adopt it, roll, delete the old width Job's objects.
        other = sample_pool(model="/models/other")
        seed_report(cluster, pool_ns, other, report_for(other, width=256))
        cluster.kubectl(
            "patch", "encoderpool", "tiny", "-n", pool_ns, "--type=merge",
            "-p", json.dumps({"spec": {"model": {"name": "/models/other"}}}),
        )  # fmt: skip
        ready_with(cluster, pool_ns, encoderOutputWidths={"image": 256})
        wait_until(
            "the stale width Job deleted",
            lambda: get_json(cluster, "jobs", "-n", pool_ns, "-l", WIDTH_JOB_PODS)["items"] == [],
        )
        # 5. The router and NetworkPolicies off, the transport switched: the operator
        # prunes what the spec no longer names (the router, its Service and RBAC, the
        # policies, the cache PVC).
        cluster.kubectl(
            "patch", "encoderpool", "tiny", "-n", pool_ns, "--type=merge", "-p",
            json.dumps({"spec": {"router": {"enabled": False},
                                 "networkPolicy": {"enabled": False},
                                 "connector": {"sharedVolume": None,
                                               "rdma": {"ucxTransports": "tcp,sm,self"}}}}),
        )  # fmt: skip
        wait_until(
            "status.transport rdma",
            lambda: pool_state(cluster, pool_ns).get("status", {}).get("transport") == "rdma",
        )
        ready_with(cluster, pool_ns)
        wait_until(
            "the router and the cache PVC pruned",
            lambda: not cluster.kubectl(
                "get", "deployment/tiny-router", "pvc/tiny-cache", "-n", pool_ns,
                "--ignore-not-found", "-o", "name",
            ).strip(),
        )  # fmt: skip
        # 6. Delete: owner references clean up; the operator must not stand in the way.
        cluster.kubectl("delete", "encoderpool", "tiny", "-n", pool_ns, "--timeout=60s")
        time.sleep(2)  # the last watch events reach the standby-turned-active replica
    except BaseException:
        for r in replicas:
            print(f"===== {r.pod_id} =====\n{r.text()[-6000:]}")
        denied = forbidden_requests(cluster.audit_events(user=user, writes_only=False))
        print("denied by RBAC:", denied)
        raise
    finally:
        for r in replicas:
            r.stop()
        if scope == "cluster":
            cluster.kubectl("delete", "namespace", pool_ns, "--wait=false", check=False)

    events = cluster.audit_events(user=user, writes_only=False)
    assert forbidden_requests(events) == []
    used = used_permissions(events)
    granted = rbac.granted(scope)  # type: ignore[arg-type]
    assert used <= granted  # (no 403 says as much; this names what would be missing)
    unused = granted - rbac.DELEGATED - used
    assert unused == set(), "granted but never used"
    if scope == "namespace":  # nothing outside its own namespace, nothing cluster-scoped
        assert {e["objectRef"].get("namespace") for e in events if e.get("objectRef")} == {
            namespace
        }


def test_a_standby_runs_no_passes_until_the_lease_is_released(
    cluster: LocalCluster, crd: str, namespace: str, release: str, tmp_path: Path
) -> None:
    """Every replica watches, but only the Lease holder's resync and workers run passes;
    the other's run none until the holder goes (a clean stop releases the Lease)."""
    helm(
        "install", release, str(CHART), "-n", namespace,
        "--set", "scope=namespace,operator.resyncSeconds=5,operator.widthRetrySeconds=2",
        kubeconfig=cluster.kubeconfig,
    )  # fmt: skip
    manifest = helm("get", "manifest", release, "-n", namespace, kubeconfig=cluster.kubeconfig)
    deployment = next(d for d in documents(manifest.stdout) if d["kind"] == "Deployment")
    pod_spec = deployment["spec"]["template"]["spec"]
    kubeconfig = service_account_kubeconfig(
        cluster, namespace, pod_spec["serviceAccountName"], tmp_path / "sa.kubeconfig"
    )
    container = pod_spec["containers"][0]
    old = start_replica(container, f"{release}-old", namespace, kubeconfig, tmp_path)
    replicas = [old]
    try:
        wait_until("the first replica to lead", lambda: working(old), timeout=60)
        pool = sample_pool()
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))
        finish_width_pod(cluster, namespace, pool, width=128)
        ready_with(cluster, namespace, consumers="1/1")
        assert reconciles(scrape(old)) > 0

        new = start_replica(container, f"{release}-new", namespace, kubeconfig, tmp_path)
        replicas.append(new)
        wait_until("the new replica's /healthz", functools.partial(healthy, new), timeout=60)
        cluster.kubectl(
            "patch", "encoderpool", "tiny", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"consumer": {"replicas": 2}}}),
        )  # fmt: skip
        ready_with(cluster, namespace, consumers="2/2")
        time.sleep(12)  # two resyncs (5 s): the new replica's resync marks nothing
        assert not working(new)
        assert reconciles(scrape(new)) == 0, "a standby ran passes"

        old.stop()
        wait_until("the new replica to lead", lambda: working(new), timeout=30)
        wait_until("the new replica to reconcile", lambda: reconciles(scrape(new)) > 0)
    except BaseException:
        for r in replicas:
            print(f"===== {r.pod_id} =====\n{r.text()[-6000:]}")
        raise
    finally:
        for r in replicas:
            r.stop()

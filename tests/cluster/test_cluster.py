"""The local control plane behaves like a cluster where the operator's tests need it to."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import LocalCluster
from e2e.cluster.kubelet import LocalPod, local_env, run_pods, secret_reader
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.encoderpool.io"},
    "spec": {
        "group": "test.encoderpool.io",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1, "maximum": 10}
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def apply(cluster: LocalCluster, obj: Mapping[str, Any], namespace: str | None = None) -> str:
    args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
    return cluster.kubectl(*args, input=json.dumps(obj))


def get(cluster: LocalCluster, kind: str, name: str, namespace: str) -> Any:
    return json.loads(cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json"))


def test_crd_becomes_established_and_its_schema_rejects_bad_objects(
    cluster: LocalCluster, namespace: str
) -> None:
    apply(cluster, WIDGET_CRD)
    cluster.wait_established("widgets.test.encoderpool.io")
    good = {"apiVersion": "test.encoderpool.io/v1", "kind": "Widget", "metadata": {"name": "ok"}}
    apply(cluster, {**good, "spec": {"size": 3}}, namespace)
    with pytest.raises(RuntimeError, match=r"spec\.size.*less than or equal to 10"):
        apply(cluster, {**good, "metadata": {"name": "big"}, "spec": {"size": 11}}, namespace)
    with pytest.raises(RuntimeError, match=r"spec\.size: Required value"):
        apply(cluster, {**good, "metadata": {"name": "none"}, "spec": {}}, namespace)


def test_deployment_pods_become_running_and_ready(cluster: LocalCluster, namespace: str) -> None:
    labels = {"app": "web"}
    apply(
        cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "example.invalid/web:1"}]},
                },
            },
        },
        namespace,
    )
    cluster.kubectl(
        "wait", "--for=condition=Available", "deployment/web", "-n", namespace, "--timeout=60s"
    )
    pods = json.loads(
        cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=web", "-o", "json")
    )
    assert len(pods["items"]) == 2
    for pod in pods["items"]:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"].startswith("kwok-node-")  # the scheduler placed it
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert ready["Ready"] == "True"


def _job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "example.invalid/job:1"}],
                }
            },
        },
    }


def _running_pod_of(cluster: LocalCluster, job: str, namespace: str) -> str:
    names: list[str] = []

    def running() -> bool:
        out = cluster.kubectl(
            "get", "pods", "-n", namespace, "-l", f"job-name={job}",
            "--field-selector=status.phase=Running", "-o", "name",
        )  # fmt: skip
        names[:] = out.split()
        return bool(names)

    wait_until(f"a running pod of job {job}", running)
    return names[0].removeprefix("pod/")


@pytest.mark.parametrize(("exit_code", "condition"), [(0, "Complete"), (3, "Failed")])
def test_job_ends_as_its_pod_exits(
    cluster: LocalCluster, namespace: str, exit_code: int, condition: str
) -> None:
    apply(cluster, _job("work"), namespace)
    pod = _running_pod_of(cluster, "work", namespace)
    # Nothing ends the pod until a test says how it exited.
    time.sleep(1)
    assert get(cluster, "pod", pod, namespace)["status"]["phase"] == "Running"
    cluster.finish_pod(namespace, pod, exit_code)
    cluster.kubectl(
        "wait", f"--for=condition={condition}", "job/work", "-n", namespace, "--timeout=60s"
    )


# Writes its argument's file as a container writes its termination log, and says
# whether it was given credentials; exits with the code it is given.
_WRITE_MESSAGE = (
    "import os, sys; open(sys.argv[1], 'w').write('x' * 5000 + os.environ.get('KUBECONFIG', "
    "'no-credentials')); sys.exit(int(sys.argv[2]))"
)


@pytest.mark.parametrize("exit_code", [0, 3])
def test_the_stand_in_kubelet_reports_the_termination_message(
    cluster: LocalCluster, namespace: str, tmp_path: Path, exit_code: int
) -> None:
    job = _job("msg")
    pod_spec = job["spec"]["template"]["spec"]
    pod_spec["automountServiceAccountToken"] = False
    pod_spec["containers"][0].update(
        command=["python", "-c", _WRITE_MESSAGE],
        args=["/dev/termination-log", str(exit_code)],
        terminationMessagePolicy="File",
    )
    apply(cluster, job, namespace)
    (run,) = run_pods(cluster, namespace, "job-name=msg", tmp_path)
    assert run.returncode == exit_code, run.output
    expected = ("x" * 5000 + "no-credentials")[-4096:]  # a kubelet keeps the last 4096 bytes
    assert run.termination_message == expected

    def terminated() -> dict[str, Any] | None:
        pod = get(cluster, "pod", run.pod, namespace)
        statuses = pod["status"].get("containerStatuses") or [{}]
        state = statuses[0].get("state", {}).get("terminated")
        return dict(state) if state else None

    state = wait_until(f"pod {run.pod} terminated", terminated)
    assert state["message"] == expected
    assert state["exitCode"] == (0 if exit_code == 0 else 1)  # kwok's two stages


# Writes env X and the file its second argument names (in the pod: a Secret volume's).
_WRITE_SECRETS = (
    "import os, sys; open(sys.argv[1], 'w').write(os.environ['X'] + '|' + open(sys.argv[2]).read())"
)


def test_the_stand_in_kubelet_hands_secrets_over_as_a_kubelet_does(
    cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    """secretKeyRef env and secret volumes (the pool's key, the router's client tokens)."""
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "keys"},
            "stringData": {"k": "value-1", "tokens": "a\nb\n"},
        },
        namespace,
    )
    out = tmp_path / "out"
    container: dict[str, Any] = {
        "name": "c",
        "command": ["python", "-c", _WRITE_SECRETS],
        "args": [str(out), "/etc/tokens/list"],
        "env": [
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}}},
            {
                "name": "Y",
                "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}},
            },
        ],
        "volumeMounts": [{"name": "t", "mountPath": "/etc/tokens", "readOnly": True}],
    }
    pod: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": namespace},
        "spec": {
            "containers": [container],
            "volumes": [
                {
                    "name": "t",
                    "secret": {"secretName": "keys", "items": [{"key": "tokens", "path": "list"}]},
                }
            ],
        },
    }
    local = LocalPod(pod, tmp_path / "p.log", 0, {}, {}, cluster=cluster).start()
    assert local.proc is not None
    assert local.proc.wait(60) == 0, (tmp_path / "p.log").read_text()
    assert out.read_text() == "value-1|a\nb\n"
    assert "Y" not in local_env(pod, container, secret_reader(cluster))
    missing = {**container, "env": [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "other"}}}
    ]}  # fmt: skip
    with pytest.raises(RuntimeError, match="CreateContainerConfigError"):
        local_env(pod, missing, secret_reader(cluster))


def test_deleting_an_owner_garbage_collects_what_it_owns(
    cluster: LocalCluster, namespace: str
) -> None:
    apply(
        cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}, namespace
    )
    uid = get(cluster, "configmap", "owner", namespace)["metadata"]["uid"]
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
            ],
        },
    }
    apply(cluster, owned, namespace)
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)

    def gone() -> bool:
        out = cluster.kubectl("get", "configmap", "owned", "-n", namespace, check=False)
        return out == ""

    wait_until("the garbage collector to delete the owned ConfigMap", gone)


def test_a_service_account_token_gets_only_what_its_role_allows(
    cluster: LocalCluster, namespace: str
) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    cluster.kubectl(
        "create", "role", "read-configmaps", "-n", namespace,
        "--verb=get,list", "--resource=configmaps",
    )  # fmt: skip
    cluster.kubectl(
        "create", "rolebinding", "reader", "-n", namespace,
        "--role=read-configmaps", f"--serviceaccount={namespace}:reader",
    )  # fmt: skip
    token = cluster.kubectl("create", "token", "reader", "-n", namespace).strip()

    def as_reader(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(cluster.bins / "kubectl"), "--kubeconfig=/dev/null",
                f"--server={cluster.server}",
                f"--certificate-authority={cluster.pki / 'ca.crt'}",
                f"--token={token}", "-n", namespace, *args,
            ],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    allowed = as_reader("get", "configmaps")
    assert allowed.returncode == 0, allowed.stderr
    for refused in (
        as_reader("create", "configmap", "x"),
        as_reader("get", "secrets"),
        as_reader("get", "configmaps", "-n", "default"),
    ):
        assert refused.returncode != 0
        assert "forbidden" in refused.stderr.lower()
        assert f"system:serviceaccount:{namespace}:reader" in refused.stderr


def test_a_claim_of_the_default_class_binds(cluster: LocalCluster, namespace: str) -> None:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    apply(cluster, claim, namespace)
    wait_until(
        "the claim to bind",
        lambda: get(cluster, "pvc", "data", namespace)["status"].get("phase") == "Bound",
    )

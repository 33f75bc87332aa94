"""A sample EncoderPool on kind, as a platform engineer would set it up.

The cluster admin's part: a PersistentVolume holding the model (a hostPath into
the folder up.sh shares with the node) with its claim in the pool's namespace,
and a ReadWriteMany volume for the shared-volume cache (one node's hostPath can
be ReadWriteMany). The user's part: ``examples/pool-*.yaml`` as shipped, with the
requests sized for a 2-core node and DEBUG logs (the proof a consumer did not
encode is vLLM's ``Finish execute for mm hash`` line).
"""

from __future__ import annotations

import copy
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.kind.cluster import ROOT, KindCluster, copy_model
from e2e.media import token_ids

MODEL_CLAIM = "tiny-qwen2vl-model"
MODEL_DIR = "tiny-qwen2vl"
CACHE_CLASS = "encoderpool-kind-rwx"
NODE_SHARE = "/var/lib/encoderpool"  # where up.sh mounts the share inside the node


def example(name: str) -> dict[str, Any]:
    """One of the shipped examples, parsed (the EncoderPool document in it)."""
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / name).read_text()) if d]
    return next(copy.deepcopy(d) for d in docs if d.get("kind") == "EncoderPool")


def for_kind(pool: dict[str, Any], image: str) -> dict[str, Any]:
    """The example as the test runs it: our image, requests that fit next to the control
    plane on 2 cores, DEBUG logs, the shared-volume cache on our RWX class."""
    spec = pool["spec"]
    spec["image"] = image
    spec["imagePullPolicy"] = "IfNotPresent"
    for role in ("producer", "consumer"):
        spec[role].setdefault("resources", {})["requests"] = {"cpu": "100m", "memory": "1Gi"}
    env = [e for e in spec["model"].get("env", []) if e["name"] != "VLLM_LOGGING_LEVEL"]
    spec["model"]["env"] = [*env, {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
    sv = spec["connector"].get("sharedVolume")
    if sv is not None:
        sv["storageClassName"] = CACHE_CLASS
    return pool


def sample_pool(
    kind: KindCluster,
    namespace: str,
    name: str,
    model: Path,
    image: str,
    *,
    transport: str = "sharedVolume",
    cache_tmpfs_mib: int | None = None,
) -> dict[str, Any]:
    """The shipped shared-volume example as the kind suites, the demo and the autoscale
    benchmark run it (``for_kind``), named ``name`` in ``namespace``, with what it needs
    made there first: the namespace, the model on a PersistentVolumeClaim and, for the
    shared volume, the cache volume (a tmpfs of ``cache_tmpfs_mib`` when given).
    ``transport="rdma"``: the same pool over NIXL (``rdma``), no cache volume. Returned,
    not applied: each caller adds what it tests."""
    kind.namespace(namespace)
    model_volume(kind, namespace, model)
    pool = for_kind(example("pool-shared-volume.yaml"), image)
    if transport == "rdma":
        pool = rdma(pool)
    else:
        cache_volume(kind, namespace, tmpfs_mib=cache_tmpfs_mib)
    pool["metadata"] = {"name": name, "namespace": namespace}
    return pool


def rdma(pool: dict[str, Any]) -> dict[str, Any]:
    """The same pool on the rdma transport: NIXL over UCX on TCP and shared memory between
    real pods (what a node without an RDMA NIC has), a small registered buffer."""
    pool["spec"]["connector"] = {
        "rdma": {"ucxTransports": "tcp,self,sm", "bufferSize": "64Mi", "shmSize": "256Mi"}
    }
    return pool


def status(kind: KindCluster, namespace: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = kind.get("epool", "-n", namespace, name).get("status", {})
    return out


def condition(kind: KindCluster, namespace: str, name: str, type_: str) -> dict[str, Any]:
    conditions = status(kind, namespace, name).get("conditions", [])
    return next((c for c in conditions if c["type"] == type_), {})


def chat(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """POST an OpenAI chat request (through a port-forward) and return the JSON answer."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.load(r)
        return out


def logs(kind: KindCluster, namespace: str, pool: str, component: str) -> str:
    """The logs of the pool's <component> pods, whole."""
    return kind.kubectl(
        "logs",
        "-n",
        namespace,
        "-l",
        f"app.kubernetes.io/instance={pool},app.kubernetes.io/component={component}",
        "--tail=-1",
        check=False,
    )


def encoded(kind: KindCluster, namespace: str, pool: str, component: str) -> int:
    """How many media items the pool's <component> pods ran their encoder for (vLLM's DEBUG
    ``Finish execute for mm hash`` lines in their logs)."""
    return logs(kind, namespace, pool, component).count("Finish execute for mm hash")


def model_volume(kind: KindCluster, namespace: str, model: Path) -> None:
    """The model on a read-only PersistentVolume, claimed as ``MODEL_CLAIM`` in ``namespace``."""
    copy_model(model, kind.share, MODEL_DIR)
    pv = f"{namespace}-model"
    kind.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "persistentVolumeReclaimPolicy": "Retain",
                    "claimRef": {"namespace": namespace, "name": MODEL_CLAIM},
                    "hostPath": {"path": f"{NODE_SHARE}/models", "type": "Directory"},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": MODEL_CLAIM, "namespace": namespace},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": pv,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        ]
    )


def cache_volume(kind: KindCluster, namespace: str, tmpfs_mib: int | None = None) -> None:
    """A ReadWriteMany volume of ``CACHE_CLASS`` for one pool's shared-volume cache, owned
    by the pods' uid/gid 1000 (a hostPath ignores fsGroup). With ``tmpfs_mib``, the folder
    is a tmpfs of that size mounted on the node, smaller than the 1Gi the volume claims
    (a test can fill it without touching the host's disk; ``release_cache_volume``)."""
    host = kind.share / "cache" / namespace
    host.mkdir(parents=True, exist_ok=True)
    os.chown(host, 1000, 1000)
    host.chmod(0o770)
    if tmpfs_mib is not None:
        node = cache_dir_on_node(namespace)
        options = f"size={tmpfs_mib}m,uid=1000,gid=1000,mode=0770"
        kind.node_exec(
            "sh", "-c", f"mountpoint -q {node} || mount -t tmpfs -o {options} tmpfs {node}"
        )
    kind.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{namespace}-cache"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": CACHE_CLASS,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": cache_dir_on_node(namespace), "type": "Directory"},
            },
        }
    )


def cache_dir_on_node(namespace: str) -> str:
    return f"{NODE_SHARE}/cache/{namespace}"


def release_cache_volume(kind: KindCluster, namespace: str) -> None:
    """Unmount a ``cache_volume`` tmpfs (lazily: pods may still be stopping)."""
    node = cache_dir_on_node(namespace)
    kind.node_exec("sh", "-c", f"! mountpoint -q {node} || umount -l {node}")


def patch_spec(kind: KindCluster, namespace: str, name: str, spec: dict[str, Any]) -> None:
    """A merge patch of the pool's spec, as ``kubectl patch epool --type=merge`` makes it."""
    kind.kubectl(
        "patch", "epool", "-n", namespace, name, "--type=merge", "-p", json.dumps({"spec": spec})
    )


def wait_ready(kind: KindCluster, namespace: str, name: str, timeout_s: int = 1200) -> float:
    """``kubectl wait --for=condition=Ready epool/<name>``; returns the seconds it took."""
    t0 = time.monotonic()
    kind.kubectl(
        "wait",
        "-n",
        namespace,
        "--for=condition=Ready",
        f"epool/{name}",
        f"--timeout={timeout_s}s",
        timeout=timeout_s + 30,
    )
    return time.monotonic() - t0


def monolithic_token_ids(
    kind: KindCluster, namespace: str, pool: dict[str, Any], bodies: list[dict[str, Any]]
) -> list[list[int]]:
    """The greedy token ids of ``bodies`` answered by a monolithic vLLM pod (``monolithic``),
    started for the comparison."""
    name = pool["metadata"]["name"]
    kind.apply(monolithic(kind, namespace, name))
    kind.kubectl(
        "rollout", "status", "-n", namespace, f"deployment/{name}-mono", "--timeout=600s",
        timeout=630,
    )  # fmt: skip
    with kind.port_forward(namespace, f"deployment/{name}-mono", 8000) as mono:
        return [token_ids(chat(mono, b)) for b in bodies]


def token_ids_pool_and_monolithic(
    kind: KindCluster, namespace: str, pool: dict[str, Any], bodies: list[dict[str, Any]]
) -> tuple[list[list[int]], list[list[int]]]:
    """The greedy token ids of ``bodies`` answered through the pool's router, and by a
    monolithic vLLM pod."""
    expected = monolithic_token_ids(kind, namespace, pool, bodies)
    name = pool["metadata"]["name"]
    with kind.port_forward(namespace, f"service/{name}", pool["spec"]["router"]["port"]) as url:
        got = [token_ids(chat(url, b)) for b in bodies]
    return got, expected


def consumer_loads(kind: KindCluster, namespace: str, pool: str) -> float:
    """Embeddings the pool's consumer loaded through its connector (``encoderpool_ec_loads``
    on vLLM's /metrics, which needs no key)."""
    with (
        kind.port_forward(namespace, f"deployment/{pool}-consumer", 8000) as url,
        urllib.request.urlopen(url + "/metrics", timeout=30) as r,
    ):
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "encoderpool_ec_loads_total"
    )


def monolithic(kind: KindCluster, namespace: str, pool: str) -> dict[str, Any]:
    """A monolithic vLLM Deployment: the pool's consumer pod, less the EC connector and the
    API key, so that it serves the same model with the same flags from the same image and
    volumes."""
    consumer = kind.get("deployment", "-n", namespace, f"{pool}-consumer")
    template = consumer["spec"]["template"]
    labels = {"app.kubernetes.io/name": "mono-vllm", "encoderpool.test/of": pool}
    template["metadata"] = {"labels": labels}
    container = template["spec"]["containers"][0]
    args = container["args"]
    for flag in ("--ec-transfer-config", "--middleware"):  # no connector, no API key guard
        i = args.index(flag)
        args = args[:i] + args[i + 2 :]
    container["args"] = args
    # The test talks to it directly: it needs no key (nor the pool's internal Secret).
    container["env"] = [e for e in container.get("env", []) if e["name"] != "VLLM_API_KEY"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{pool}-mono", "namespace": namespace},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template},
    }

"""What the operator tests share: pools, reports, rendered children, plan snapshots,
and the fixtures that run the operator on the local control plane (registered in
tests/conftest.py). Test modules import from here, never from each other."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from encoderpool_contracts import DTYPE_BYTES, WidthReport, configmap_name
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.naming import ref_of
from encoderpool_operator.reconcile.actions import Action, PatchStatus
from encoderpool_operator.reconcile.plan import Plan, plan
from encoderpool_operator.reconcile.snapshot import Snapshot
from encoderpool_operator.render import WORKLOAD_KINDS, Defaults, Observed, workload_objects
from encoderpool_operator.render.autoscaling import scalers
from encoderpool_operator.render.widths import report_key, width_job, width_report_configmap
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "encoderpool.io_encoderpools.yaml"
DEFAULTS = Defaults(router_image="example.invalid/router:test", width_retry_seconds=30)
# The operator's settings with each autoscaling engine.
PROM = "http://prometheus.monitoring.svc:9090"
KEDA = dataclasses.replace(DEFAULTS, autoscaling_engine="keda", prometheus_address=PROM)
HPA = dataclasses.replace(DEFAULTS, autoscaling_engine="hpa")
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)
UID = "pool-uid"


@pytest.fixture(scope="session")
def crd(cluster: LocalCluster) -> str:
    """The generated CRD, applied and Established."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.wait_established("encoderpools.encoderpool.io")
    return "encoderpools.encoderpool.io"


@pytest.fixture
def operator(
    cluster: LocalCluster, crd: str, namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[OperatorProcess]:
    """The operator, as a local process watching the test's namespace."""
    op = OperatorProcess(
        cluster.operator_kubeconfig,
        tmp_path / "operator.log",
        namespace=namespace,
        env={"ENCODERPOOL_RESYNC_SECONDS": "5", "ENCODERPOOL_WIDTH_RETRY_SECONDS": "2"},
    ).start()
    yield op
    op.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(f"\n===== operator log ({op.log_path}) =====\n{op.log_tail(150)}")


def sample_pool(name: str = "tiny", model: str = "/models/tiny-qwen2vl") -> dict[str, Any]:
    """examples/pool-shared-volume.yaml with another name, the model at a path of its own.

    The local cluster's pods run as local processes: they read the model from a path
    here, not from the example's PersistentVolumeClaim, so the source goes.
    """
    pool = yaml.safe_load((REPO / "examples" / "pool-shared-volume.yaml").read_text())
    pool = copy.deepcopy(pool)
    pool["metadata"] = {"name": name}
    pool["spec"]["model"].pop("source", None)
    pool["spec"]["model"]["name"] = model
    return dict(pool)


def report_for(pool: dict[str, Any], width: int = 128) -> WidthReport:
    """A width report as the Job would write it for this pool (for tests that seed one)."""
    parsed = EncoderPool.from_object({**pool, "metadata": {"name": pool["metadata"]["name"]}})
    identity = parsed.spec.model_identity(parsed.spec.image)
    dtype = parsed.spec.model.dtype
    return WidthReport(
        fingerprint=identity.fingerprint(),
        identity=identity,
        encoder_output_widths={"image": width},
        hidden_size=width,
        dtype=dtype,
        bytes_per_token={"image": width * DTYPE_BYTES[dtype]},
        max_tokens_per_item={"image": 64},
        measured_at=datetime.now(timezone.utc),
    )


def report_configmap(
    namespace: str, pool: dict[str, Any], report: WidthReport | None = None
) -> dict[str, Any]:
    """The report ConfigMap as the operator stores it for ``pool`` (labels and digest),
    without owners: what a test seeds in place of a width Job's run."""
    meta = {"name": pool["metadata"]["name"], "namespace": namespace, "uid": "seeded"}
    parsed = EncoderPool.from_object({**pool, "metadata": meta})
    report = report or report_for(pool)
    key = report_key(parsed)
    cm = width_report_configmap(parsed, key, report.fingerprint, report.to_configmap_data())
    del cm["metadata"]["ownerReferences"]
    return cm


def report_name(pool: dict[str, Any]) -> str:
    """The name of ``pool``'s report ConfigMap (by its report key)."""
    parsed = EncoderPool.from_object({**pool, "metadata": {"name": pool["metadata"]["name"]}})
    return configmap_name(report_key(parsed))


def seed_report(
    cluster: LocalCluster,
    namespace: str,
    pool: dict[str, Any],
    report: WidthReport | None = None,
) -> None:
    """Store ``report`` (default: ``report_for(pool)``) where the operator keeps ``pool``'s."""
    cm = report_configmap(namespace, pool, report)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(cm))


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json"))


WIDTH_JOB_PODS = "app.kubernetes.io/component=width-job"


def running_width_pods(cluster: LocalCluster, namespace: str, other_than: str = "") -> list[Any]:
    """Running pods of the namespace's width Jobs, but the one whose uid is ``other_than``."""
    pods = get_json(cluster, "pods", "-n", namespace, "-l", WIDTH_JOB_PODS)["items"]
    return [
        p
        for p in pods
        if p["metadata"]["uid"] != other_than and p["status"].get("phase") == "Running"
    ]


def condition(pool: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in pool.get("status", {}).get("conditions", []):
        if c["type"] == type_:
            return dict(c)
    return None


# ------------------------------------------------------------ pools and rendering


def load(example: str, **meta: Any) -> EncoderPool:
    obj = yaml.safe_load((REPO / "examples" / example).read_text())
    obj["metadata"] = {"name": "pool", "namespace": "ml", "uid": "u-1", "generation": 1, **meta}
    return EncoderPool.from_object(obj)


GROUPS = [
    {"name": "images", "modalities": ["image"], "replicas": 2},
    {
        "name": "video",
        "modalities": ["video"],
        "resources": {"limits": {"cpu": "8", "memory": "16Gi"}},
        "nodeSelector": {"gpu": "big"},
    },
]


def grouped(example: str = "pool-shared-volume.yaml", groups: Any = None) -> EncoderPool:
    pool = load(example)
    obj = pool.model_dump(mode="json", by_alias=True, exclude={"status"})
    obj["spec"]["producerGroups"] = copy.deepcopy(GROUPS if groups is None else groups)
    obj["spec"]["model"]["limitMmPerPrompt"] = {"image": 1, "video": 1}
    obj["spec"]["producer"]["tensorParallelSize"] = 2
    obj["spec"]["producer"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    return EncoderPool.from_object(obj)


def pool_object(**spec: Any) -> dict[str, Any]:
    obj = yaml.safe_load((REPO / "examples" / "pool-shared-volume.yaml").read_text())
    obj["metadata"] = {"name": "tiny", "namespace": "ml", "uid": UID, "generation": 3}
    obj["spec"].update(spec)
    return dict(obj)


def report_of(obj: dict[str, Any]) -> WidthReport:
    return report_for(obj)


def children(pool: EncoderPool, width: int = 128) -> dict[str, dict[str, Any]]:
    raw = pool.model_dump(by_alias=True, exclude={"status"})
    report = report_for(raw, width)
    return {
        f"{o['kind']}/{o['metadata']['name']}": o for o in workload_objects(pool, report, DEFAULTS)
    }


def container(objs: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    return dict(objs[f"Deployment/{name}"]["spec"]["template"]["spec"]["containers"][0])


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# -------------------------------------------------------------------- plans


def report_cm(
    report: WidthReport, owners: tuple[str, ...] = (UID,), annotations: dict[str, str] | None = None
) -> Any:
    """A report ConfigMap as the operator stores it; ``snapshot`` names it and adds the
    labels and digest for its pool (the report key depends on the pool's spec)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": None,
            "namespace": "ml",
            "resourceVersion": "41",
            "annotations": annotations or {},
            "ownerReferences": [{"uid": u, "name": "p", "kind": "EncoderPool"} for u in owners],
        },
        "data": report.to_configmap_data(),
    }


def keyed(cm: Any, pool: EncoderPool) -> Any:
    """``cm`` (from ``report_cm``) named, labelled and digested for ``pool``."""
    out = copy.deepcopy(cm)
    key = report_key(pool)
    ours = width_report_configmap(pool, key, "0" * 16, out.get("data"))["metadata"]
    out["metadata"]["name"] = ours["name"]
    out["metadata"]["labels"] = ours["labels"]
    out["metadata"]["annotations"] = {
        **ours.get("annotations", {}),
        **out["metadata"]["annotations"],
    }
    return out


# metadata.managedFields of a Deployment whose replicas the HPA controller set (through
# the scale subresource, as on a real control plane).
HPA_HOLDS_REPLICAS = [
    {
        "manager": "kube-controller-manager",
        "operation": "Update",
        "subresource": "scale",
        "fieldsV1": {"f:spec": {"f:replicas": {}}},
    }
]


def live_children(
    pool: EncoderPool,
    report: WidthReport,
    defaults: Defaults = DEFAULTS,
    scaled_to: int | None = None,
) -> dict[Any, Any]:
    """Every child as the API server would return it: ours plus server fields, rolled out.
    With ``scaled_to``, each autoscaling role's Deployment has that many replicas, set by
    the HPA controller (which then holds the field: the operator applies none)."""
    held: dict[str, Any] = {}
    if scaled_to is not None:
        meta = {"metadata": {"managedFields": HPA_HOLDS_REPLICAS}}
        held = {s.deployment: meta for s in scalers(pool)}
    live = {}
    for obj in workload_objects(pool, report, defaults, Observed(held)):
        got = copy.deepcopy(obj)
        got["metadata"].update(resourceVersion="7", uid=f"uid-{obj['metadata']['name']}")
        got["metadata"]["generation"] = 2
        if obj["kind"] == "Deployment":
            if obj["metadata"]["name"] in held:
                got["spec"]["replicas"] = scaled_to
                got["metadata"]["managedFields"] = copy.deepcopy(HPA_HOLDS_REPLICAS)
            n = got["spec"]["replicas"]
            got["status"] = {
                "observedGeneration": 2,
                "updatedReplicas": n,
                "readyReplicas": n,
                "availableReplicas": n,
            }
        live[ref_of(obj)] = got
    return live


def snapshot(obj: dict[str, Any], **observed: Any) -> Snapshot:
    pool = EncoderPool.from_object(obj)
    fingerprint = pool.spec.model_identity(pool.spec.image).fingerprint()
    cm = observed.get("report_cm")
    if cm is not None and cm["metadata"]["name"] is None:
        observed["report_cm"] = keyed(cm, pool)
    return Snapshot(pool=pool, fingerprint=fingerprint, **observed)


def job(pool: EncoderPool, state: str | None, finished: datetime = NOW) -> dict[str, Any]:
    identity = pool.spec.model_identity(pool.spec.image)
    out = width_job(pool, identity, report_key(pool))
    out["metadata"].update(uid="job-uid", resourceVersion="9")
    if state is not None:
        out["status"] = {
            "conditions": [
                {
                    "type": state,
                    "status": "True",
                    "reason": "BackoffLimitExceeded" if state == "Failed" else "Completed",
                    "message": "Job has reached the specified backoff limit",
                    "lastTransitionTime": finished.strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
            ]
        }
    return out


def writes(p: Plan) -> list[Action]:
    return [a for a in p.actions if not isinstance(a, PatchStatus)]


def plan_condition(p: Plan, type_: str) -> tuple[str, str, str]:
    (c,) = [c for c in p.status.conditions if c.type == type_]
    return c.status, c.reason, c.message


def settled(obj: dict[str, Any]) -> dict[str, Any]:
    """The pool with the status a first pass over its measured, rolled-out children wrote."""
    report = report_of(obj)
    live = live_children(EncoderPool.from_object(obj), report)
    first = plan(snapshot(obj, report_cm=report_cm(report), live=live), DEFAULTS, NOW)
    return {**obj, "status": first.status.model_dump(mode="json", by_alias=True, exclude_none=True)}


def owned_of(live: dict[Any, Any]) -> dict[Any, Any]:
    """What observe's lists by label return: the children of WORKLOAD_KINDS."""
    return {ref: obj for ref, obj in live.items() if ref[:2] in WORKLOAD_KINDS}


def settled_snapshot(obj: dict[str, Any], live_from: dict[str, Any] | None = None) -> Snapshot:
    """A pass over ``obj`` whose children are what ``live_from``'s spec rendered."""
    report = report_of(obj)
    live = live_children(EncoderPool.from_object(live_from or obj), report)
    return snapshot(obj, report_cm=report_cm(report), live=live, owned=owned_of(live))


# ------------------------------------------------------------ control plane


def apply_pool(cluster: LocalCluster, namespace: str, pool: dict[str, object]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))


def ready_pool(cluster: LocalCluster, namespace: str, name: str = "tiny") -> dict[str, object]:
    def ready() -> dict[str, object] | None:
        pool = get_json(cluster, "encoderpool", name, "-n", namespace)
        cond = condition(pool, "Ready")
        return pool if cond and cond["status"] == "True" else None

    return dict(wait_until(f"EncoderPool {name} Ready", ready))


def ready_sample_pool(cluster: LocalCluster, namespace: str) -> dict[str, object]:
    """The sample pool, its widths seeded (no width Job), applied and Ready."""
    pool = sample_pool()
    seed_report(cluster, namespace, pool)
    apply_pool(cluster, namespace, pool)
    return ready_pool(cluster, namespace)

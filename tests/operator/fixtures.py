"""Fixtures for operator tests on the local control plane (registered in conftest)."""

from __future__ import annotations

import copy
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
from encoderpool_operator import render
from encoderpool_operator.api import EncoderPool

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "encoderpool.io_encoderpools.yaml"


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
    key = render.report_key(parsed)
    cm = render.width_report_configmap(parsed, key, report.fingerprint, report.to_configmap_data())
    del cm["metadata"]["ownerReferences"]
    return cm


def report_name(pool: dict[str, Any]) -> str:
    """The name of ``pool``'s report ConfigMap (by its report key)."""
    parsed = EncoderPool.from_object({**pool, "metadata": {"name": pool["metadata"]["name"]}})
    return configmap_name(render.report_key(parsed))


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

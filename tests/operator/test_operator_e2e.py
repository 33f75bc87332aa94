"""The operator with a real width Job: its pod's own command, run as a local process
with no API credentials (as the pod has none), measures the tiny model with vLLM and
leaves the report as its termination message; the operator reads it from the pod,
stores it in the report ConfigMap, and the pool becomes Ready on what was measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.cluster.kubelet import run_pods
from e2e.cluster.runner import OPERATOR_USER
from e2e.operator_process import OperatorProcess
from e2e.vllm_server import base_env
from encoderpool_contracts import ConnectorConfig, WidthReport
from tests.operator.fixtures import condition, get_json, sample_pool
from tests.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.vllm]


def test_a_pool_measures_its_model_for_real_and_becomes_ready(
    cluster: LocalCluster,
    namespace: str,
    operator: OperatorProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    pool = sample_pool(model=str(tiny_model))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))
    (run,) = run_pods(
        cluster,
        namespace,
        "app.kubernetes.io/component=width-job",
        tmp_path,
        timeout=400,
        # Our packages importable as the image has them installed (alone, this test
        # cannot count on another having put them on the environment's PYTHONPATH).
        extra_env={
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": base_env()["PYTHONPATH"],
        },
    )
    assert run.returncode == 0, run.output[-4000:]
    reported = WidthReport.from_termination_message(run.termination_message)

    def ready() -> dict[str, object] | None:
        got = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
        cond = condition(got, "Ready")
        return dict(got) if cond and cond["status"] == "True" else None

    got = wait_until("the pool Ready on the measured widths", ready, timeout=120)
    status = got["status"]
    assert isinstance(status, dict)
    assert status["encoderOutputWidths"] == {"image": 128}  # measured by vLLM, not seeded
    assert status["hiddenSize"] == 128
    assert status["bytesPerToken"] == {"image": 256}  # bf16
    # One warm encode's seconds, timed by the Job, beside the widths.
    assert status["encodeSeconds"] == reported.encode_seconds
    assert status["encodeSeconds"]["image"] > 0
    report = get_json(cluster, "configmap", status["widthReportName"], "-n", namespace)
    assert json.loads(report["data"]["report.json"])["max_tokens_per_item"]["image"] > 0
    assert WidthReport.from_configmap_data(report["data"]) == reported  # what the pod said
    # The pods were rendered with what was measured.
    args = get_json(cluster, "deployment", "tiny-consumer", "-n", namespace)["spec"]["template"][
        "spec"
    ]["containers"][0]["args"]
    extra = json.loads(args[args.index("--ec-transfer-config") + 1])["ec_connector_extra_config"]
    config = ConnectorConfig.from_extra_config(extra)
    assert config.encoder_output_widths == {"image": 128}
    assert config.model_fingerprint == status["modelFingerprint"]
    # The Job has no token and talked to no one; the operator stored the report.
    pod = get_json(cluster, "pod", run.pod, "-n", namespace)
    assert pod["spec"]["automountServiceAccountToken"] is False
    (state,) = pod["status"]["containerStatuses"]
    assert state["state"]["terminated"]["message"] == run.termination_message
    by_service_accounts = [
        e
        for e in cluster.audit_events(user=None, namespace=namespace, writes_only=False)
        if e["user"]["username"].startswith(f"system:serviceaccount:{namespace}:")
    ]
    assert by_service_accounts == []
    (created,) = [
        e
        for e in cluster.audit_events(user=None, namespace=namespace)
        if e["objectRef"].get("resource") == "configmaps"
        and e["objectRef"].get("name") == status["widthReportName"]
        and e["verb"] == "create"
    ]
    assert created["user"]["username"] == OPERATOR_USER

"""The operator with a real width Job: its pod's own command, run as a local process
as the Job's ServiceAccount, measures the tiny model with vLLM and writes the report
the operator then reads; the pool becomes Ready on what was measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.cluster.kubelet import run_pods
from e2e.operator_process import OperatorProcess
from encoderpool_connector.contracts import ConnectorConfig
from tests.fixtures_operator import condition, get_json, sample_pool, wait_until

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
        extra_env={"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.output[-4000:]

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
    report = get_json(cluster, "configmap", status["widthReportName"], "-n", namespace)
    assert json.loads(report["data"]["report.json"])["max_tokens_per_item"]["image"] > 0
    # The pods were rendered with what was measured.
    args = get_json(cluster, "deployment", "tiny-consumer", "-n", namespace)["spec"]["template"][
        "spec"
    ]["containers"][0]["args"]
    extra = json.loads(args[args.index("--ec-transfer-config") + 1])["ec_connector_extra_config"]
    config = ConnectorConfig.from_extra_config(extra)
    assert config.encoder_output_widths == {"image": 128}
    assert config.model_fingerprint == status["modelFingerprint"]
    # The Job wrote the report as its own ServiceAccount, which may write only that ConfigMap.
    job_sa = f"system:serviceaccount:{namespace}:{run.pod.rsplit('-', 1)[0]}"
    writes = cluster.audit_events(user=job_sa, namespace=namespace)
    assert writes, "the width Job wrote nothing as its ServiceAccount"
    assert {(e["objectRef"]["resource"], e["objectRef"]["name"]) for e in writes} == {
        ("configmaps", status["widthReportName"])
    }

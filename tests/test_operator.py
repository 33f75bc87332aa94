"""The operator on the real control plane: an EncoderPool becomes its children and Ready."""

from __future__ import annotations

import json

import pytest

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from tests.fixtures_operator import (
    condition,
    get_json,
    report_for,
    sample_pool,
    seed_report,
    wait_until,
)

pytestmark = pytest.mark.cluster


def apply_pool(cluster: LocalCluster, namespace: str, pool: dict[str, object]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))


def ready_pool(cluster: LocalCluster, namespace: str, name: str = "tiny") -> dict[str, object]:
    def ready() -> dict[str, object] | None:
        pool = get_json(cluster, "encoderpool", name, "-n", namespace)
        cond = condition(pool, "Ready")
        return pool if cond and cond["status"] == "True" else None

    return dict(wait_until(f"EncoderPool {name} Ready", ready))


def test_pool_with_measured_widths_becomes_ready(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool = sample_pool()
    seed_report(cluster, namespace, report_for(pool))
    apply_pool(cluster, namespace, pool)
    got = ready_pool(cluster, namespace)
    status = got["status"]
    assert isinstance(status, dict)
    assert status["encoderOutputWidths"] == {"image": 128}
    assert status["bytesPerToken"] == {"image": 256}
    assert status["producers"]["summary"] == "1/1"
    assert status["consumers"]["summary"] == "1/1"
    assert status["routerEndpoint"] == f"http://tiny.{namespace}.svc:8000"
    assert status["observedGeneration"] == got["metadata"]["generation"]  # type: ignore[index]
    for kind, name in [
        ("deployment", "tiny-producer"),
        ("deployment", "tiny-consumer"),
        ("deployment", "tiny-router"),
        ("service", "tiny"),
        ("service", "tiny-consumer"),
        ("pvc", "tiny-cache"),
        ("serviceaccount", "tiny-router"),
        ("role", "tiny-router"),
        ("rolebinding", "tiny-router"),
    ]:
        obj = get_json(cluster, kind, name, "-n", namespace)
        owner = obj["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("EncoderPool", "tiny", True)
    headless = get_json(cluster, "service", "tiny-producer", "-n", namespace)
    assert headless["spec"]["clusterIP"] == "None"

"""The operator on the real control plane: an EncoderPool becomes its children and Ready."""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from tests.operator.fixtures import (
    WIDTH_JOB_PODS,
    apply_pool,
    condition,
    get_json,
    ready_pool,
    ready_sample_pool,
    report_configmap,
    report_for,
    report_name,
    running_width_pods,
    sample_pool,
    seed_report,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster
RESYNC_LINE = "resync: 1 pools marked"  # controller.manager.Controller._resync


def test_pool_with_measured_widths_becomes_ready(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool = sample_pool()
    seed_report(cluster, namespace, pool)
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


def _generation(cluster: LocalCluster, kind: str, name: str, namespace: str) -> int:
    return int(get_json(cluster, kind, name, "-n", namespace)["metadata"]["generation"])


def _patch_pool(cluster: LocalCluster, namespace: str, patch: dict[str, object]) -> None:
    cluster.kubectl(
        "patch", "encoderpool", "tiny", "-n", namespace, "--type=merge", "-p", json.dumps(patch)
    )


def test_a_resync_with_nothing_changed_writes_nothing(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    ready_sample_pool(cluster, namespace)
    time.sleep(3)  # let the last child events settle
    before = len(cluster.audit_events(namespace=namespace))
    resyncs = operator.log_text().count(RESYNC_LINE)
    # Two more resyncs: the pool was marked, and its pass ran before the second mark.
    wait_until(
        "two more resyncs",
        lambda: operator.log_text().count(RESYNC_LINE) >= resyncs + 2,
        timeout=30,
    )
    writes = cluster.audit_events(namespace=namespace)[before:]
    assert [
        (e["verb"], e["objectRef"].get("resource"), e["objectRef"].get("name")) for e in writes
    ] == []
    assert before > 0  # the audit log does see this operator's writes


def _secret(cluster: LocalCluster, namespace: str) -> dict[str, Any]:
    return dict(get_json(cluster, "secret", "tiny-internal", "-n", namespace))


def test_the_pool_s_internal_secret_is_made_owned_and_kept(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool = ready_sample_pool(cluster, namespace)
    secret = _secret(cluster, namespace)
    assert secret["type"] == "Opaque"
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(values) == {"vllm-api-key", "channel-key"}
    assert all(len(v) >= 40 for v in values.values())  # token_urlsafe(32): 43 characters
    assert values["vllm-api-key"] != values["channel-key"]
    (owner,) = secret["metadata"]["ownerReferences"]
    meta = pool["metadata"]
    assert isinstance(meta, dict)
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("EncoderPool", meta["uid"], True)
    # A change that rolls the Deployments creates it again: a 409, its keys stay.
    _patch_pool(cluster, namespace, {"spec": {"producer": {"podAnnotations": {"a": "1"}}}})
    wait_until(
        "the producer Deployment to roll",
        lambda: _generation(cluster, "deployment", "tiny-producer", namespace) > 1,
    )
    ready_pool(cluster, namespace)
    again = _secret(cluster, namespace)
    assert again["data"] == secret["data"]
    assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
    # The operator only ever created it: never read a Secret (not even its own).
    verbs = [
        (e["verb"], e["responseStatus"]["code"])
        for e in cluster.audit_events(namespace=namespace, writes_only=False)
        if e["objectRef"].get("resource") == "secrets"
    ]
    assert verbs[0] == ("create", 201)
    assert set(verbs[1:]) == {("create", 409)}
    for value in values.values():
        assert value not in operator.log_text()


def test_scaling_changes_only_replicas(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    ready_sample_pool(cluster, namespace)
    producer_gen = _generation(cluster, "deployment", "tiny-producer", namespace)
    template = get_json(cluster, "deployment", "tiny-consumer", "-n", namespace)["spec"]["template"]
    _patch_pool(cluster, namespace, {"spec": {"consumer": {"replicas": 3}}})

    def scaled() -> bool:
        pool = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
        cond = condition(pool, "Ready")
        return bool(
            pool["status"]["consumers"]["summary"] == "3/3" and cond and cond["status"] == "True"
        )

    wait_until("3/3 consumers and Ready", scaled)
    consumer = get_json(cluster, "deployment", "tiny-consumer", "-n", namespace)
    assert consumer["spec"]["replicas"] == 3
    assert consumer["spec"]["template"] == template  # no rollout, only more pods
    assert _generation(cluster, "deployment", "tiny-producer", namespace) == producer_gen


def test_a_model_change_measures_first_then_rolls_both_roles(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    ready_sample_pool(cluster, namespace)
    _patch_pool(cluster, namespace, {"spec": {"model": {"name": "/models/other"}}})

    def measuring() -> bool:
        got = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
        cond = condition(got, "WidthsMeasured")
        return bool(cond and cond["reason"] == "Measuring")

    wait_until("WidthsMeasured=False/Measuring", measuring)
    jobs = get_json(cluster, "jobs", "-n", namespace, "-l", "app.kubernetes.io/component=width-job")
    assert len(jobs["items"]) == 1
    for role in ("producer", "consumer"):  # nothing rolls before the new widths are known
        args = get_json(cluster, "deployment", f"tiny-{role}", "-n", namespace)["spec"]["template"][
            "spec"
        ]["containers"][0]["args"]
        assert "/models/tiny-qwen2vl" in args
    changed = sample_pool(model="/models/other")
    seed_report(cluster, namespace, changed, report_for(changed, width=256))
    # The width Job's pod ends (its report is in place), which wakes the operator.
    pod = wait_until("the width Job's pod", lambda: running_width_pods(cluster, namespace))[0]
    cluster.finish_pod(namespace, pod["metadata"]["name"], 0)

    def rolled() -> bool:
        got = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
        cond = condition(got, "Ready")
        return bool(
            got["status"].get("encoderOutputWidths") == {"image": 256}
            and cond
            and cond["status"] == "True"
        )

    wait_until("Ready with the new widths", rolled)
    for role in ("producer", "consumer"):
        args = get_json(cluster, "deployment", f"tiny-{role}", "-n", namespace)["spec"]["template"][
            "spec"
        ]["containers"][0]["args"]
        assert "/models/other" in args
        config = json.loads(args[args.index("--ec-transfer-config") + 1])
        extra = config["ec_connector_extra_config"]
        assert extra["encoder_output_widths"] == {"image": 256}
        assert extra["model_fingerprint"] == report_for(changed).fingerprint


def test_a_deleted_pool_leaves_nothing_behind(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    ready_sample_pool(cluster, namespace)
    cluster.kubectl("delete", "encoderpool", "tiny", "-n", namespace, "--timeout=60s")
    kinds = (
        "deployments,services,pvc,configmaps,jobs,serviceaccounts,roles,rolebindings,pods,secrets"
    )

    def empty() -> bool:
        out = cluster.kubectl(
            "get", kinds, "-n", namespace, "-l", "app.kubernetes.io/name=encoderpool", "-o", "name"
        )
        return out.strip() == ""

    wait_until("every child (and the width report) to be garbage-collected", empty)


def one_try_pool(cluster: LocalCluster, namespace: str) -> tuple[dict[str, Any], Any]:
    """The sample pool, its width Job allowed one pod, applied: (the pool, that pod)."""
    pool = sample_pool()
    pool["spec"]["widthJob"] = {"backoffLimit": 0, "activeDeadlineSeconds": 600}
    apply_pool(cluster, namespace, pool)
    first = wait_until("the width Job's pod", lambda: running_width_pods(cluster, namespace))[0]
    return pool, first


def test_a_failed_width_job_is_a_condition_and_is_retried(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool, first = one_try_pool(cluster, namespace)
    cluster.finish_pod(namespace, first["metadata"]["name"], 1)

    def failed() -> dict[str, object] | None:
        got = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
        cond = condition(got, "WidthsMeasured")
        return cond if cond and cond["reason"] == "WidthJobFailed" else None

    cond = wait_until("WidthsMeasured=False/WidthJobFailed", failed)
    assert cond["status"] == "False"
    assert "BackoffLimitExceeded" in str(cond["message"])
    assert "tiny-width-" in str(cond["message"])
    ready = condition(get_json(cluster, "encoderpool", "tiny", "-n", namespace), "Ready")
    assert ready is not None
    assert ready["status"] == "False"

    # After the back-off the Job runs again; this time it measures.
    uid = first["metadata"]["uid"]
    retry = wait_until(
        "a second width Job pod", lambda: running_width_pods(cluster, namespace, uid), timeout=60
    )[0]
    seed_report(cluster, namespace, pool)
    cluster.finish_pod(namespace, retry["metadata"]["name"], 0)
    ready_pool(cluster, namespace)


def test_the_width_job_s_termination_message_is_the_report_and_is_checked(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool, first = one_try_pool(cluster, namespace)
    # A message that is not a report: the Job succeeded, the measurement did not.
    name = str(first["metadata"]["name"])
    cluster.finish_pod(namespace, name, 0, "Traceback (most recent call last): ...")

    def invalid() -> dict[str, object] | None:
        cond = condition(
            get_json(cluster, "encoderpool", "tiny", "-n", namespace), "WidthsMeasured"
        )
        return cond if cond and cond["reason"] == "WidthReportInvalid" else None

    cond = wait_until("WidthsMeasured=False/WidthReportInvalid", invalid)
    assert cond["status"] == "False"
    assert name in str(cond["message"])  # names the pod, and what is wrong
    assert "is not a width report" in str(cond["message"])
    # After the back-off a new Job runs; its report is the message, stored by the operator.
    uid = first["metadata"]["uid"]
    retry = wait_until(
        "a second width Job pod", lambda: running_width_pods(cluster, namespace, uid), timeout=60
    )[0]
    report = report_for(pool)
    message = report.to_termination_message()
    cluster.finish_pod(namespace, str(retry["metadata"]["name"]), 0, message)
    got = ready_pool(cluster, namespace)
    cm = get_json(cluster, "configmap", report_name(pool), "-n", namespace)
    assert cm["data"] == report.to_configmap_data()
    (owner,) = cm["metadata"]["ownerReferences"]
    assert (owner["name"], owner["controller"]) == ("tiny", False)
    assert cm["metadata"]["annotations"]["encoderpool.io/width-job-failures"] == "1"
    assert got["status"]["encoderOutputWidths"] == {"image": 128}  # type: ignore[index]


def _width_condition(cluster: LocalCluster, namespace: str, pool: str, reason: str) -> Any:
    def reached() -> dict[str, object] | None:
        got = get_json(cluster, "encoderpool", pool, "-n", namespace)
        cond = condition(got, "WidthsMeasured")
        return cond if cond and cond["reason"] == reason else None

    return wait_until(f"{pool}: WidthsMeasured=False/{reason}", reached)


def test_planted_width_reports_wedge_no_pool_and_are_named(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    """A same-namespace writer plants report ConfigMaps before two pools of theirs exist:
    one with the operator's labels and a failure count of 10^10 (an exponent that used
    to cost the pass minutes and gigabytes), one foreign, holding out-of-bounds numbers.
    Each pool names its ConfigMap in a condition; a bystander with another model turns
    Ready meanwhile, and the foreign ConfigMap is never patched or adopted."""
    wedged = sample_pool("wedged", "/models/wedged")
    wedged["spec"]["widthJob"] = {"backoffLimit": 0, "activeDeadlineSeconds": 600}
    planted = report_configmap(namespace, wedged)
    del planted["data"]
    planted["metadata"]["annotations"] = {"encoderpool.io/width-job-failures": "10000000000"}
    foreign = sample_pool("foreign", "/models/foreign")
    huge = json.loads(report_for(foreign).model_dump_json())
    huge.update(encoder_output_widths={"image": 1 << 30}, bytes_per_token={"image": 1 << 31})
    squatter = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": report_name(foreign), "namespace": namespace},
        "data": {"report.json": json.dumps(huge)},
    }
    for cm in (planted, squatter):
        cluster.kubectl("create", "-f", "-", input=json.dumps(cm))
    before = get_json(cluster, "configmap", report_name(foreign), "-n", namespace)
    apply_pool(cluster, namespace, wedged)
    apply_pool(cluster, namespace, foreign)

    pod = wait_until(
        "the wedged pool's width Job pod", lambda: running_width_pods(cluster, namespace)
    )
    (only,) = pod  # the foreign pool runs no Job: it could never store its report
    cluster.finish_pod(namespace, only["metadata"]["name"], 1)
    failed = _width_condition(cluster, namespace, "wedged", "WidthJobFailed")
    assert f"ConfigMap {namespace}/{report_name(wedged)}" in failed["message"]
    assert "'10000000000' is not a count" in failed["message"]
    assert re.search(r"retrying in (5[0-9][0-9]|600)s", failed["message"])  # the cap

    bystander = sample_pool("bystander", "/models/bystander")
    seed_report(cluster, namespace, bystander)
    apply_pool(cluster, namespace, bystander)
    ready_pool(cluster, namespace, "bystander")

    refused = _width_condition(cluster, namespace, "foreign", "WidthReportForeign")
    assert f"ConfigMap {namespace}/{report_name(foreign)}" in refused["message"]
    assert f"kubectl delete configmap -n {namespace} {report_name(foreign)}" in refused["message"]
    after = get_json(cluster, "configmap", report_name(foreign), "-n", namespace)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"]
    for name in ("wedged", "foreign"):
        ready = condition(get_json(cluster, "encoderpool", name, "-n", namespace), "Ready")
        assert ready is not None
        assert ready["status"] == "False"

    # Deleted, the squatter's name is free: the foreign pool measures and stores its report.
    cluster.kubectl("delete", "configmap", report_name(foreign), "-n", namespace)
    retry = wait_until(
        "the foreign pool's width Job pod",
        lambda: [
            p for p in running_width_pods(cluster, namespace) if "foreign" in p["metadata"]["name"]
        ],
    )[0]
    message = report_for(foreign).to_termination_message()
    cluster.finish_pod(namespace, retry["metadata"]["name"], 0, message)
    ready_pool(cluster, namespace, "foreign")


def test_an_operator_killed_mid_measurement_converges_when_restarted(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool = sample_pool()
    apply_pool(cluster, namespace, pool)
    pod = wait_until("the width Job's pod", lambda: running_width_pods(cluster, namespace))[0]
    operator.stop(kill=True)  # mid-measurement: the Job runs on without it
    seed_report(cluster, namespace, pool)
    cluster.finish_pod(namespace, pod["metadata"]["name"], 0)
    operator.start()
    got = ready_pool(cluster, namespace)
    jobs = get_json(cluster, "jobs", "-n", namespace, "-l", WIDTH_JOB_PODS)["items"]
    assert len(jobs) == 1  # the restarted operator adopted the running Job, made no second
    assert got["status"]["encoderOutputWidths"] == {"image": 128}  # type: ignore[index]


def test_the_operator_exports_metrics(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool = ready_sample_pool(cluster, namespace)
    name = pool["metadata"]["name"]  # type: ignore[index]

    def scrape() -> str:
        with urllib.request.urlopen(operator.metrics_url, timeout=5) as r:
            return str(r.read().decode())

    text = wait_until(
        "the metrics to show the Ready pool",
        lambda: (t := scrape()) and 'encoderpool_operator_pools{ready="True"} 1.0' in t and t,
    )
    assert re.search(
        r'encoderpool_operator_reconciles_total\{result="settled",trigger="\w+"\} [1-9]', text
    )
    assert re.search(
        r'encoderpool_operator_api_writes\{kind="Deployment",verb="PATCH"\} 3\.0', text
    )
    assert "encoderpool_operator_reconcile_seconds_count" in text
    # Each pool's status as gauges, labelled with the pool (the chart's alerts read them).
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("pool") == name and s.labels.get("namespace") == namespace
    }
    pool_labels = (("namespace", namespace), ("pool", name))

    def gauge(metric: str, **labels: str) -> float | None:
        return samples.get((metric, tuple(sorted((*pool_labels, *labels.items())))))

    condition = "encoderpool_operator_pool_condition"
    ready = {"condition": "Ready", "status": "True", "reason": "AllAvailable"}
    assert gauge(condition, **ready) == 1.0
    assert gauge(condition, condition="WidthsMeasured", status="True", reason="Measured") == 1.0
    replicas = "encoderpool_operator_pool_replicas"
    status = pool["status"]
    for role in ("producer", "consumer"):
        counts = status[f"{role}s"]  # type: ignore[index]
        assert gauge(replicas, role=role, state="desired") == counts["desired"]
        assert gauge(replicas, role=role, state="ready") == counts["ready"]
    assert gauge("encoderpool_operator_pool_encoder_width", modality="image") == 128.0

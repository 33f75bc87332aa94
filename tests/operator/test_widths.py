"""Width reports are input, not truth: what a same-namespace writer can put in the report
ConfigMap is bounded, and a report the operator did not write is never used or touched
(pure; tests/operator/test_operator.py shows the same on the real control plane)."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
from pydantic import ValidationError

from encoderpool_contracts import CONFIGMAP_KEY, WidthReport
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.naming import ANNOTATION_REPORT_DIGEST, width_job_name
from encoderpool_operator.reconcile.actions import Apply, MergePatch, PatchStatus
from encoderpool_operator.reconcile.plan import plan
from encoderpool_operator.reconcile.widths import (
    ANNOTATION_FAILURES,
    BACKOFF_CAP_SECONDS,
    MAX_FAILURES,
    backoff_seconds,
    parse_failures,
)
from encoderpool_operator.render.widths import report_digest, report_key
from tests.operator.fixtures import (
    DEFAULTS,
    NOW,
    job,
    plan_condition,
    pool_object,
    report_cm,
    report_of,
    snapshot,
)


@pytest.mark.parametrize(
    ("annotations", "count", "readable"),
    [
        ({}, 0, True),
        ({ANNOTATION_FAILURES: "0"}, 0, True),
        ({ANNOTATION_FAILURES: "3"}, 3, True),
        ({ANNOTATION_FAILURES: "999"}, MAX_FAILURES, True),  # clamped
        ({ANNOTATION_FAILURES: "10000000000"}, MAX_FAILURES, False),
        ({ANNOTATION_FAILURES: "9" * 5000}, MAX_FAILURES, False),
        ({ANNOTATION_FAILURES: "-1"}, MAX_FAILURES, False),
        ({ANNOTATION_FAILURES: " 1"}, MAX_FAILURES, False),
        ({ANNOTATION_FAILURES: "1e9"}, MAX_FAILURES, False),
        ({ANNOTATION_FAILURES: "٣"}, MAX_FAILURES, False),  # a digit to int(), not to us
        ({ANNOTATION_FAILURES: ""}, MAX_FAILURES, False),
    ],
)
def test_the_failure_count_is_parsed_with_bounds(
    annotations: dict[str, str], count: int, readable: bool
) -> None:
    got, why = parse_failures(annotations)
    assert got == count
    assert (why is None) == readable
    if why is not None:
        assert ANNOTATION_FAILURES in why
        assert f"read as {MAX_FAILURES}" in why


def test_backoff_is_capped_and_costs_the_same_for_any_count() -> None:
    assert [backoff_seconds(n, 30) for n in (0, 1, 2, 3)] == [30, 30, 60, 120]
    start = time.perf_counter()
    for n in (MAX_FAILURES, 10**10, 10**100):
        assert backoff_seconds(n, 30) == BACKOFF_CAP_SECONDS
    assert time.perf_counter() - start < 0.01
    assert backoff_seconds(10**10, 1e-9) < BACKOFF_CAP_SECONDS  # a tiny base stays tiny


def _report_json(**change: Any) -> str:
    data = json.loads(report_of(pool_object()).model_dump_json())
    data.update(change)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"encoder_output_widths": {"image": 1 << 30}}, "encoder_output_widths.image"),
        ({"encoder_output_widths": {"image": 0}}, "encoder_output_widths.image"),
        ({"hidden_size": 10**12}, "hidden_size"),
        ({"bytes_per_token": {"image": 1 << 40}}, "bytes_per_token.image"),
        ({"max_tokens_per_item": {"image": 10**15}}, "max_tokens_per_item.image"),
        ({"max_tokens_per_item": {f"m{i}": 1 for i in range(9)}}, "max_tokens_per_item"),
        ({"encoder_output_widths": {"../x": 128}}, "encoder_output_widths"),
        ({"bytes_per_token": {"image": 255}}, "bytes_per_token.image"),  # not width x 2
    ],
)
def test_report_numbers_are_bounded(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        WidthReport.from_configmap_data({CONFIGMAP_KEY: _report_json(**change)})
    assert field in str(info.value)


def _keyed_cm(obj: dict[str, Any], data: dict[str, str]) -> dict[str, Any]:
    """A report ConfigMap with the operator's labels and digest over ``data``."""
    cm = snapshot(obj, report_cm=report_cm(report_of(obj))).report_cm
    assert cm is not None
    out = copy.deepcopy(dict(cm))
    pool = EncoderPool.from_object(obj)
    out["data"] = data
    digest = report_digest(report_key(pool), data)
    out["metadata"]["annotations"][ANNOTATION_REPORT_DIGEST] = digest
    return out


def test_a_report_out_of_bounds_is_a_condition_naming_the_configmap_and_field() -> None:
    obj = pool_object()
    cm = _keyed_cm(obj, {CONFIGMAP_KEY: _report_json(hidden_size=10**12)})
    p = plan(snapshot(obj, report_cm=cm), DEFAULTS, NOW)
    status, reason, message = plan_condition(p, "WidthsMeasured")
    assert (status, reason) == ("False", "WidthReportInvalid")
    assert f"ConfigMap ml/{cm['metadata']['name']}" in message
    assert "hidden_size" in message
    # The report is ours: measuring again replaces it; nothing else is rendered from it.
    pool = EncoderPool.from_object(obj)
    job_name = width_job_name(pool, report_key(pool))
    assert [a.describe() for a in p.actions if not isinstance(a, PatchStatus)] == [
        f"Job/{job_name}"
    ]


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("no labels", "lacks the operator's labels"),
        ("another key", "encoderpool.io/width-report-key="),
        ("edited by hand", "does not match the encoderpool.io/width-report-digest"),
        ("no digest", "does not match the encoderpool.io/width-report-digest"),
    ],
)
def test_a_report_the_operator_did_not_write_is_never_used_patched_or_adopted(
    how: str, why: str
) -> None:
    obj = pool_object()
    cm = _keyed_cm(obj, report_of(obj).to_configmap_data())
    cm["metadata"]["ownerReferences"] = []  # not an owner yet: adopting would be a patch
    meta = cm["metadata"]
    if how == "no labels":
        meta["labels"] = {}
    elif how == "another key":
        meta["labels"]["encoderpool.io/width-report-key"] = "0" * 16
    elif how == "edited by hand":
        widths = json.loads(cm["data"][CONFIGMAP_KEY])
        widths["encoder_output_widths"] = {"image": 64}
        widths["bytes_per_token"] = {"image": 128}
        cm["data"] = {CONFIGMAP_KEY: json.dumps(widths)}
    else:
        del meta["annotations"][ANNOTATION_REPORT_DIGEST]
    p = plan(snapshot(obj, report_cm=cm), DEFAULTS, NOW)
    status, reason, message = plan_condition(p, "WidthsMeasured")
    assert (status, reason) == ("False", "WidthReportForeign")
    name = meta["name"]
    assert f"ConfigMap ml/{name}" in message
    assert f"kubectl delete configmap -n ml {name}" in message
    assert why in message
    # Never patched, adopted or measured over; no workload rendered from it.
    assert [a for a in p.actions if not isinstance(a, PatchStatus)] == []
    assert p.requeue_after is not None


def test_a_huge_failure_count_waits_the_cap_and_names_the_configmap() -> None:
    obj = pool_object()
    pool = EncoderPool.from_object(obj)
    cm = _keyed_cm(obj, {})
    del cm["data"]
    cm["metadata"]["annotations"] = {ANNOTATION_FAILURES: "10000000000"}
    snap = snapshot(obj, report_cm=cm, width_jobs=(job(pool, "Failed"),))
    start = time.perf_counter()
    p = plan(snap, DEFAULTS, NOW)
    assert time.perf_counter() - start < 1
    status, reason, message = plan_condition(p, "WidthsMeasured")
    assert (status, reason) == ("False", "WidthJobFailed")
    assert f"ConfigMap ml/{cm['metadata']['name']}" in message
    assert "'10000000000' is not a count" in message
    assert p.requeue_after == pytest.approx(BACKOFF_CAP_SECONDS)
    # After the cap: the count written back is the clamped one.
    later = plan(snap, DEFAULTS, NOW.replace(hour=13))
    (count,) = [a for a in later.actions if isinstance(a, MergePatch)]
    assert count.body["metadata"]["annotations"] == {ANNOTATION_FAILURES: str(MAX_FAILURES)}


def _key(**spec: Any) -> str:
    return report_key(EncoderPool.from_object(pool_object(**spec)))


def test_the_report_key_covers_what_changes_a_measurement_and_the_fingerprint_does_not() -> None:
    base = pool_object()
    key = _key()
    model = copy.deepcopy(base["spec"]["model"])
    changed: dict[str, dict[str, Any]] = {
        "width Job image": {"widthJob": {"image": "other.example/vllm:1"}},
        "extra args that reach the Job": {
            "model": {**model, "extraArgs": ["--max-model-len", "4096"]}
        },
        "model env": {"model": {**model, "env": [{"name": "VLLM_X", "value": "1"}]}},
        "serving image": {"image": "other.example/vllm:2"},
        "model": {"model": {**model, "name": "other-model"}},
    }
    for what, spec in changed.items():
        assert _key(**spec) != key, what
    # Neither the pod counts, the router nor env vLLM does not read change what it measures.
    assert _key(router={"enabled": False}, producer={"replicas": 3}) == key
    team = [*model.get("env", []), {"name": "TEAM", "value": "vision"}]
    assert _key(model={**model, "env": team}) == key
    # The fingerprint cache entries carry stays the model's: the Job's image is not in it.
    fingerprint = EncoderPool.from_object(base).spec.model_identity("x").fingerprint()
    other = EncoderPool.from_object(pool_object(widthJob={"image": "other.example/vllm:1"}))
    assert other.spec.model_identity("x").fingerprint() == fingerprint


def test_the_width_job_and_its_report_are_named_by_the_report_key() -> None:
    obj = pool_object(widthJob={"image": "other.example/vllm:1"})
    pool = EncoderPool.from_object(obj)
    key = report_key(pool)
    p = plan(snapshot(obj), DEFAULTS, NOW)
    (apply,) = [a for a in p.actions if isinstance(a, Apply)]
    assert apply.obj["metadata"]["name"] == f"tiny-width-{key[:10]}"
    assert apply.obj["metadata"]["labels"]["encoderpool.io/width-report-key"] == key
    assert p.status.width_report_name == f"encoderpool-widths-{key}"


@pytest.mark.parametrize(
    ("encode_seconds", "field"),
    [
        ({"image": 0}, "encode_seconds.image"),
        ({"image": -0.1}, "encode_seconds.image"),
        ({"image": 1e9}, "encode_seconds.image"),
        ({"image": "fast"}, "encode_seconds.image"),
        ({f"m{i}": 1.0 for i in range(9)}, "encode_seconds"),
        ({"../x": 1.0}, "encode_seconds"),
        ({"video": 1.0}, "encode_seconds has video"),  # a modality not measured
    ],
)
def test_a_report_s_encode_times_are_bounded(encode_seconds: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        WidthReport.from_configmap_data(
            {CONFIGMAP_KEY: _report_json(encode_seconds=encode_seconds)}
        )
    assert field in str(info.value)

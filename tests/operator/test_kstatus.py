"""The pool's status as kstatus reads it: sigs.k8s.io/cli-utils' library, the one Flux's
kustomize-controller uses for ``wait`` and health checks (built here from its Go
module, e2e/monitoring/build.sh), on statuses the reconcile's plan writes.

Current when Ready, InProgress while measuring, rolling out or not yet observed,
Failed for each reason a person must act on.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from e2e.kind.monitoring import tools_dir
from encoderpool_operator.api import READY, ConditionUpdate
from encoderpool_operator.conditions import PROBLEM_REASONS, set_condition, with_kstatus
from encoderpool_operator.reconcile.plan import invalid_status, plan
from tests.operator.fixtures import (
    DEFAULTS,
    NOW,
    live_children,
    pool_object,
    report_cm,
    report_of,
    snapshot,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kstatus() -> Path:
    return tools_dir() / "kstatus"


def compute(kstatus: Path, obj: dict[str, Any]) -> tuple[str, str]:
    """kstatus' verdict on ``obj``: (status, message)."""
    out = subprocess.run(
        [str(kstatus)], input=json.dumps(obj), check=True, capture_output=True, text=True
    )
    got = json.loads(out.stdout)
    return got["status"], got["message"]


def with_status(obj: dict[str, Any], **observed: Any) -> dict[str, Any]:
    decided = plan(snapshot(obj, **observed), DEFAULTS, NOW)
    status = decided.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {**obj, "status": status}


def test_measuring_is_in_progress(kstatus: Path) -> None:
    obj = pool_object()
    assert compute(kstatus, with_status(obj))[0] == "InProgress"


def test_rolling_out_is_in_progress_and_ready_is_current(kstatus: Path) -> None:
    obj = pool_object()
    report = report_of(obj)
    live = live_children(snapshot(obj).pool, report)
    ready = with_status(obj, report_cm=report_cm(report), live=live)
    assert compute(kstatus, ready) == ("Current", "Resource is Ready")
    ref = ("apps/v1", "Deployment", "tiny-consumer")
    live[ref] = {**live[ref], "status": {**live[ref]["status"], "availableReplicas": 0}}
    rolling = with_status(obj, report_cm=report_cm(report), live=live)
    assert compute(kstatus, rolling)[0] == "InProgress"
    # A spec the operator has not observed yet.
    edited = {**ready, "metadata": {**ready["metadata"], "generation": 4}}
    assert compute(kstatus, edited)[0] == "InProgress"


def test_a_name_conflict_is_failed(kstatus: Path) -> None:
    obj = pool_object()
    report = report_of(obj)
    live = live_children(snapshot(obj).pool, report)
    ref = ("apps/v1", "Deployment", "tiny-consumer")
    live[ref] = {**live[ref], "metadata": {**live[ref]["metadata"], "ownerReferences": []}}
    status, message = compute(kstatus, with_status(obj, report_cm=report_cm(report), live=live))
    assert status == "Failed"
    assert "tiny-consumer" in message


@pytest.mark.parametrize("reason", sorted(PROBLEM_REASONS))
def test_every_problem_reason_is_failed(kstatus: Path, reason: str) -> None:
    obj = pool_object()
    ready = ConditionUpdate(
        type=READY, status="False", reason=reason, message="m", observed_generation=3
    )
    conditions = with_kstatus(set_condition((), ready, NOW), ready, NOW)
    status = {
        "observedGeneration": 3,
        "conditions": [c.model_dump(mode="json", by_alias=True) for c in conditions],
    }
    assert compute(kstatus, {**obj, "status": status}) == ("Failed", "m")


def test_an_invalid_spec_is_failed(kstatus: Path) -> None:
    obj = pool_object()
    status = invalid_status(obj, "spec.model: bad", NOW)
    got = {**obj, "status": status.model_dump(mode="json", by_alias=True, exclude_none=True)}
    assert compute(kstatus, got) == ("Failed", "spec.model: bad")

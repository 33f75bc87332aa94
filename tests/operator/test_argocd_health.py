"""examples/argocd-health.yaml, run on real Lua 5.1 (what Argo CD's gopher-lua speaks)
against statuses the reconcile's plan writes: Healthy, Progressing and Degraded where a
person would say so."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from encoderpool_operator.conditions import PROBLEM_REASONS
from encoderpool_operator.reconcile.plan import plan
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
KEY = "resource.customizations.health.encoderpool.io_EncoderPool"


@pytest.fixture(scope="module")
def lua() -> str:
    return subprocess.run(
        [str(REPO / "tools" / "lua.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()


def to_lua(value: Any) -> str:
    """A Lua table constructor for a JSON-like value (what Argo CD hands the script)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{json.dumps(k)}] = {to_lua(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "{" + ", ".join(to_lua(v) for v in value) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "nil"
    return json.dumps(value)


def health(lua: str, obj: dict[str, Any]) -> tuple[str, str]:
    script = yaml.safe_load((REPO / "examples" / "argocd-health.yaml").read_text())["data"][KEY]
    program = (
        f"obj = {to_lua(obj)}\n"
        f"local function check()\n{script}\nend\n"
        "local hs = check()\nprint(hs.status)\nprint(hs.message)\n"
    )
    out = subprocess.run([lua, "-"], input=program, check=True, capture_output=True, text=True)
    status, message = out.stdout.split("\n", 1)
    return status, message.strip()


def with_status(obj: dict[str, Any], **observed: Any) -> dict[str, Any]:
    """The pool as Argo CD would see it after the plan's status was written."""
    decided = plan(snapshot(obj, **observed), DEFAULTS, NOW)
    return {**obj, "status": decided.status.model_dump(mode="json", by_alias=True)}


def test_a_new_pool_is_progressing(lua: str) -> None:
    obj = pool_object()
    assert health(lua, obj)[0] == "Progressing"
    status, message = health(lua, with_status(obj))  # measuring widths
    assert status == "Progressing"
    assert "measuring" in message


def test_a_rolled_out_pool_is_healthy_until_its_spec_changes(lua: str) -> None:
    obj = pool_object()
    snap = snapshot(obj)
    report = report_of(obj)
    ready = with_status(obj, report_cm=report_cm(report), live=live_children(snap.pool, report))
    assert health(lua, ready) == (
        "Healthy",
        "widths measured; producers, consumers and router available",
    )
    edited = {**ready, "metadata": {**ready["metadata"], "generation": 4}}
    status, message = health(lua, edited)
    assert (status, message) == ("Progressing", "the operator has not observed generation 4 yet")


def test_a_name_conflict_is_degraded_and_named(lua: str) -> None:
    obj = pool_object()
    snap = snapshot(obj)
    report = report_of(obj)
    live = live_children(snap.pool, report)
    ref = ("apps/v1", "Deployment", "tiny-consumer")
    live[ref] = {**live[ref], "metadata": {**live[ref]["metadata"], "ownerReferences": []}}
    status, message = health(lua, with_status(obj, report_cm=report_cm(report), live=live))
    assert status == "Degraded"
    assert "Deployment ml/tiny-consumer" in message


@pytest.mark.parametrize("reason", sorted(PROBLEM_REASONS))
def test_every_problem_reason_is_degraded(lua: str, reason: str) -> None:
    obj = pool_object()
    obj["status"] = {
        "conditions": [
            {"type": "Ready", "status": "False", "reason": reason, "message": "m",
             "observedGeneration": 3, "lastTransitionTime": "2026-12-01T12:00:00Z"}
        ]
    }  # fmt: skip
    assert health(lua, obj) == ("Degraded", "m")

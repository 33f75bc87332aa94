"""Kubernetes Events about a pool, posted by the pass that saw the change.

Posted directly (one create each) rather than through kopf's poster, which
lives in kopf's per-object tasks and not in the worker threads that run passes.
Only what a person watching ``kubectl describe`` needs: the pool stopped being
Ready, or something is wrong (a reason in PROBLEM_REASONS).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from encoderpool_operator.api import READY, RECONCILING, STALLED
from encoderpool_operator.conditions import PROBLEM_REASONS
from encoderpool_operator.kube import Kube

COMPONENT = "encoderpool-operator"
MAX_MESSAGE = 1024  # the API server's limit on an Event's message


def event(pool: Mapping[str, Any], type_: str, reason: str, message: str) -> dict[str, Any]:
    """A core/v1 Event about ``pool`` (``type_``: Normal or Warning)."""
    meta = pool["metadata"]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta['name'][:200]}.{secrets.token_hex(8)}",
            "namespace": meta["namespace"],
        },
        "involvedObject": {
            "apiVersion": pool["apiVersion"],
            "kind": pool["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": type_,
        "reason": reason[:128],
        "message": message[:MAX_MESSAGE],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def post(kube: Kube, pool: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kube.create(event(pool, type_, reason, message))


def transition_events(
    pool: Mapping[str, Any], transitions: Iterable[tuple[str, str, str]]
) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events a pass posts for its condition changes
    (``transitions``: type, reason, message of each) on ``pool`` as it was before.

    A problem reason is a Warning whatever the condition; Ready is the normal state,
    so leaving it is news (Normal) and reaching it is in the status only.
    """
    was_ready = any(
        c.get("type") == READY and c.get("status") == "True"
        for c in (pool.get("status") or {}).get("conditions", [])
    )
    out = []
    for type_, reason, message in transitions:
        if type_ in (RECONCILING, STALLED):  # they mirror Ready: its Event says it
            continue
        if reason in PROBLEM_REASONS:
            out.append(("Warning", reason, f"{type_}: {message}"))
        elif type_ == READY and was_ready:
            out.append(("Normal", reason, f"{type_}: {message}"))
    return out

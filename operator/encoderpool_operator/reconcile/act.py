"""Act: carry out a plan's writes through ``Kube`` (the only step that writes).

Writes go in phases, each phase's writes at once (``executor``): first what
the workloads refer to (ServiceAccounts, Roles, Services, the PVC, the report
ConfigMap, policies), then the Deployments and Jobs, then deletions, then the
status. Within a phase nothing depends on anything else, so a pass's latency is
a few round trips, not one per child. Each result is handed to ``record`` (the
read cache's overlay), so the next pass sees it before the watch does.

A failed write raises (the first failure, once its phase finished): the pass is
retried, which observes afresh, so a half-done plan is never resumed from stale
reads.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

from encoderpool_operator.api import API_VERSION, KIND, EncoderPoolStatus
from encoderpool_operator.kube import Kube
from encoderpool_operator.reconcile.actions import (
    Action,
    Apply,
    Create,
    CreateSecret,
    Delete,
    MergePatch,
    PatchStatus,
)
from encoderpool_operator.reconcile.plan import status_patch

# (apiVersion, kind, name) written, and the object the server returned (None: deleted).
Recorder = Callable[[tuple[str, str, str], Mapping[str, Any] | None], None]
_WORKLOADS = ("Deployment", "Job")


def phase(action: Action) -> int:
    """0: what workloads refer to; 1: workloads; 2: deletions; 3: the status."""
    match action:
        case Apply(obj=obj) | Create(obj=obj):
            return 1 if obj["kind"] in _WORKLOADS else 0
        case MergePatch() | CreateSecret():
            return 0
        case Delete():
            return 2
    return 3


def _write(kube: Kube, namespace: str, name: str, action: Action, record: Recorder | None) -> None:
    result: Mapping[str, Any] | None
    match action:
        case Apply(obj=obj):
            result = kube.apply(obj)
        case Create(obj=obj):
            result = kube.create(obj, exist_ok=True)
            if result is None:
                return  # someone made it meanwhile: the next pass reads it
        case CreateSecret(obj=obj, random_keys=keys):
            # Fresh values for a new Secret; an existing one (409) keeps its own. Never
            # logged, never cached (the operator cannot read Secrets): nothing recorded.
            data = {key: secrets.token_urlsafe(32) for key in keys}
            kube.create({**obj, "stringData": data}, exist_ok=True)
            return
        case MergePatch(api_version=api_version, kind=kind, name=child, body=body):
            result = kube.patch(api_version, kind, namespace, child, body, action.strategic)
        case Delete(api_version=api_version, kind=kind, name=child):
            kube.delete(api_version, kind, namespace, child)
            result = None
        case PatchStatus(body=body):
            result = kube.patch_status(API_VERSION, KIND, namespace, name, body)
            if result is None:
                return
    if record is not None:
        record(written_ref(action, name), result)


def written_ref(action: Action, pool: str) -> tuple[str, str, str]:
    """(apiVersion, kind, name) of what ``action`` writes (the pool itself for its status)."""
    match action:
        case Apply(obj=obj) | Create(obj=obj):
            return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
        case MergePatch(api_version=a, kind=k, name=n) | Delete(api_version=a, kind=k, name=n):
            return a, k, n
    return API_VERSION, KIND, pool


def act(
    kube: Kube,
    namespace: str,
    name: str,
    actions: tuple[Action, ...],
    executor: Executor | None = None,
    record: Recorder | None = None,
) -> list[str]:
    """Write each action to pool ``namespace/name``'s world; what was written, for the log."""
    for rank in sorted({phase(a) for a in actions}):
        batch = [a for a in actions if phase(a) == rank]
        if executor is None or len(batch) == 1:
            for action in batch:
                _write(kube, namespace, name, action, record)
            continue
        futures = [executor.submit(_write, kube, namespace, name, a, record) for a in batch]
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            raise errors[0]
    return [a.describe() for a in actions if not isinstance(a, PatchStatus)]


def write_status(
    kube: Kube,
    namespace: str,
    name: str,
    current: EncoderPoolStatus | Mapping[str, Any],
    status: EncoderPoolStatus,
) -> dict[str, Any] | None:
    """Patch status only if it differs from what the object carries; the pool if written."""
    body = status_patch(current, status)
    if body is None:
        return None
    return kube.patch_status(API_VERSION, KIND, namespace, name, body)

"""Act: carry out a plan's writes, in order, through ``Kube`` (the only step that writes).

A failed write raises: kopf retries the whole pass, which observes afresh, so
a half-done plan is never resumed from stale reads.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
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


def act(kube: Kube, namespace: str, name: str, actions: tuple[Action, ...]) -> list[str]:
    """Write each action to pool ``namespace/name``'s world; what was written, for the log."""
    done = []
    for action in actions:
        match action:
            case Apply(obj=obj):
                kube.apply(obj)
            case Create(obj=obj):
                kube.create(obj, exist_ok=True)
            case CreateSecret(obj=obj, random_keys=keys):
                # Fresh values for a new Secret; an existing one (409) keeps its own.
                # Never logged: only the Secret's name appears in ``done``.
                data = {key: secrets.token_urlsafe(32) for key in keys}
                kube.create({**obj, "stringData": data}, exist_ok=True)
            case MergePatch(api_version=api_version, kind=kind, name=child, body=body):
                kube.merge_patch(api_version, kind, namespace, child, body)
            case Delete(api_version=api_version, kind=kind, name=child):
                kube.delete(api_version, kind, namespace, child)
            case PatchStatus(body=body):
                kube.patch_status(API_VERSION, KIND, namespace, name, body)
                continue  # the status is not a child: the log names children only
        done.append(action.describe())
    return done


def write_status(
    kube: Kube,
    namespace: str,
    name: str,
    current: EncoderPoolStatus | Mapping[str, Any],
    status: EncoderPoolStatus,
) -> bool:
    """Patch status only if it differs from what the object carries; True if written."""
    body = status_patch(current, status)
    if body is None:
        return False
    kube.patch_status(API_VERSION, KIND, namespace, name, body)
    return True

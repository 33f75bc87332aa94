"""One level-triggered reconcile of an EncoderPool, in three steps:

    observe  (observe.py)  every read of the pass, into one Snapshot (snapshot.py)
    plan     (plan.py)     pure: Snapshot + now -> actions, status, requeue
                           (widths.py decides the width report; compare.py what differs)
    act      (act.py)      the writes, in order (actions.py says what they can be)

It is idempotent: a pass over a pool whose children already match plans no
action, so it writes nothing. A changed model changes the fingerprint, so its
report is missing: the Job measures the new model while the old pods keep
serving, and only then do both roles roll to the new config. No kopf here
(``controller`` runs it, ``handlers`` wires kopf to the controller).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from encoderpool_operator.api import EncoderPoolStatus
from encoderpool_operator.cache import Reader
from encoderpool_operator.kube import Kube
from encoderpool_operator.reconcile.act import Recorder, act, write_status
from encoderpool_operator.reconcile.actions import PatchStatus
from encoderpool_operator.reconcile.observe import observe
from encoderpool_operator.reconcile.plan import invalid_status, plan
from encoderpool_operator.render import Defaults

__all__ = ["Outcome", "invalid_status", "reconcile", "write_status"]

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What one pass did: the status written (or kept), when to look again, what changed."""

    status: EncoderPoolStatus
    requeue_after: float | None = None  # a Job to wait for or a back-off; None: events will do
    transitions: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, msg)
    applied: list[str] = field(default_factory=list)  # "Kind/name" of children written
    wrote_status: bool = False


def reconcile(
    kube: Kube,
    obj: Mapping[str, Any],
    defaults: Defaults,
    now: datetime,
    reader: Reader | None = None,
    executor: Executor | None = None,
    record: Recorder | None = None,
    status_written_at: datetime | None = None,
) -> Outcome:
    """One pass for one pool. Raises ValueError (naming the field) for an invalid spec.

    Reads go to ``reader`` (the operator's cache) or else to ``kube``; writes go to
    ``kube``, each phase's at once on ``executor``, their results to ``record``.
    """
    snap = replace(observe(reader or kube, obj, defaults), status_written_at=status_written_at)
    decided = plan(snap, defaults, now)
    for warning in decided.warnings:
        log.warning("%s", warning)
    applied = act(kube, snap.pool.namespace, snap.pool.name, decided.actions, executor, record)
    wrote_status = any(isinstance(a, PatchStatus) for a in decided.actions)
    return Outcome(
        decided.status, decided.requeue_after, list(decided.transitions), applied, wrote_status
    )

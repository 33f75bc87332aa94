"""Status conditions with Kubernetes semantics, as pure functions.

``lastTransitionTime`` moves only when a condition's status flips (as
kubebuilder's ``meta.SetStatusCondition`` does), so `kubectl wait`, kstatus
and Argo CD see stable times, and a reconcile pass that observes nothing new
produces an identical status (no write).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from encoderpool_contracts import WIDTH_MISMATCH
from encoderpool_operator.api import (
    CHILDREN_OWNED,
    CONSUMERS_AVAILABLE,
    PRODUCERS_AVAILABLE,
    READY,
    RECONCILING,
    ROUTER_AVAILABLE,
    STALLED,
    WIDTHS_MEASURED,
    Condition,
    ConditionUpdate,
)

READY_REASON = "AllAvailable"
# Ready=False although every role serves: the spec's autoscaling cannot work with this
# operator's settings (no Prometheus for KEDA, or scale to zero on the HPA engine).
AUTOSCALING_UNAVAILABLE = "AutoscalingUnavailable"
# Reasons that mean something is wrong and needs a person (Warning events); every other
# reason is progress (Normal events).
PROBLEM_REASONS = frozenset(
    {
        "InvalidSpec",
        "NameConflict",
        "WidthJobFailed",
        "WidthReportInvalid",
        WIDTH_MISMATCH,
        AUTOSCALING_UNAVAILABLE,
    }
)
PENDING_REASON = "Pending"


def find_condition(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of that type, if set."""
    return next((c for c in conditions if c.type == type_), None)


def set_condition(
    conditions: Sequence[Condition], new: ConditionUpdate, now: datetime
) -> tuple[Condition, ...]:
    """Conditions with ``new`` set: replaced in place, or appended if its type is new.

    The time is ``now`` when the type is new or its status differs, else the old
    condition's time; reason, message and observedGeneration always follow ``new``.
    """
    old = find_condition(conditions, new.type)
    since = old.last_transition_time if old is not None and old.status == new.status else now
    made = Condition.model_validate(
        {**new.model_dump(exclude={"last_transition_time"}), "lastTransitionTime": since}
    )
    if old is None:
        return (*conditions, made)
    return tuple(made if c.type == new.type else c for c in conditions)


def with_kstatus(
    conditions: Sequence[Condition], ready: ConditionUpdate, now: datetime
) -> tuple[Condition, ...]:
    """``conditions`` with kstatus' Reconciling and Stalled set from Ready (``ready``).

    kstatus (Flux's health checks, ``kubectl wait``-style tools built on cli-utils) reads
    a custom resource as Failed while Stalled is True and InProgress while Reconciling is
    True; a Ready=False alone reads as InProgress. So a problem a person must act on is
    Stalled, anything else short of Ready is Reconciling; both are absent once Ready.
    """
    problem = ready.status != "True" and ready.reason in PROBLEM_REASONS
    on = STALLED if problem else RECONCILING if ready.status != "True" else None
    kept = tuple(c for c in conditions if c.type not in (RECONCILING, STALLED))
    if on is None:
        return kept
    old = find_condition(conditions, on)  # kept with its time while it stays True
    update = ready.model_copy(update={"type": on, "status": "True"})
    return set_condition((*kept, *((old,) if old else ())), update, now)


def ready_condition(
    conditions: Sequence[Condition], *, router_enabled: bool, observed_generation: int | None
) -> ConditionUpdate:
    """Ready summarizes the others: True when each one that applies is True.

    Otherwise it takes the status and reason of the first that is not True (in
    the order a pool comes up), so `kubectl get` shows what holds the pool back.
    """
    required = [CHILDREN_OWNED, WIDTHS_MEASURED, PRODUCERS_AVAILABLE, CONSUMERS_AVAILABLE]
    if router_enabled:
        required.append(ROUTER_AVAILABLE)
    for type_ in required:
        found = find_condition(conditions, type_)
        if found is None:
            return ConditionUpdate(
                type=READY,
                status="Unknown",
                reason=PENDING_REASON,
                message=f"{type_} not yet observed",
                observed_generation=observed_generation,
            )
        if found.status != "True":
            return ConditionUpdate(
                type=READY,
                status=found.status,
                reason=found.reason,
                message=f"{type_}: {found.message}" if found.message else type_,
                observed_generation=observed_generation,
            )
    return ConditionUpdate(
        type=READY,
        status="True",
        reason=READY_REASON,
        message="widths measured; producers, consumers and router available",
        observed_generation=observed_generation,
    )

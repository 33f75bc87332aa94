"""The plan's part of autoscaling: which autoscalers to withhold, and ``status.autoscaling``.

Pure, like the plan: from the ``Snapshot`` (the pool's Deployments, its ScaledObjects or
HPAs, and the HPAs KEDA made for them) to decisions.

An autoscaler moves a Deployment, and KEDA makes (or takes over, whoever owns it) an
HPA of the name the operator gives it. So one is rendered only while the Deployment it
scales exists and is the pool's, and while that HPA name is free, the pool's (HPA
engine) or its ScaledObject's (KEDA). Someone else's object there withholds it, and
ChildrenOwned says which and why; the other engine's autoscaler still there (after the
operator's engine changed) withholds it until that one is gone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from encoderpool_operator.api import AutoscalerStatus
from encoderpool_operator.api.status import REASON_PATTERN
from encoderpool_operator.reconcile.snapshot import Snapshot
from encoderpool_operator.render import Defaults
from encoderpool_operator.render.autoscaling import (
    Scaler,
    hpa_ref,
    rendered_scalers,
    scaler_ref,
    scalers,
)

# The reasons a withheld autoscaler reports (status.autoscaling[].reason).
NAME_CONFLICT = "NameConflict"
WAITING_FOR_DEPLOYMENT = "WaitingForDeployment"
REPLACING = "Replacing"
MAX_MESSAGE = 1024


@dataclass(frozen=True)
class Withheld:
    """Why one role's autoscaler is not rendered this pass."""

    reason: str
    message: str
    conflict: bool  # someone else's object: a NameConflict until a person acts


def _where(snap: Snapshot, kind: str, name: str) -> str:
    return f"{kind} {snap.pool.namespace}/{name}"


def withheld_autoscalers(snap: Snapshot, defaults: Defaults) -> dict[str, Withheld]:
    """The roles (by component) whose autoscaler must not be rendered, and why."""
    engine = defaults.autoscaling_engine
    out: dict[str, Withheld] = {}
    for s in rendered_scalers(snap.pool, engine, defaults.prometheus_address):
        why = _withheld(snap, engine, s)
        if why is not None:
            out[s.component] = why
    return out


def _withheld(snap: Snapshot, engine: str, s: Scaler) -> Withheld | None:
    deployment = snap.child(("apps/v1", "Deployment", s.deployment))
    dep = _where(snap, "Deployment", s.deployment)
    if deployment is None:
        return Withheld(WAITING_FOR_DEPLOYMENT, f"waiting for {dep} to be created", False)
    if not snap.ours(deployment):
        return Withheld(
            NAME_CONFLICT, f"{dep} is not controlled by this pool, and it would scale it", True
        )
    hpa = snap.child(hpa_ref(s))
    where = _where(snap, "HorizontalPodAutoscaler", s.hpa_name)
    if engine == "keda":
        scaled = snap.child(scaler_ref("keda", s))
        if scaled is not None and not snap.ours(scaled):
            return Withheld(
                NAME_CONFLICT,
                f"{_where(snap, 'ScaledObject', s.name)} is not controlled by this pool",
                True,
            )
        if hpa is None or snap.made_by_ours(hpa):
            return None
        if snap.ours(hpa):
            return Withheld(
                REPLACING, f"{where} of the hpa engine goes first (it is being deleted)", False
            )
        return Withheld(
            NAME_CONFLICT,
            f"{where} is not controlled by this pool's ScaledObject, and KEDA would take it over",
            True,
        )
    if hpa is None or snap.ours(hpa):
        return None
    if snap.made_by_ours(hpa):
        return Withheld(
            REPLACING,
            f"{where} is still KEDA's: it goes with this pool's ScaledObject {s.name}, which "
            "is being deleted (if it stays, KEDA is not running to remove its finalizer)",
            False,
        )
    return Withheld(NAME_CONFLICT, f"{where} is not controlled by this pool", True)


def conflict_text(snap: Snapshot, defaults: Defaults, withheld: Mapping[str, Withheld]) -> str:
    """What ChildrenOwned adds for each autoscaler a foreign object withholds."""
    kind = "ScaledObject" if defaults.autoscaling_engine == "keda" else "HorizontalPodAutoscaler"
    names = {s.component: s.name for s in scalers(snap.pool)}
    return "; ".join(
        f"{_where(snap, kind, names[c])} is withheld: {w.message}"
        for c, w in sorted(withheld.items())
        if w.conflict
    )


def _conditions(obj: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    found = ((obj or {}).get("status") or {}).get("conditions") or []
    return {
        c["type"]: c for c in found if isinstance(c, Mapping) and isinstance(c.get("type"), str)
    }


def _reason(cond: Mapping[str, Any] | None, fallback: str) -> str:
    """The autoscaler's own reason when it is one (CamelCase, bounded), else ours."""
    text = (cond or {}).get("reason")
    ok = isinstance(text, str) and len(text) <= 128 and re.fullmatch(REASON_PATTERN, text)
    return str(text) if ok else fallback


def _message(cond: Mapping[str, Any] | None) -> str:
    return str((cond or {}).get("message") or "")[:MAX_MESSAGE]


def _count(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 10000
    return value if ok else None


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def _keda_activity(snap: Snapshot, s: Scaler) -> tuple[bool, str, str]:
    scaled = snap.child(scaler_ref("keda", s))
    where = _where(snap, "ScaledObject", s.name)
    if scaled is None or not snap.ours(scaled):
        return False, "NotCreated", f"{where} not created yet"
    conds = _conditions(scaled)
    ready, active = conds.get("Ready"), conds.get("Active")
    if ready is None:
        return False, "Pending", f"KEDA has not reported on {where} yet (is KEDA running?)"
    if ready.get("status") != "True":
        return False, _reason(ready, "NotReady"), _message(ready)
    if active is None or active.get("status") != "True":
        return False, _reason(active, "NotActive"), _message(active)
    return True, _reason(active, "Active"), _message(active)


def _hpa_activity(
    snap: Snapshot, s: Scaler, hpa: Mapping[str, Any] | None
) -> tuple[bool, str, str]:
    where = _where(snap, "HorizontalPodAutoscaler", s.hpa_name)
    if hpa is None:
        return False, "NotCreated", f"{where} not created yet"
    conds = _conditions(hpa)
    scaling, able = conds.get("ScalingActive"), conds.get("AbleToScale")
    if scaling is None:
        return False, "Pending", f"the HPA controller has not reported on {where} yet"
    if scaling.get("status") != "True":
        return False, _reason(scaling, "ScalingInactive"), _message(scaling)
    if able is not None and able.get("status") == "False":
        return False, _reason(able, "NotAbleToScale"), _message(able)
    return True, _reason(scaling, "ScalingActive"), _message(scaling)


def autoscaling_status(
    snap: Snapshot,
    defaults: Defaults,
    withheld: Mapping[str, Withheld],
    problem: str | None,
) -> tuple[AutoscalerStatus, ...] | None:
    """Each autoscaling role's autoscaler as it reports itself; None when none autoscales.

    Replicas and the last scale come from the HPA that drives the Deployment (KEDA's or
    the operator's); whether it is active from KEDA's ScaledObject conditions (Ready,
    Active) or the HPA's (ScalingActive, AbleToScale). A withheld one, or autoscaling
    that cannot work with this operator, says so instead.
    """
    engine = defaults.autoscaling_engine
    out = []
    for s in scalers(snap.pool):
        hpa = snap.child(hpa_ref(s))
        mine = snap.made_by_ours(hpa) if engine == "keda" else snap.ours(hpa)
        hpa = hpa if mine else None
        # KEDA without a Prometheus renders nothing; the HPA engine fails only at zero.
        if problem is not None and (engine == "keda" or s.settings.min_replicas == 0):
            active, reason, message = False, "AutoscalingUnavailable", problem
        elif s.component in withheld:
            why = withheld[s.component]
            active, reason, message = False, why.reason, why.message
        elif engine == "keda":
            active, reason, message = _keda_activity(snap, s)
        else:
            active, reason, message = _hpa_activity(snap, s, hpa)
        st = (hpa or {}).get("status") or {}
        out.append(
            AutoscalerStatus(
                role=s.component,
                group=s.group,
                engine=engine,
                name=s.name,
                min_replicas=s.settings.min_replicas,
                max_replicas=s.settings.max_replicas,
                current_replicas=_count(st.get("currentReplicas")),
                desired_replicas=_count(st.get("desiredReplicas")),
                active=active,
                reason=reason,
                message=message[:MAX_MESSAGE],
                last_scale_time=_time(st.get("lastScaleTime")),
            )
        )
    return tuple(out) or None

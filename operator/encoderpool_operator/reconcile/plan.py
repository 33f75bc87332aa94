"""Plan: a pure function from what was observed (and the spec inside it) to the writes and status.

    objects with a child's name that the pool does not control -> never touched,
         ChildrenOwned=False names them, and each autoscaler withheld for one (scaling.py)
    widths (reuse the report, take it from the Job, or measure)
      -> with a report: render the children (pure), apply only those that differ
         (each carries a digest of itself, so a removed field is a difference too),
         create the pool's internal Secret in a pass that writes a Deployment,
         delete width Jobs of earlier models
    children the pool controls that the spec no longer names -> deleted
    Deployments observed -> conditions -> status, written only when it changed

No I/O and no clock: the same ``Snapshot`` and ``now`` always give the same
``Plan``, which is what lets tests cover many cases without a cluster, and a
pass whose children already match plans no action at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from encoderpool_contracts import WIDTH_MISMATCH, configmap_name
from encoderpool_operator.api import (
    CHILDREN_OWNED,
    CONSUMERS_AVAILABLE,
    PRODUCERS_AVAILABLE,
    READY,
    ROUTER_AVAILABLE,
    ConditionUpdate,
    EncoderPool,
    EncoderPoolStatus,
    ProducerGroupStatus,
    ReplicaStatus,
    RoleSpec,
)
from encoderpool_operator.conditions import (
    AUTOSCALING_UNAVAILABLE,
    PROBLEM_REASONS,
    ready_condition,
    set_condition,
    with_kstatus,
)
from encoderpool_operator.naming import (
    CONSUMER,
    PRODUCER,
    ROUTER,
    Ref,
    group_component,
    name_of,
    ref_of,
    vllm_components,
)
from encoderpool_operator.reconcile.actions import (
    Action,
    Apply,
    Create,
    CreateSecret,
    Delete,
    PatchStatus,
)
from encoderpool_operator.reconcile.compare import is_subset
from encoderpool_operator.reconcile.scaling import (
    autoscaling_status,
    conflict_text,
    withheld_autoscalers,
)
from encoderpool_operator.reconcile.snapshot import Snapshot
from encoderpool_operator.reconcile.widths import plan_widths
from encoderpool_operator.render import Defaults, Observed, child_refs, workload_objects
from encoderpool_operator.render.autoscaling import autoscaling_problem
from encoderpool_operator.render.router import router_endpoint, router_services
from encoderpool_operator.render.secret import INTERNAL_KEYS, internal_secret

# How often a pool's rollout progress (replica counts, messages) is written at most:
# a vLLM pod takes minutes to load its model, so half a minute still shows movement,
# while a condition flipping or a problem is written at once.
PROGRESS_SECONDS = 30.0


@dataclass(frozen=True)
class Plan:
    """One pass's decisions: writes in order, the status they lead to, when to look again."""

    actions: tuple[Action, ...]
    status: EncoderPoolStatus
    requeue_after: float | None = None  # a Job to wait for or a back-off; None: events will do
    transitions: tuple[tuple[str, str, str], ...] = ()  # conditions that changed: type, reason, msg
    warnings: tuple[str, ...] = ()  # for the log: e.g. a report ConfigMap that does not parse


def replica_status(deployment: Mapping[str, Any] | None, desired: int) -> ReplicaStatus:
    st = (deployment or {}).get("status", {})
    return ReplicaStatus(
        desired=desired, ready=st.get("readyReplicas", 0), available=st.get("availableReplicas", 0)
    )


def desired_replicas(role: RoleSpec, deployment: Mapping[str, Any] | None) -> int:
    """The pods a role should have: its spec's count, or while it autoscales, the count
    its autoscaler last set on the Deployment (0 for a role asleep at zero)."""
    if role.autoscaling is None:
        return role.replicas
    replicas = ((deployment or {}).get("spec") or {}).get("replicas")
    return replicas if isinstance(replicas, int) else max(role.autoscaling.min_replicas, 1)


def availability(
    type_: str, what: str, deployment: Mapping[str, Any] | None, desired: int, gen: int | None
) -> ConditionUpdate:
    """Available when every desired pod is updated and available (a finished rollout)."""
    if deployment is None:
        return ConditionUpdate(
            type=type_,
            status="False",
            reason="NotCreated",
            message=f"{what} Deployment not created yet",
            observed_generation=gen,
        )
    st = deployment.get("status", {})
    if st.get("observedGeneration", 0) < deployment["metadata"].get("generation", 0):
        reason, text, ok = "RollingOut", "rollout not observed yet", False
    elif st.get("updatedReplicas", 0) < desired:
        reason, ok = "RollingOut", False
        text = f"{st.get('updatedReplicas', 0)}/{desired} pods updated"
    elif st.get("availableReplicas", 0) < desired:
        reason, ok = "PodsNotReady", False
        text = f"{st.get('availableReplicas', 0)}/{desired} pods available"
    else:
        reason, text, ok = "Available", f"{desired}/{desired} pods available", True
    return ConditionUpdate(
        type=type_,
        status="True" if ok else "False",
        reason=reason,
        message=f"{what}: {text}",
        observed_generation=gen,
    )


def refused(cond: ConditionUpdate, snap: Snapshot, component: str, what: str) -> ConditionUpdate:
    """An unavailable role whose pods refuse to start on the width report says so: the
    report (reused, or measured with another image or node) disagrees with what the
    pods' own vLLM measured at start-up, and only measuring again mends it."""
    if cond.status == "True" or component not in snap.refusals:
        return cond
    pod, said = snap.refusals[component]
    report = configmap_name(snap.report_key)
    return cond.model_copy(
        update={
            "reason": WIDTH_MISMATCH,
            "message": f"{what}: pod {pod} refused to start: its vLLM measured other encoder "
            f"output widths than the width report ({said.summary()}); the report in "
            f"ConfigMap {report} is stale or was measured with another image: delete it and "
            "the operator measures again",
        }
    )


def invalid_status(obj: Mapping[str, Any], message: str, now: datetime) -> EncoderPoolStatus:
    """Status for a pool the operator cannot parse: Ready=False naming the field."""
    current = current_status(obj)
    gen = obj.get("metadata", {}).get("generation")
    update = ConditionUpdate(
        type=READY,
        status="False",
        reason="InvalidSpec",
        message=message[:32000],
        observed_generation=gen,
    )
    return current.model_copy(
        update={
            "conditions": with_kstatus(set_condition(current.conditions, update, now), update, now),
            "observed_generation": gen,
        }
    )


def current_status(obj: Mapping[str, Any]) -> EncoderPoolStatus:
    try:
        return EncoderPoolStatus.model_validate(dict(obj.get("status") or {}))
    except ValidationError:
        return EncoderPoolStatus()  # foreign or stale fields: start afresh


def status_body(status: EncoderPoolStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def status_patch(
    current: EncoderPoolStatus | Mapping[str, Any], status: EncoderPoolStatus
) -> dict[str, Any] | None:
    """The merge patch from ``current`` to ``status``; None when they are equal (no write)."""
    old = status_body(current) if isinstance(current, EncoderPoolStatus) else dict(current)
    body = status_body(status)
    if body == old:
        return None
    # A merge patch cannot remove keys by omission: null out what we no longer report.
    for key in old:
        body.setdefault(key, None)
    return body


def ownership(snap: Snapshot, withheld_text: str = "") -> ConditionUpdate:
    """ChildrenOwned: False, naming each object, while another owner holds a child's name;
    ``withheld_text`` names the autoscalers withheld for such objects."""
    gen = snap.pool.generation
    foreign = snap.foreign()
    if not foreign and not withheld_text:
        return ConditionUpdate(
            type=CHILDREN_OWNED,
            status="True",
            reason="Owned",
            message="every child is controlled by this pool",
            observed_generation=gen,
        )
    names = ", ".join(f"{kind} {snap.pool.namespace}/{name}" for _, kind, name in foreign)
    text = (
        f"{names} already exists and is not controlled by this pool, so the operator "
        "leaves it alone: delete or rename it (or give the pool another name)"
        if foreign
        else ""
    )
    return ConditionUpdate(
        type=CHILDREN_OWNED,
        status="False",
        reason="NameConflict",
        message="; ".join(t for t in (text, withheld_text) if t),
        observed_generation=gen,
    )


def foreign_router_services(pool: EncoderPool, foreign: set[Ref]) -> list[str]:
    """The Services the router would follow (``render.router.router_services``) that another
    owner holds: the router would take its backends from their EndpointSlices, so it
    is not deployed while any is foreign."""
    if not pool.spec.router.enabled:
        return []
    return [n for n in router_services(pool) if ("v1", "Service", n) in foreign]


def router_blocked(pool: EncoderPool, services: Sequence[str], gen: int | None) -> ConditionUpdate:
    names = ", ".join(f"Service {pool.namespace}/{n}" for n in services)
    return ConditionUpdate(
        type=ROUTER_AVAILABLE,
        status="False",
        reason="ServiceNotOwned",
        message=f"router not deployed: {names} is not controlled by this pool, and the router "
        "would take its backends from its EndpointSlices; delete or rename it",
        observed_generation=gen,
    )


def with_internal_secret(pool: EncoderPool, applies: list[Apply]) -> list[Action]:
    """``applies``, with the pool's internal Secret created before the first Deployment.

    The operator may not read Secrets (that would be every Secret of the namespace),
    so it cannot see whether ``<pool>-internal`` exists; it creates it in each pass
    that writes a Deployment (which is what refers to it): the first pass, every
    rollout and every spec change. An existing Secret answers 409 and keeps its
    values. A pass that writes no Deployment sends nothing, so a resync of an
    unchanged pool still writes nothing at all.
    """
    first = next((i for i, a in enumerate(applies) if a.obj["kind"] == "Deployment"), None)
    if first is None:
        return list(applies)
    secret = CreateSecret(internal_secret(pool), INTERNAL_KEYS)
    return [*applies[:first], secret, *applies[first:]]


def _writes_to(action: Action) -> Ref | None:
    if isinstance(action, (Apply, Create)):
        return ref_of(action.obj)
    return None


def plan(snap: Snapshot, defaults: Defaults, now: datetime) -> Plan:
    """One pass for one pool, decided: see the module docstring."""
    pool = snap.pool
    gen = pool.generation
    widths = plan_widths(snap, defaults.width_retry_seconds, now)
    foreign = set(snap.foreign())
    actions: list[Action] = [a for a in widths.actions if _writes_to(a) not in foreign]
    withheld = withheld_autoscalers(snap, defaults)
    updates: list[ConditionUpdate] = [
        ownership(snap, conflict_text(snap, defaults, withheld)),
        widths.condition,
    ]
    status_fields: dict[str, Any] = {
        "observed_generation": gen,
        "model_fingerprint": snap.fingerprint,
        "width_report_name": configmap_name(snap.report_key),
        "router_endpoint": router_endpoint(pool),
    }
    report = widths.report
    blocked = foreign_router_services(pool, foreign)
    router_ref = ("apps/v1", "Deployment", name_of(pool, ROUTER))
    if report is not None:
        observed = Observed(
            {d["metadata"]["name"]: d for c in vllm_components(pool) if (d := snap.deployment(c))},
            frozenset(withheld),
        )
        applies = [
            Apply(child)
            for child in workload_objects(pool, report, defaults, observed)
            if ref_of(child) not in foreign
            and not (blocked and ref_of(child) == router_ref)
            and not is_subset(child, snap.child(ref_of(child)))
        ]
        actions += with_internal_secret(pool, applies)
        for job in snap.width_jobs:  # their models are not this pool's any more
            if job["metadata"]["name"] != snap.job_name:
                actions.append(Delete("batch/v1", "Job", job["metadata"]["name"], "stale model"))
        status_fields.update(
            transport=pool.spec.connector.transport,
            encoder_output_widths=dict(report.encoder_output_widths),
            bytes_per_token=dict(report.bytes_per_token),
            hidden_size=report.hidden_size,
            encode_seconds=dict(report.encode_seconds) or None,
        )

    # An autoscaler withheld for someone else's object goes; one waiting (for its new
    # Deployment, or for the other engine's to go) is kept as it is.
    conflicts = frozenset(c for c, w in withheld.items() if w.conflict)
    wanted = set(child_refs(pool, defaults, conflicts))
    if blocked:
        wanted.discard(router_ref)
    withheld_refs = set(child_refs(pool, defaults)) - wanted
    for ref in sorted(set(snap.owned) - wanted):
        blocked_router = bool(blocked) and ref == router_ref
        why = "its Services are not this pool's" if blocked_router else "no longer in the spec"
        if ref in withheld_refs and not blocked_router:
            why = "withheld: its Deployment or HorizontalPodAutoscaler is not this pool's"
        actions.append(Delete(*ref, why))

    roles: Sequence[tuple[str, str, str, int | RoleSpec]] = [
        (CONSUMERS_AVAILABLE, "consumers", CONSUMER, pool.spec.consumer),
    ]
    if pool.spec.router.enabled:
        roles = [*roles, (ROUTER_AVAILABLE, "router", ROUTER, pool.spec.router.replicas)]
    if pool.spec.producer_groups:
        producers, groups = producer_groups(snap, gen)
        status_fields["producers"] = producers.replicas
        status_fields["producer_groups"] = groups
        updates.append(
            _unless_measured(producers.condition, "producers", report is None, producers.exists)
        )
    else:
        roles = [(PRODUCERS_AVAILABLE, "producers", PRODUCER, pool.spec.producer), *roles]
        status_fields["producer_groups"] = None
    for type_, what, component, role in roles:
        dep = snap.deployment(component)
        desired = role if isinstance(role, int) else desired_replicas(role, dep)
        status_fields[what] = replica_status(dep, desired)
        cond = refused(availability(type_, what, dep, desired, gen), snap, component, what)
        if blocked and component == ROUTER:
            cond = router_blocked(pool, blocked, gen)
        updates.append(_unless_measured(cond, what, report is None, dep is not None))
    # No requeue for a rollout: each Deployment status change is an event that runs the
    # next pass (and the resync timer catches anything missed).
    if not pool.spec.router.enabled:
        status_fields["router"] = None

    conditions = pool.status.conditions
    for update in updates:
        conditions = set_condition(conditions, update, now)
    conditions = tuple(
        c for c in conditions if c.type != ROUTER_AVAILABLE or pool.spec.router.enabled
    )
    ready = ready_condition(
        conditions, router_enabled=pool.spec.router.enabled, observed_generation=gen
    )
    problem = autoscaling_problem(pool, defaults.autoscaling_engine, defaults.prometheus_address)
    status_fields["autoscaling"] = autoscaling_status(snap, defaults, withheld, problem)
    if problem is not None and ready.status == "True":  # it serves, but not as asked
        ready = ready.model_copy(
            update={"status": "False", "reason": AUTOSCALING_UNAVAILABLE, "message": problem}
        )
    conditions = with_kstatus(set_condition(conditions, ready, now), ready, now)
    new_status = pool.status.model_copy(update={**status_fields, "conditions": conditions})
    new_status = EncoderPoolStatus.model_validate(new_status.model_dump(by_alias=True))

    old = {c.type: (c.status, c.reason) for c in pool.status.conditions}
    transitions = tuple(
        (c.type, c.reason, c.message)
        for c in new_status.conditions
        if old.get(c.type) != (c.status, c.reason)
    )
    requeue = widths.requeue_after
    if (patch := status_patch(pool.status, new_status)) is not None:
        hold = progress_hold(pool.status, new_status, snap.status_written_at, now)
        if hold > 0:  # progress only, written a moment ago: write it later, batched
            requeue = hold if requeue is None else min(requeue, hold)
        else:
            actions.append(PatchStatus(patch))
    return Plan(tuple(actions), new_status, requeue, transitions, widths.warnings)


def _unless_measured(
    cond: ConditionUpdate, what: str, unmeasured: bool, exists: bool
) -> ConditionUpdate:
    """A Deployment that exists while the model's widths are not measured waits for them."""
    if not unmeasured or not exists:
        return cond
    return cond.model_copy(
        update={
            "status": "False",
            "reason": "WaitingForWidths",
            "message": f"{what}: waiting for the new model's widths",
        }
    )


@dataclass(frozen=True)
class GroupsObserved:
    """The producer groups, summed: for status.producers and ProducersAvailable."""

    replicas: ReplicaStatus
    condition: ConditionUpdate
    exists: bool  # any group's Deployment exists


def producer_groups(
    snap: Snapshot, gen: int | None
) -> tuple[GroupsObserved, tuple[ProducerGroupStatus, ...]]:
    """Each group's pod counts, their sum, and ProducersAvailable over all groups: True
    when every group is available, else the first group that is not, naming each."""
    pool = snap.pool
    groups: list[ProducerGroupStatus] = []
    waiting: list[ConditionUpdate] = []
    exists = False
    for group in pool.spec.producer_groups:
        component = group_component(group)
        dep = snap.deployment(component)
        desired = desired_replicas(group.role(pool.spec.producer), dep)
        exists = exists or dep is not None
        counts = replica_status(dep, desired)
        groups.append(ProducerGroupStatus(name=group.name, **counts.model_dump()))
        cond = availability(PRODUCERS_AVAILABLE, f"producer group {group.name}", dep, desired, gen)
        cond = refused(cond, snap, component, f"producer group {group.name}")
        if cond.status != "True":
            waiting.append(cond)
    total = ReplicaStatus(
        desired=sum(g.desired for g in groups),
        ready=sum(g.ready for g in groups),
        available=sum(g.available for g in groups),
    )
    if waiting:
        condition = waiting[0].model_copy(
            update={"message": "producers: " + "; ".join(c.message for c in waiting)}
        )
    else:
        condition = ConditionUpdate(
            type=PRODUCERS_AVAILABLE,
            status="True",
            reason="Available",
            message="producers: "
            + "; ".join(f"group {g.name} {g.desired}/{g.desired} pods available" for g in groups),
            observed_generation=gen,
        )
    return GroupsObserved(total, condition, exists), tuple(groups)


def _shape(status: EncoderPoolStatus) -> Any:
    """What a status says apart from progress: whether the pool is Ready, its problems,
    and what it was rendered from. Replica counts, each role's availability and how far
    a rollout got are progress (Ready turning True is the end of it)."""
    ready = next((c.status for c in status.conditions if c.type == READY), None)
    problems = sorted((c.type, c.reason) for c in status.conditions if c.reason in PROBLEM_REASONS)
    progress = {"producers", "producer_groups", "producer_groups_summary", "consumers", "router"}
    rest = status.model_dump(
        exclude={"conditions", "autoscaling", "autoscaling_summary", *progress}
    )
    # An autoscaler's counts and last scale are progress; its engine, bounds and whether
    # it is active (and why not) are not.
    scaling = [
        (a.role, a.engine, a.min_replicas, a.max_replicas, a.active, a.reason)
        for a in status.autoscaling or ()
    ]
    return ready, problems, rest, scaling


def progress_hold(
    current: EncoderPoolStatus,
    new: EncoderPoolStatus,
    written_at: datetime | None,
    now: datetime,
) -> float:
    """Seconds to hold a status write back (0: write now).

    A rollout moves a pool's replica counts and conditions every second or so; writing
    each step costs a write per step per pool (hundreds a second at scale). Steps are
    therefore written at most every PROGRESS_SECONDS; anything else (Ready turning True
    or False, a problem, a new generation) is written at once.
    """
    if written_at is None or _shape(current) != _shape(new):
        return 0.0
    return max(0.0, PROGRESS_SECONDS - (now - written_at).total_seconds())

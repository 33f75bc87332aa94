"""``EncoderPool.status``: what the operator observed, written by the operator only.

Conditions follow metav1.Condition (type/status/reason/message/
observedGeneration/lastTransitionTime), so `kubectl wait`, kstatus and Argo CD
read them; ``conditions`` holds the rules of how they change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from encoderpool_contracts import MAX_ENCODE_SECONDS
from encoderpool_operator.api.schema import ApiModel, Modality, Timestamp

# Condition types (PascalCase adjectives, kstatus-friendly).
CHILDREN_OWNED = "ChildrenOwned"
WIDTHS_MEASURED = "WidthsMeasured"
PRODUCERS_AVAILABLE = "ProducersAvailable"
CONSUMERS_AVAILABLE = "ConsumersAvailable"
ROUTER_AVAILABLE = "RouterAvailable"
READY = "Ready"
# kstatus' abnormal-true conditions (what Flux's health checks read), mirroring Ready:
# Reconciling while the pool comes up or changes, Stalled while a person must act.
# Present only while True.
RECONCILING = "Reconciling"
STALLED = "Stalled"
CONDITION_TYPES = (
    CHILDREN_OWNED,
    WIDTHS_MEASURED,
    PRODUCERS_AVAILABLE,
    CONSUMERS_AVAILABLE,
    ROUTER_AVAILABLE,
    READY,
    RECONCILING,
    STALLED,
)

# The API server checks schema bounds as float64; beyond 2**53 they stop being integers.
MAX_GENERATION = (1 << 53) - 1

# metav1.Condition's reason: CamelCase, starts with a letter.
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
CONDITION_TYPE_PATTERN = r"^[A-Z][A-Za-z0-9]*$"


class ConditionUpdate(ApiModel):
    """A condition as the reconcile computes it; ``conditions.set_condition`` adds the time."""

    type: str = Field(
        min_length=1,
        max_length=64,
        pattern=CONDITION_TYPE_PATTERN,
        description="Condition type: " + ", ".join(CONDITION_TYPES) + ".",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=REASON_PATTERN,
        description="Why, in CamelCase, for machines (e.g. JobRunning).",
    )
    message: str = Field(default="", max_length=32768, description="Why, for humans.")
    observed_generation: int | None = Field(
        default=None,
        ge=0,
        le=MAX_GENERATION,
        description="metadata.generation the condition was computed from.",
    )


class Condition(ConditionUpdate):
    """One aspect of the pool's state (metav1.Condition's shape)."""

    last_transition_time: Timestamp = Field(
        description="When status last changed (not when the condition was last computed)."
    )


class ReplicaStatus(ApiModel):
    """Pod counts of one Deployment, as its status reports them."""

    desired: int = Field(default=0, ge=0, le=10000, description="Pods the spec asks for.")
    ready: int = Field(default=0, ge=0, le=10000, description="Pods passing readiness.")
    available: int = Field(
        default=0, ge=0, le=10000, description="Pods ready for at least minReadySeconds."
    )
    summary: str = Field(
        default="0/0",
        max_length=16,
        pattern=r"^[0-9]+/[0-9]+$",
        description="ready/desired, for `kubectl get` (derived; any value given is replaced).",
    )

    @model_validator(mode="before")
    @classmethod
    def _derive_summary(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            data = dict(data)
            data["summary"] = f"{data.get('ready', 0)}/{data.get('desired', 0)}"
        return data


class ProducerGroupStatus(ReplicaStatus):
    """Pod counts of one producer group's Deployment."""

    name: str = Field(max_length=16, description="The group's name (spec.producerGroups).")


class AutoscalerStatus(ApiModel):
    """One autoscaling role's autoscaler, as it reports itself (engine, bounds, scale)."""

    role: str = Field(
        max_length=32,
        description="The role's component: producer, producer-<group> or consumer.",
    )
    group: str | None = Field(
        default=None, max_length=16, description="The producer group (spec.producerGroups)."
    )
    engine: Literal["keda", "hpa"] = Field(
        description="keda (a ScaledObject, and the HorizontalPodAutoscaler KEDA makes for "
        "it) or hpa (a HorizontalPodAutoscaler of the operator's)."
    )
    name: str = Field(
        max_length=63,
        description="The ScaledObject or HorizontalPodAutoscaler, named like the role's "
        "Deployment (KEDA's HorizontalPodAutoscaler too).",
    )
    min_replicas: int = Field(ge=0, le=10000, description="spec's minReplicas.")
    max_replicas: int = Field(ge=0, le=10000, description="spec's maxReplicas.")
    current_replicas: int | None = Field(
        default=None,
        ge=0,
        le=10000,
        description="Pods the autoscaler last saw (its HorizontalPodAutoscaler's "
        "status.currentReplicas).",
    )
    desired_replicas: int | None = Field(
        default=None,
        ge=0,
        le=10000,
        description="Pods the autoscaler last asked for (status.desiredReplicas: the count "
        "it last computed, 0 until it has computed one).",
    )
    active: bool = Field(
        default=False,
        description="Whether the autoscaler scales the role now: KEDA's ScaledObject Ready "
        "and Active; an HPA's ScalingActive (and AbleToScale not False).",
    )
    reason: str = Field(
        min_length=1,
        max_length=128,
        pattern=REASON_PATTERN,
        description="Why it is or is not active, in CamelCase: the autoscaler's own reason "
        "(e.g. ScalerNotActive, FailedGetExternalMetric), or the operator's "
        "(NameConflict, WaitingForDeployment, Replacing, NotCreated, "
        "AutoscalingUnavailable).",
    )
    message: str = Field(default="", max_length=1024, description="Why, for humans.")
    last_scale_time: Timestamp | None = Field(
        default=None, description="When the autoscaler last changed the role's replicas."
    )


def _field(item: Any, name: str, alias: str) -> Any:
    """A field of a model or of its dict (by alias or by name): how a status arrives."""
    if isinstance(item, Mapping):
        return item.get(alias, item.get(name))
    return getattr(item, name, None)


def _count(value: Any) -> str:
    return "-" if value is None else str(value)


def autoscaler_summary(item: Any) -> str:
    """<role> <current>/<desired> (<min>-<max>), and `inactive` while it is not active."""
    current = _count(_field(item, "current_replicas", "currentReplicas"))
    desired = _count(_field(item, "desired_replicas", "desiredReplicas"))
    low = _count(_field(item, "min_replicas", "minReplicas"))
    high = _count(_field(item, "max_replicas", "maxReplicas"))
    text = f"{_field(item, 'role', 'role')} {current}/{desired} ({low}-{high})"
    return text if _field(item, "active", "active") else f"{text} inactive"


# The derived fields of EncoderPoolStatus, as given by alias or by name.
_SUMMARIES = frozenset(
    {
        "producerGroupsSummary",
        "producer_groups_summary",
        "autoscalingSummary",
        "autoscaling_summary",
    }
)


class EncoderPoolStatus(ApiModel):
    """Observed state, written by the operator only."""

    observed_generation: int | None = Field(
        default=None,
        ge=0,
        le=MAX_GENERATION,
        description="metadata.generation of the spec this status reflects.",
    )
    conditions: tuple[Condition, ...] = Field(
        default=(),
        max_length=16,
        description="ChildrenOwned, WidthsMeasured, ProducersAvailable, ConsumersAvailable, "
        "RouterAvailable (with a router) and Ready: True when all the others are, else the "
        "reason of the first that is not; and kstatus' Reconciling (while the pool comes up "
        "or changes) and Stalled (while a person must act), present only while True.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    transport: Literal["sharedVolume", "rdma"] | None = Field(
        default=None, description="Connector transport the pods were last rendered with."
    )
    model_fingerprint: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{16}$",
        max_length=16,
        description="Fingerprint of the model as served (keys the width report).",
    )
    width_report_name: str | None = Field(
        default=None,
        max_length=253,
        description="ConfigMap in the pool's namespace that holds the width report.",
    )
    encoder_output_widths: dict[Modality, Annotated[int, Field(ge=1, le=1 << 20)]] = Field(
        default_factory=dict,
        max_length=8,
        description="Measured encoder output width per modality.",
    )
    bytes_per_token: dict[Modality, Annotated[int, Field(ge=1, le=1 << 24)]] = Field(
        default_factory=dict,
        max_length=8,
        description="Bytes one encoder output token takes in the cache, per modality.",
    )
    hidden_size: int | None = Field(
        default=None, ge=1, le=1 << 20, description="The LM's hidden size, as measured."
    )
    encode_seconds: (
        dict[Modality, Annotated[float, Field(gt=0, le=MAX_ENCODE_SECONDS, allow_inf_nan=False)]]
        | None
    ) = Field(
        default=None,
        max_length=8,
        description="Seconds one warm encode of the largest item of each modality took in "
        "the width Job, on its CPU or GPU (the item vLLM profiles with: the report's "
        "max_tokens_per_item tokens). For sizing producers: items per second x seconds per "
        "item / target utilisation. Absent when the report has none (measured by an "
        "earlier release).",
    )
    producers: ReplicaStatus | None = Field(
        default=None, description="Producer pods (with producer groups: of all groups)."
    )
    producer_groups: tuple[ProducerGroupStatus, ...] | None = Field(
        default=None,
        max_length=3,
        description="Producer pods of each group in spec.producerGroups.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )
    producer_groups_summary: str | None = Field(
        default=None,
        max_length=256,
        description="Each group's ready/desired pods, for `kubectl get -o wide` (derived; any "
        "value given is replaced).",
    )
    consumers: ReplicaStatus | None = Field(default=None, description="Consumer pods.")
    router: ReplicaStatus | None = Field(default=None, description="Router pods.")
    autoscaling: tuple[AutoscalerStatus, ...] | None = Field(
        default=None,
        max_length=4,
        description="Each autoscaling role's autoscaler: engine, bounds, the replicas it saw "
        "and asked for, whether it is active and why not, when it last scaled; absent when "
        "no role autoscales.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["role"],
        },
    )
    autoscaling_summary: str | None = Field(
        default=None,
        max_length=512,
        description="Each autoscaler as <role> <current>/<desired> (<min>-<max>), "
        "`inactive` when it is not active, for `kubectl get -o wide` (derived; any value "
        "given is replaced).",
    )
    router_endpoint: str | None = Field(
        default=None,
        max_length=512,
        description="URL of the pool's endpoint in the cluster: "
        "http://<pool>.<namespace>.svc:<port> (the router's Service); absent without a router.",
    )

    @model_validator(mode="before")
    @classmethod
    def _derive_summaries(cls, data: Any) -> Any:
        """The summaries from the lists they sum up, so the two never disagree."""
        if not isinstance(data, Mapping):
            return data
        data = {k: v for k, v in data.items() if k not in _SUMMARIES}
        groups = _field(data, "producer_groups", "producerGroups")
        if groups:
            data["producerGroupsSummary"] = ", ".join(
                f"{_field(g, 'name', 'name')} {_field(g, 'ready', 'ready') or 0}/"
                f"{_field(g, 'desired', 'desired') or 0}"
                for g in groups
            )
        scalers = data.get("autoscaling")
        if scalers:
            data["autoscalingSummary"] = ", ".join(autoscaler_summary(a) for a in scalers)
        return data

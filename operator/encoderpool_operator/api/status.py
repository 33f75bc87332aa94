"""``EncoderPool.status``: what the operator observed, written by the operator only.

Conditions follow metav1.Condition (type/status/reason/message/
observedGeneration/lastTransitionTime), so `kubectl wait`, kstatus and Argo CD
read them; ``conditions`` holds the rules of how they change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

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
        "reason of the first that is not.",
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
    consumers: ReplicaStatus | None = Field(default=None, description="Consumer pods.")
    router: ReplicaStatus | None = Field(default=None, description="Router pods.")
    router_endpoint: str | None = Field(
        default=None,
        max_length=512,
        description="URL of the pool's endpoint in the cluster: "
        "http://<pool>.<namespace>.svc:<port> (the router's Service); absent without a router.",
    )

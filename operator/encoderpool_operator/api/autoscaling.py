"""Per-role autoscaling: each role sized by its own load.

Producers scale on encoder demand (media items in flight to them, as the router sees
it) and may sleep at zero while consumers encode the rare item; consumers scale on LM
demand (vLLM's running plus waiting requests). While a role autoscales, its autoscaler
owns the Deployment's ``replicas``: the operator keeps the live count applied only until
the autoscaler first writes it (render.vllm.deployment_replicas), then never writes it.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from encoderpool_operator.api.schema import ApiModel, Rule

MAX_REPLICAS = 256


class ScalingRate(ApiModel):
    """How fast a role may grow or shrink (the HorizontalPodAutoscaler's behavior)."""

    stabilization_window_seconds: int = Field(
        ge=0,
        le=3600,
        description="How long a lower (scale-down) or higher (scale-up) recommendation "
        "must persist before it is acted on; the autoscaler uses the most conservative "
        "recommendation of the window.",
    )
    max_replicas_per_step: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REPLICAS,
        description="At most this many pods added (scale-up) or removed (scale-down) per "
        "periodSeconds. Unset: no limit.",
    )
    period_seconds: int = Field(
        default=15, ge=1, le=1800, description="The period maxReplicasPerStep applies to."
    )


def _up() -> ScalingRate:
    return ScalingRate(stabilization_window_seconds=0, period_seconds=15)


def _down() -> ScalingRate:
    # Scaling down slowly keeps encoders through a lull between bursts; one pod a minute.
    return ScalingRate(stabilization_window_seconds=300, max_replicas_per_step=1, period_seconds=60)


class Autoscaling(ApiModel):
    """Replicas sized from the role's own load, between minReplicas and maxReplicas."""

    rules: ClassVar[tuple[Rule[Autoscaling], ...]] = (
        Rule(
            ".minReplicas",
            cel="self.minReplicas <= self.maxReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
            message="minReplicas must not exceed maxReplicas: raise maxReplicas",
        ),
    )

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description="The fewest pods. 0 lets producers (and producer groups) sleep when "
        "idle: the consumers encode media items meanwhile, and the first item wakes them "
        "(needs the KEDA engine). Consumers need at least 1.",
    )
    max_replicas: int = Field(ge=1, le=MAX_REPLICAS, description="The most pods.")
    target: float | None = Field(
        default=None,
        gt=0,
        le=10000,
        description="The load one pod should carry. Producers: media items in flight per "
        "pod (default 2); consumers: requests running or waiting per vLLM instance "
        "(default 8).",
    )
    target_kv_cache_usage: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Consumers only: also scale so that the mean KV-cache use of the "
        "consumers stays under this fraction (vLLM's kv_cache_usage_perc), e.g. 0.8.",
    )
    scale_up: ScalingRate = Field(
        default_factory=_up,
        description="How fast pods are added (default: at once, no limit).",
    )
    scale_down: ScalingRate = Field(
        default_factory=_down,
        description="How fast pods are removed (default: after 5 minutes of lower load, "
        "one pod a minute).",
    )


# Targets when the spec gives none: an encoder batches a few items well; vLLM's
# continuous batching keeps a CPU/GPU busy with a handful of sequences.
DEFAULT_PRODUCER_TARGET = 2.0
DEFAULT_CONSUMER_TARGET = 8.0

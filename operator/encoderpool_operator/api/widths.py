"""``spec.widthJob``: the Job that measures the model's encoder output widths."""

from __future__ import annotations

from pydantic import Field

from encoderpool_operator.api.roles import ResourceRequirements
from encoderpool_operator.api.schema import ApiModel


class WidthJobSpec(ApiModel):
    """The Job that loads the model once and measures its encoder output widths."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="Image of the Job; default: spec.image (it must hold vLLM and the connector).",
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Resources of the Job's container; default: spec.producer.resources.",
    )
    active_deadline_seconds: int = Field(
        default=1800,
        ge=60,
        le=86400,
        description="How long a measurement may run before the Job fails, in seconds.",
    )
    backoff_limit: int = Field(
        default=2, ge=0, le=10, description="Retries before the Job counts as failed."
    )

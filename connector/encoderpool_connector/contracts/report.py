"""``WidthReport``: what the width Job measured, and where the operator keeps it.

The Job (``measure``, in the vLLM image) writes the report as compact JSON to
its termination message; the operator reads it from the Job's pod and stores
it in a ConfigMap. Writer and reader share this module, so the payload cannot
drift, and the Job needs no Kubernetes credentials. Reports are keyed by a
fingerprint of everything that can change the encoder's output, so pools that
serve the same model the same way share one report.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from encoderpool_connector.contracts.base import Frozen
from encoderpool_connector.contracts.dtypes import Dtype
from encoderpool_connector.contracts.identity import ModelIdentity

CONFIGMAP_PREFIX = "encoderpool-widths-"
CONFIGMAP_KEY = "report.json"
LABEL_FINGERPRINT = "encoderpool.io/model-fingerprint"
LABEL_COMPONENT = "app.kubernetes.io/component"
COMPONENT = "width-report"
# The kubelet keeps at most this many bytes of a container's termination message:
# the width Job's report must fit (the operator reads it from the Job's pod).
TERMINATION_MESSAGE_LIMIT = 4096


class WidthReport(Frozen):
    """The measured shape of a model's encoder outputs."""

    version: Literal[1] = 1
    fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$")
    identity: ModelIdentity
    encoder_output_widths: dict[str, Annotated[int, Field(ge=1)]] = Field(
        description="Width of one encoder output token, per modality."
    )
    hidden_size: Annotated[int, Field(ge=1)] = Field(description="The LM's hidden size.")
    dtype: Dtype
    bytes_per_token: dict[str, Annotated[int, Field(ge=1)]] = Field(
        description="width x bytes per element, per modality."
    )
    max_tokens_per_item: dict[str, Annotated[int, Field(ge=0)]] = Field(
        description="Most encoder tokens one item can produce, per modality."
    )
    measured_at: datetime

    def to_termination_message(self) -> str:
        """Compact JSON; ValueError when it exceeds what the kubelet keeps of a message."""
        text = self.model_dump_json()
        size = len(text.encode())
        if size > TERMINATION_MESSAGE_LIMIT:
            raise ValueError(
                f"the width report is {size} bytes, more than the {TERMINATION_MESSAGE_LIMIT} "
                "bytes the kubelet keeps of a termination message (too many modalities or "
                "limits?)"
            )
        return text

    @classmethod
    def from_termination_message(cls, text: str) -> WidthReport:
        """Parse what the width Job wrote; pydantic's ValidationError names what is wrong."""
        return cls.model_validate_json(text)

    @property
    def configmap_name(self) -> str:
        return configmap_name(self.fingerprint)

    def to_configmap_data(self) -> dict[str, str]:
        return {CONFIGMAP_KEY: self.model_dump_json(indent=1)}

    @classmethod
    def from_configmap_data(cls, data: dict[str, str] | None) -> WidthReport:
        """Parse a ConfigMap's data; ValueError names what is missing or wrong."""
        if not data or CONFIGMAP_KEY not in data:
            raise ValueError(f"ConfigMap has no {CONFIGMAP_KEY!r} key")
        return cls.model_validate_json(data[CONFIGMAP_KEY])


def configmap_name(fingerprint: str) -> str:
    return CONFIGMAP_PREFIX + fingerprint

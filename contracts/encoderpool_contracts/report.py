"""``WidthReport``: what the width Job measured, and where the operator keeps it.

The Job (``measure``, in the vLLM image) writes the report as compact JSON to
its termination message; the operator reads it from the Job's pod and stores
it in a ConfigMap. Writer and reader share this module, so the payload cannot
drift, and the Job needs no Kubernetes credentials. The report carries the
model's fingerprint (what cache entries carry too); the operator names and
shares the ConfigMap by a wider *report key* (the fingerprint plus the width
Job's image and arguments, see ``render.widths.report_key``), so pools that measure
the same model the same way share one report.

Every number is bounded: a report is read from a ConfigMap that anyone who may
write ConfigMaps in the namespace can write, so its values are input, not truth.

``version`` changes when a field changes meaning or a field every reader needs is
added. A field that is only added, with a default for reports that lack it
(``encode_seconds``), keeps the version: stored reports of earlier releases still
parse and simply lack it. An earlier reader refuses a report carrying a field it
does not know (unknown keys are errors), which is one reason the operator and the
width Job's image come from the same release.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Final, Literal

from pydantic import Field, model_validator

from encoderpool_contracts.base import Frozen
from encoderpool_contracts.dtypes import DTYPE_BYTES, Dtype
from encoderpool_contracts.identity import ModelIdentity

CONFIGMAP_PREFIX = "encoderpool-widths-"
CONFIGMAP_KEY = "report.json"
LABEL_FINGERPRINT = "encoderpool.io/model-fingerprint"
LABEL_COMPONENT = "app.kubernetes.io/component"
COMPONENT = "width-report"
# The kubelet keeps at most this many bytes of a container's termination message:
# the width Job's report must fit (the operator reads it from the Job's pod).
TERMINATION_MESSAGE_LIMIT = 4096
# Bounds of a report's numbers, far above any model served today and far below what
# would make a consumer allocate without limit (a slot is tokens x bytes per token).
MAX_WIDTH = 1 << 16  # an encoder output token's width (and the LM's hidden size)
MAX_BYTES_PER_TOKEN = MAX_WIDTH * max(DTYPE_BYTES.values())
MAX_TOKENS_PER_ITEM = 1 << 24  # above the longest context vLLM serves
MAX_MODALITIES = 8  # as spec.model.limitMmPerPrompt and the pool's status
# One warm encode of one item: an hour is far past any encoder (a long video on a CPU
# takes minutes), and the bound keeps sizing arithmetic away from absurd numbers.
MAX_ENCODE_SECONDS = 3600.0
MODALITY_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
Modality = Annotated[str, Field(pattern=MODALITY_PATTERN)]


class WidthReport(Frozen):
    """The measured shape of a model's encoder outputs."""

    version: Literal[1] = 1
    fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$")
    identity: ModelIdentity
    encoder_output_widths: dict[Modality, Annotated[int, Field(ge=1, le=MAX_WIDTH)]] = Field(
        max_length=MAX_MODALITIES, description="Width of one encoder output token, per modality."
    )
    hidden_size: Annotated[int, Field(ge=1, le=MAX_WIDTH)] = Field(
        description="The LM's hidden size."
    )
    dtype: Dtype
    bytes_per_token: dict[Modality, Annotated[int, Field(ge=1, le=MAX_BYTES_PER_TOKEN)]] = Field(
        max_length=MAX_MODALITIES, description="width x bytes per element, per modality."
    )
    max_tokens_per_item: dict[Modality, Annotated[int, Field(ge=0, le=MAX_TOKENS_PER_ITEM)]] = (
        Field(
            max_length=MAX_MODALITIES,
            description="Most encoder tokens one item can produce, per modality.",
        )
    )
    measured_at: datetime
    encode_seconds: dict[
        Modality, Annotated[float, Field(gt=0, le=MAX_ENCODE_SECONDS, allow_inf_nan=False)]
    ] = Field(
        default_factory=dict,
        max_length=MAX_MODALITIES,
        description="Seconds one warm encode of the modality's dummy item took in the width "
        "Job, on its CPU or GPU: the largest item the model's processor admits (what vLLM "
        "profiles with), so an upper bound per item. Empty in reports of earlier releases.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> WidthReport:
        """bytes_per_token is derived (width x bytes of dtype): a report that disagrees
        with itself was not measured, and consumers size buffers from it."""
        elem = DTYPE_BYTES[self.dtype]
        for modality, size in self.bytes_per_token.items():
            width = self.encoder_output_widths.get(modality)
            if width is None or size != width * elem:
                raise ValueError(
                    f"bytes_per_token.{modality} is {size}, not encoder_output_widths.{modality} "
                    f"({width}) x {elem} bytes of {self.dtype}"
                )
        if unmeasured := sorted(set(self.encode_seconds) - set(self.encoder_output_widths)):
            raise ValueError(
                f"encode_seconds has {', '.join(unmeasured)}, which encoder_output_widths "
                "lacks: only a modality whose item was encoded can have been timed"
            )
        return self

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

    def to_configmap_data(self) -> dict[str, str]:
        return {CONFIGMAP_KEY: self.model_dump_json(indent=1)}

    @classmethod
    def from_configmap_data(cls, data: dict[str, str] | None) -> WidthReport:
        """Parse a ConfigMap's data; ValueError names what is missing or wrong."""
        if not data or CONFIGMAP_KEY not in data:
            raise ValueError(f"ConfigMap has no {CONFIGMAP_KEY!r} key")
        return cls.model_validate_json(data[CONFIGMAP_KEY])


# Where a container's termination message goes (the kubelet's default path, rendered
# explicitly) and the env var that tells the connector to write its refusal there: absent
# outside a pod, so a connector started by hand never writes into /dev.
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_ENV = "ENCODERPOOL_TERMINATION_LOG"
WIDTH_MISMATCH: Final = "WidthMismatch"


class WidthMismatch(Frozen):
    """Why a vLLM pod refused to start: the encoder its vLLM loaded emits other widths
    than the pool's width report names (vLLM measures them at start-up, as the width Job
    did). The connector writes it as the container's termination message; the operator
    reads it from the pod, so a stale or foreign report is a condition on the pool, not a
    crash loop to dig through. Bounded like the report: it is read from a pod status."""

    reason: Literal["WidthMismatch"] = "WidthMismatch"  # WIDTH_MISMATCH
    version: Literal[1] = 1
    fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$")
    configured: dict[Modality, Annotated[int, Field(ge=1, le=MAX_WIDTH)]] = Field(
        max_length=MAX_MODALITIES, description="The widths the report (the config) names."
    )
    measured: dict[Modality, Annotated[int, Field(ge=1, le=MAX_WIDTH)]] = Field(
        max_length=MAX_MODALITIES, description="The widths this pod's vLLM measured."
    )

    def summary(self) -> str:
        """``image: report 128, this pod's vLLM 256`` for each modality that differs."""
        return "; ".join(
            f"{m}: report {w}, the pod's vLLM {self.measured[m]}"
            for m, w in sorted(self.configured.items())
            if m in self.measured and self.measured[m] != w
        )

    def to_termination_message(self) -> str:
        return self.model_dump_json()  # at most ~1 KiB: 2 x 8 modalities, bounded keys

    @classmethod
    def from_termination_message(cls, text: str) -> WidthMismatch:
        return cls.model_validate_json(text)


def configmap_name(report_key: str) -> str:
    """The report's ConfigMap: named by the operator's report key, not the model fingerprint."""
    return CONFIGMAP_PREFIX + report_key

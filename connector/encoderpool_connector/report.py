"""``WidthReport``: what the width Job measured, stored in a ConfigMap the operator reads.

The writer (``measure``, in the vLLM image) and the reader (the operator)
share this module, so the payload cannot drift. Reports are keyed by a
fingerprint of everything that can change the encoder's output, so pools that
serve the same model the same way share one report.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

CONFIGMAP_PREFIX = "encoderpool-widths-"
CONFIGMAP_KEY = "report.json"
LABEL_FINGERPRINT = "encoderpool.io/model-fingerprint"
LABEL_COMPONENT = "app.kubernetes.io/component"
COMPONENT = "width-report"

# Bytes per element of the dtypes a pool may serve.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelIdentity(_Frozen):
    """Everything that changes what the encoder emits; its hash is the fingerprint."""

    model: str = Field(description="Model name or path as given to `vllm serve`.")
    revision: str = Field(default="", description="Model revision; empty for a local path.")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    pipeline_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    vllm_version: str = Field(description="vLLM version of the image that serves the model.")
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=dict, description="vLLM's --limit-mm-per-prompt, per modality."
    )

    def differences(self, served: ModelIdentity) -> list[str]:
        """How what vLLM actually serves differs from this identity, one line per field.

        ``vllm_version`` is not compared: the operator puts the serving image
        there, vLLM its version string. Limits vLLM filled in that the identity
        left unset do not count.
        """
        out = []
        mine, theirs = self.model_dump(), served.model_dump()
        for key in mine:
            if key == "vllm_version":
                continue
            if key == "limit_mm_per_prompt":
                wrong = {m: n for m, n in mine[key].items() if theirs[key].get(m) != n}
                if wrong:
                    out.append(f"limit_mm_per_prompt: vLLM applied {theirs[key]}, not {wrong}")
            elif mine[key] != theirs[key]:
                out.append(f"{key}: {mine[key]!r}, but vLLM serves {theirs[key]!r}")
        return out

    def fingerprint(self) -> str:
        """16 hex chars: stable across processes (canonical JSON, sorted keys)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class WidthReport(_Frozen):
    """The measured shape of a model's encoder outputs."""

    version: Literal[1] = 1
    fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$")
    identity: ModelIdentity
    encoder_output_widths: dict[str, Annotated[int, Field(ge=1)]] = Field(
        description="Width of one encoder output token, per modality."
    )
    hidden_size: Annotated[int, Field(ge=1)] = Field(description="The LM's hidden size.")
    dtype: Literal["bfloat16", "float16", "float32"]
    bytes_per_token: dict[str, Annotated[int, Field(ge=1)]] = Field(
        description="width x bytes per element, per modality."
    )
    max_tokens_per_item: dict[str, Annotated[int, Field(ge=0)]] = Field(
        description="Most encoder tokens one item can produce, per modality."
    )
    measured_at: datetime

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

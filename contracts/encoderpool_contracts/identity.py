"""``ModelIdentity``: everything that changes what the encoder emits, and its fingerprint.

The operator computes it from a pool's spec (and keys width reports by its
fingerprint); the width Job and the connector at start-up read it from the
engine's ``VllmConfig`` with ``identity_from_vllm_config``, so the fingerprint
a Job writes and the one a serving pod computes cannot drift.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from pydantic import Field

from encoderpool_contracts.base import Frozen
from encoderpool_contracts.dtypes import Dtype, dtype_name


class ModelIdentity(Frozen):
    """Everything that changes what the encoder emits; its hash is the fingerprint."""

    model: str = Field(description="Model name or path as given to `vllm serve`.")
    revision: str = Field(default="", description="Model revision; empty for a local path.")
    dtype: Dtype = "bfloat16"
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


def identity_from_vllm_config(vllm_config: Any) -> ModelIdentity:
    """Everything in the engine's config that changes what the encoder emits.

    vLLM is imported here, not at module level: the operator imports this module.
    """
    import vllm

    mc = vllm_config.model_config
    mm = mc.multimodal_config
    limits: dict[str, int] = {}
    if mm is not None:
        limits = {m: int(mm.get_limit_per_prompt(m)) for m in sorted(mm.limit_per_prompt)}
    return ModelIdentity(
        model=str(mc.model),
        revision=str(mc.revision or ""),
        dtype=dtype_name(mc.dtype),
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        pipeline_parallel_size=vllm_config.parallel_config.pipeline_parallel_size,
        vllm_version=str(vllm.__version__),
        limit_mm_per_prompt=limits,
    )

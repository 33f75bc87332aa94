"""The served model's identity, read from a ``VllmConfig``.

One function used by the width Job and by the connector at start-up, so the
fingerprint a Job writes and the one a serving pod computes cannot drift.
"""

from __future__ import annotations

from typing import Any

from encoderpool_connector.report import ModelIdentity

_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; ValueError for dtypes a pool cannot serve."""
    name = _DTYPES.get(str(dtype), str(dtype))
    if name not in _DTYPES.values():
        raise ValueError(f"dtype {dtype} is not one of {sorted(_DTYPES.values())}")
    return name


def identity_from_vllm_config(vllm_config: Any) -> ModelIdentity:
    """Everything in the engine's config that changes what the encoder emits."""
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

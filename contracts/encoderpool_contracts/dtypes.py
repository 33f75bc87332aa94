"""The dtypes a pool may serve, and their sizes: the one table every format uses.

The width report, the shared-volume entry header, the rdma slot header and
the rdma coordinates all name a dtype by these strings and size payloads with
``payload_bytes``, so a dtype added here is added everywhere at once.
"""

from __future__ import annotations

import math
from typing import Any, Literal

Dtype = Literal["bfloat16", "float16", "float32"]

# Bytes per element of each dtype a pool may serve.
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` (or ``"bfloat16"``) -> ``"bfloat16"``; ValueError for others."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype} is not one of {sorted(DTYPE_BYTES)}")
    return name


def payload_bytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (KeyError for an unknown dtype)."""
    return math.prod(shape) * DTYPE_BYTES[dtype]

"""Torch helpers both workers share: our dtype names as torch dtypes, the worker's device.

Imported only by the worker side (the scheduler side and the contracts never
import torch).
"""

from __future__ import annotations

import torch

from encoderpool_contracts import DTYPE_BYTES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}


class OnDevice:
    """Finds, once, the device this worker's encoder cache lives on (tests may set it)."""

    _device: torch.device | None = None

    def _target_device(self) -> torch.device:
        if self._device is None:
            from vllm.platforms import current_platform

            kind = current_platform.device_type
            if current_platform.is_cuda_alike():
                kind = f"{kind}:{current_platform.current_device()}"
            self._device = torch.device(kind)
        return self._device

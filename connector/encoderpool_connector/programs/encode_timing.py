"""The width Job's encode timing: one warm encode per modality, on the engine it started.

vLLM's width measurement encodes one dummy item per modality; by then the weights
are resident and the kernels have run once, so the same item encoded again costs
what a producer pays per item of that size once it serves. What is timed is the
encoder's forward pass (the item already processed and on the device): the media
processor runs in vLLM's front end and the hand-over in the connector, neither in it.
The item is the largest the model's processor admits under the pool's limits (the
one vLLM profiles with, ``max_tokens_per_item`` tokens), so the time is an upper
bound per item.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from encoderpool_contracts.report import MAX_ENCODE_SECONDS

# The report keeps microseconds: finer is noise, and the termination message is small.
RESOLUTION_SECONDS = 1e-6


def _synchronize(device: Any) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously); nothing on a CPU."""
    import torch

    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def time_encodes_on_worker(worker: Any) -> dict[str, float]:
    """Seconds of one encode of each modality's dummy item; runs on every worker.

    Every rank encodes (tensor-parallel ranks encode together); {} on ranks that
    hold no encoder, as vLLM's own measurement does.
    """
    import torch
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget
    from vllm.multimodal.utils import group_and_batch_mm_kwargs
    from vllm.utils.torch_utils import PIN_MEMORY

    runner = worker.model_runner
    if not runner.supports_mm_inputs or not get_pp_group().is_first_rank:
        return {}
    budget = MultiModalBudget(worker.vllm_config, MULTIMODAL_REGISTRY, enable_cache=False)
    model = runner.get_model()
    seconds: dict[str, float] = {}
    with torch.inference_mode():
        for modality in budget.mm_max_toks_per_item:
            items = budget.get_dummy_encoder_profile_inputs(modality, 1)
            if not items:
                continue
            _, _, mm_kwargs = next(
                group_and_batch_mm_kwargs(items, device=runner.device, pin_memory=PIN_MEMORY)
            )
            _synchronize(runner.device)
            start = time.perf_counter()
            outputs = model.embed_multimodal(**mm_kwargs)
            _synchronize(runner.device)
            seconds[modality] = time.perf_counter() - start
            del outputs
    return seconds


def encode_seconds(
    reports: Iterable[Mapping[str, float]], measured: Iterable[str]
) -> dict[str, float]:
    """Per measured modality, the slowest rank's time (ranks encode together, so the
    slowest is the encode's), in whole microseconds, at least one and within the
    report's bound. A modality no rank timed is left out."""
    wanted = set(measured)
    slowest: dict[str, float] = {}
    for report in reports:
        for modality, value in report.items():
            if modality in wanted and value == value:  # NaN never compares equal
                slowest[modality] = max(slowest.get(modality, 0.0), float(value))
    return {
        m: min(max(round(v, 6), RESOLUTION_SECONDS), MAX_ENCODE_SECONDS)
        for m, v in sorted(slowest.items())
    }

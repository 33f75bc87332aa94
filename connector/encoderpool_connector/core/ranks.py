"""What a worker does as one rank of a tensor-parallel engine (both transports).

Every tensor-parallel rank holds the whole encoder output (the vision tower's
shards are gathered), and every rank's LM needs every embedding. So:

- producers: only the lead rank (TP rank 0) writes an item out; the other
  ranks' copies are identical;
- consumers: every rank loads every planned item; what a load held (a pin, a
  slot) is released by the scheduler once the step's merged output arrives,
  which vLLM builds from all ranks' outputs of that step;
- a load that fails on any rank fails on all (``agree``): every rank drops
  the item and the engine encodes it again in the same step (``recompute``).
  The encoder itself is split across ranks, so all must encode the same
  items; no rank ever hands its LM a made-up embedding;
- counters: only the lead rank reports its worker counters (the others did
  the same work), so a metric counts items, not items times ranks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.ext." + __name__)

FAULT_ENV = "ENCODERPOOL_TEST_FAIL_LOADS"
"""Test hook, ``<rank>:<path>``: on that tensor-parallel rank, every load fails while the
file ``path`` exists. Read from the pod's environment only, never from a request."""


def tp_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel (rank, world size); (0, 1) where vLLM has no group."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:  # not initialised: a single worker
        return 0, 1


@dataclass(frozen=True)
class Failing:
    """One planned load that did not deliver on some rank: the engine encodes it instead."""

    mm_hash: str
    request_id: str
    index: int


class Rank:
    """This worker's place in its tensor-parallel group, and what ranks agree on."""

    def __init__(self, rank: int | None = None, world_size: int | None = None) -> None:
        if rank is None or world_size is None:
            rank, world_size = tp_rank_and_size()
        self.rank = rank
        self.world_size = world_size
        self._fault = _fault_path(rank)

    def announce(self, transport: str) -> None:
        """One start-up line per rank saying what it does (under tensor parallelism)."""
        if self.world_size > 1:
            logger.info(
                "encoderpool %s worker: tensor-parallel rank %d of %d: %s",
                transport,
                self.rank,
                self.world_size,
                "writes items, loads, counts"
                if self.lead
                else "loads only (rank 0 writes items and counts)",
            )

    @property
    def lead(self) -> bool:
        """Whether this rank writes items out and reports worker counters."""
        return self.rank == 0

    def injected_fault(self) -> bool:
        """Whether the test hook makes this rank's loads fail now."""
        return self._fault is not None and os.path.exists(self._fault)

    def agree(self, failed: Sequence[bool]) -> list[bool]:
        """Per planned load: failed on any rank. Every rank calls this with the same plan
        (the step's metadata), so the collective lines up."""
        if self.world_size == 1:
            return list(failed)
        import torch
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        flags = torch.tensor([1 if f else 0 for f in failed], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return [bool(x) for x in flags.tolist()]


def _fault_path(rank: int) -> str | None:
    raw = os.environ.get(FAULT_ENV, "")
    if not raw:
        return None
    target, _, path = raw.partition(":")
    if not target.isdigit() or not path:
        logger.warning("encoderpool: ignoring env %s=%r (want <rank>:<path>)", FAULT_ENV, raw)
        return None
    if int(target) != rank:
        return None
    logger.warning(
        "encoderpool: test hook %s: loads on rank %d fail while %s exists", FAULT_ENV, rank, path
    )
    return path


def recompute(
    encoder_cache: dict[str, Any], encoder_inputs: dict[str, list[int]], items: list[Failing]
) -> None:
    """Have the engine encode ``items`` in this step instead of loading them.

    ``encoder_inputs`` is the step's ``scheduled_encoder_inputs`` (request id ->
    item indices), which the model runner encodes right after the loads; the
    scheduler side hands it over in the metadata. Lists are replaced, not
    appended to, since the engine's own scheduler may hold them.
    """
    for item in items:
        encoder_cache.pop(item.mm_hash, None)
        indices = encoder_inputs.get(item.request_id, [])
        if item.index not in indices:
            encoder_inputs[item.request_id] = [*indices, item.index]

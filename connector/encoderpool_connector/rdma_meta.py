"""What the RDMA connector's scheduler and worker sides tell each other, and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

from encoderpool_connector.stats import CounterPromMetrics, CounterStats


@dataclass(frozen=True)
class WritePlan:
    """Producer: copy this item's encoder output into the slot at ``offset``. Filled by the
    scheduler (which allocated the slot), read by the worker."""

    mm_hash: str
    offset: int
    capacity: int
    """Payload bytes the slot holds (after its header)."""
    generation: int


@dataclass(frozen=True)
class LoadPlan:
    """Consumer: the verified bytes of ``mm_hash`` lie at ``offset`` in the local region.
    Filled by the scheduler after the READ was verified, read by the worker."""

    mm_hash: str
    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class RdmaMetadata(ECConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """Scheduler -> worker, each step: the region to map, and this step's writes or loads."""

    region: str = ""
    region_bytes: int = 0
    writes: list[WritePlan] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)


@dataclass
class RdmaWorkerMetadata(ECConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler (consumer; a CPU producer's is discarded by vLLM 0.32): which loads
    finished or failed, so their slots can be reused, and counters. ``aggregate`` merges ranks."""

    loaded: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    stats: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, RdmaWorkerMetadata)
        merged = dict(self.stats)
        for k, v in other.stats.items():
            merged[k] = merged.get(k, 0) + v
        return RdmaWorkerMetadata(
            loaded=self.loaded | other.loaded, failed=self.failed | other.failed, stats=merged
        )


# name -> help; every key the RDMA connector counts. Seconds are summed.
RDMA_COUNTERS: dict[str, str] = {
    "lookups": "Items the consumer looked at (announced by a producer or not).",
    "hits": "Items READ from a producer and verified (the consumer skips its encoder).",
    "misses": "Items the consumer encodes itself (not announced, or the transfer failed).",
    "bad_coordinates": "Announced items whose coordinates failed validation.",
    "no_room": "Items not pulled because the consumer's buffer was full of in-flight items.",
    "transfer_failures": "READs that failed, or whose producer was unreachable or refused.",
    "transfer_timeouts": "READs (metadata fetch included) that exceeded transfer_timeout_ms.",
    "corrupt": "READs whose bytes did not match the announced checksum.",
    "pulled_bytes": "Bytes READ and verified.",
    "pull_seconds": "Seconds from starting a pull to its verdict (off the engine loop).",
    "loads": "Verified items copied into the encoder cache by the worker.",
    "load_failures": "Loads that failed after verification (the request is failed, retryable).",
    "load_seconds": "Seconds the worker spent copying loads (on the step path).",
    "saves": "Encoder outputs copied into registered memory by the producer's worker.",
    "saves_dropped": "Encoder outputs not copied (no slot planned, too large, or an error).",
    "save_bytes": "Bytes copied into registered memory.",
    "save_seconds": "Seconds the producer's worker spent copying and checksumming.",
    "announced": "Items whose coordinates a producer returned in ec_transfer_params.",
    "unannounced": "Items a producer finished without coordinates (no slot, or not written).",
    "released": "Producer slots freed because every announced READ confirmed.",
    "expired": "Producer slots freed by age (slot_ttl_s).",
    "evicted": "Slots evicted to make room for newer items.",
    "evicted_bytes": "Bytes evicted.",
    "bad_notices": "Malformed NIXL notifications a producer ignored.",
}


@dataclass
class RdmaECStats(CounterStats):
    """The rdma connector's counters."""

    counters: ClassVar[dict[str, str]] = RDMA_COUNTERS


class RdmaPromMetrics(CounterPromMetrics):
    counters: ClassVar[dict[str, str]] = RDMA_COUNTERS

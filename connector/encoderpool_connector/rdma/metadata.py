"""What the RDMA connector's scheduler and worker sides tell each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from encoderpool_connector.core.metadata import WorkerReport


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
    request_id: str = ""
    index: int = -1
    """The request and item this load serves: where the engine encodes it if a rank fails."""


@dataclass
class RdmaMetadata(ECConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """Scheduler -> worker, each step: the region to map, and this step's writes or loads."""

    region: str = ""
    region_bytes: int = 0
    writes: list[WritePlan] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """The step's ``scheduled_encoder_inputs`` itself (pickled with it, so the same dict on
    the worker): a load that fails is added there and encoded in the same step."""


@dataclass
class RdmaWorkerMetadata(WorkerReport):
    """Worker -> scheduler (consumer; a CPU producer's is discarded by vLLM 0.32): which loads
    finished (``loaded``) or failed (and were encoded instead), so their slots can be
    reused, and counters. vLLM merges all ranks' reports of a step before the scheduler
    sees them, so a slot is reused only after every rank copied out of it."""

    loaded: set[str] = field(default_factory=set)

"""What the shared-volume connector's scheduler and worker sides tell each other each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class LoadSpec:
    """One verified entry the worker loads this step. Filled by the scheduler side."""

    mm_hash: str
    path: str
    """The pin (a hard link to the verified inode), or the entry if links are unsupported."""
    pinned: bool
    dtype: str
    shape: tuple[int, ...]


@dataclass
class SharedVolumeMetadata(ECConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """Scheduler -> worker: the loads of one step."""

    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class SharedVolumeWorkerMetadata(ECConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler: loads that failed after verification, and counters.

    Filled by each worker rank; ``aggregate`` merges ranks. The counters ride
    here because vLLM's V1 model runner (the one CPUs use) drops the worker's
    ``get_ec_connector_stats``; the scheduler folds them into its own stats.
    """

    failed: set[str] = field(default_factory=set)
    stats: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, SharedVolumeWorkerMetadata)
        merged = dict(self.stats)
        for k, v in other.stats.items():
            merged[k] = merged.get(k, 0) + v
        return SharedVolumeWorkerMetadata(failed=self.failed | other.failed, stats=merged)

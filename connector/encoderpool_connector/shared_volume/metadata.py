"""What the shared-volume connector's scheduler and worker sides tell each other each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from encoderpool_connector.metadata import WorkerReport


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
class SharedVolumeWorkerMetadata(WorkerReport):
    """Worker -> scheduler: loads that failed after verification, and counters."""

"""What the shared-volume connector's scheduler and worker sides tell each other each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from encoderpool_connector.core.metadata import WorkerReport


@dataclass(frozen=True)
class LoadSpec:
    """One verified entry the worker loads this step. Filled by the scheduler side."""

    mm_hash: str
    subdir: str
    """``pins/<instance>`` (the pin, a hard link to the verified inode), or ``entries`` if
    links are unsupported; opened under the root without following links."""
    name: str
    pinned: bool
    dtype: str
    shape: tuple[int, ...]
    inode: tuple[int, int]
    """(st_dev, st_ino) of the verified file: the worker reads only that inode."""
    offset: int
    """Where the payload starts in that file, as verified: the worker reads from there
    and does not parse the header again."""
    request_id: str = ""
    index: int = -1
    """The request and item this load serves: where the engine encodes it if a rank fails."""

    @property
    def path(self) -> str:
        return f"{self.subdir}/{self.name}"


@dataclass
class SharedVolumeMetadata(ECConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """Scheduler -> worker: the loads of one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """The step's ``scheduled_encoder_inputs`` itself (pickled with it, so the same dict on
    the worker): a load that fails is added there and encoded in the same step."""


@dataclass
class SharedVolumeWorkerMetadata(WorkerReport):
    """Worker -> scheduler: loads that failed after verification (and were encoded
    instead), the pins this step's loads are done with, and counters."""

    released: set[str] = field(default_factory=set)
    """Pin names of this step's loads: every rank has loaded them (vLLM merges all ranks'
    outputs of a step before the scheduler sees them), so the scheduler drops the pins."""

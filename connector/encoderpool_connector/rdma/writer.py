"""The rdma producer's writer: copies queued encoder outputs into their slots of the
registered region, hashes them, and publishes each slot's header (``core.savequeue``).

The step queues a save (``RdmaWorker.save_caches``) after marking its slot's header
WRITING (``buffer.pack_writing``); this thread waits for the output's device copy (if
any), copies the payload into the slot, takes its BLAKE3, and writes the READY header,
its state last (``buffer.write_header``). Only then can the scheduler announce the
slot: a header is READY only over a whole, hashed payload.

The slot must still be this save's when its bytes are written: the writer writes only
over its own generation's WRITING mark, and drops saves older than half the slot TTL
(the scheduler frees any slot after the whole TTL). One thread writes in queue order,
which is the order the scheduler planned the slots in, so a range that was freed and
planned again is written last by its newest plan.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import blake3
import torch

from encoderpool_connector.core.savequeue import QueuedSave, SaveQueue
from encoderpool_connector.core.stats import LockedStats
from encoderpool_connector.rdma.buffer import (
    HEADER_BYTES,
    MARK_BYTES,
    STATE_WRITING,
    SharedRegion,
    SlotHeader,
    clear_if_writing,
    key_digest,
    slot_state,
    write_header,
)
from encoderpool_connector.rdma.metadata import WritePlan
from encoderpool_connector.rdma.stats import RdmaStats
from encoderpool_contracts import dtype_name

logger = logging.getLogger("vllm.ext." + __name__)

# Saves waiting for the writer at most (each also holds its slot and, from a device,
# staging memory): past it a save is dropped, counted, never waited for.
WRITER_QUEUE = 64
# Staging memory for device outputs (pinned, allocated on the first device save), and the
# bound on host outputs held by reference: at most this or the region's size, since
# everything queued also holds a slot of the region.
DEFAULT_SAVE_STAGING_BYTES = 256 << 20


@dataclass(frozen=True)
class SlotWrite:
    """Where a queued save goes: the scheduler's plan, in the region mapped when it was
    queued, taken by the worker at ``planned`` (monotonic seconds)."""

    plan: WritePlan
    region: SharedRegion
    planned: float


class RdmaWriter(SaveQueue):
    """One thread that writes queued saves into their slots; ``close`` writes what is queued.

    ``region_lock`` is the worker's: held here around each write, and by the worker when
    it unmaps a region, so a region is never unmapped under a write.
    """

    thread_name: ClassVar[str] = "ep-rdma-writer"
    what: ClassVar[str] = "encoderpool rdma worker"  # the totals line producers have logged
    queue_hint: ClassVar[str] = "the writer is behind the encoder"
    # The scheduler waits for this writer right after the step (request_finished), so the
    # quiet moment it lets the step's burst of submits have is added to every announcement:
    # shorter than the shared volume's, still many submits long (each is ~15 us).
    quiet_s: ClassVar[float] = 0.0005

    def __init__(
        self,
        region_lock: threading.Lock,
        stats: LockedStats[RdmaStats],
        *,
        stale_s: float,
        staging_bytes: int = DEFAULT_SAVE_STAGING_BYTES,
        maxsize: int = WRITER_QUEUE,
    ) -> None:
        self.region_lock = region_lock
        self.stale_s = stale_s
        super().__init__(maxsize, stats, staging_bytes)

    def _publish(self, item: QueuedSave) -> None:
        target = item.plan
        assert isinstance(target, SlotWrite)
        plan = target.plan
        t0 = time.perf_counter()
        with self.region_lock:
            region = target.region
            if region.closed:
                self._give_up(item, "its region was unmapped")
                return
            view = region.view
            if slot_state(view[plan.offset : plan.offset + MARK_BYTES]) != (
                STATE_WRITING,
                plan.generation,
            ):
                self._give_up(item, "its slot was planned again")
                return
            if time.monotonic() - target.planned > self.stale_s:
                clear_if_writing(view, plan.offset, plan.generation)
                self._give_up(item, "it waited past half the slot TTL")
                return
            try:
                nbytes = self._copy_and_header(region, plan, item.tensor)
            except Exception as e:  # one bad item never stops the writer
                clear_if_writing(view, plan.offset, plan.generation)
                self._give_up(item, repr(e))
                return
        self.stats.add_many(
            {"saves": 1, "save_bytes": nbytes, "save_seconds": time.perf_counter() - t0}
        )

    @staticmethod
    def _copy_and_header(region: SharedRegion, plan: WritePlan, tensor: torch.Tensor) -> int:
        """The payload into the slot, its BLAKE3, then the READY header; the payload bytes."""
        t = tensor.contiguous()
        nbytes = int(t.numel() * t.element_size())
        start = plan.offset + HEADER_BYTES
        dst = torch.frombuffer(region.map, dtype=torch.uint8, count=nbytes, offset=start)
        dst.copy_(t.view(torch.uint8).reshape(-1))  # torch's copy: several times memoryview's
        del dst
        view = region.view
        digest = blake3.blake3(view[start : start + nbytes], max_threads=blake3.blake3.AUTO)
        header = SlotHeader(
            plan.generation,
            nbytes,
            dtype_name(t.dtype),
            tuple(int(x) for x in t.shape),
            key_digest(plan.mm_hash),
            digest.digest(),
        ).pack()
        write_header(view, plan.offset, header)
        return nbytes

    def _give_up(self, item: QueuedSave, why: str) -> None:
        self.stats.add("saves_dropped")
        logger.warning(
            "encoderpool: not writing item %r to rdma memory: %s", item.mm_hash[:80], why
        )

    def _dropped(self, item: QueuedSave) -> None:
        """The device copy failed: the slot's mark goes, so the scheduler stops waiting."""
        target = item.plan
        assert isinstance(target, SlotWrite)
        with self.region_lock:
            if not target.region.closed:
                clear_if_writing(target.region.view, target.plan.offset, target.plan.generation)

"""Worker side of the RDMA connector: queue encoder outputs for the writer (producer),
copy verified items out of the registered region (consumer).

The region is the scheduler's tmpfs file, mapped here on the first step that
names it. A producer's step only queues each output (``writer``, on
``core.savequeue``): a host output by reference, a device output copied into
pinned staging on a side stream; the writer thread copies the payload into its
slot, takes its BLAKE3 and writes the slot's header, which the scheduler waits
for (boundedly) before it announces the slot. Under tensor parallelism
(``core.ranks``) only rank 0 writes, every rank copies out, and a load that fails
on any rank is encoded by all in the same step. A load onto a CUDA device goes
through a pinned buffer (``core.loadbuffers``) and a side stream (``core.streams``).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from encoderpool_connector.core.loadbuffers import LoadBuffers, as_tensor
from encoderpool_connector.core.ranks import Failing, Rank, recompute
from encoderpool_connector.core.stats import LockedStats
from encoderpool_connector.core.streams import DeviceUploads
from encoderpool_connector.core.tensors import TORCH_DTYPES, OnDevice
from encoderpool_connector.rdma.buffer import (
    MARK_BYTES,
    MAX_DIMS,
    SharedRegion,
    is_region_path,
    pack_writing,
)
from encoderpool_connector.rdma.metadata import (
    LoadPlan,
    RdmaMetadata,
    RdmaWorkerMetadata,
    WritePlan,
)
from encoderpool_connector.rdma.stats import RdmaStats
from encoderpool_connector.rdma.writer import DEFAULT_SAVE_STAGING_BYTES, RdmaWriter, SlotWrite
from encoderpool_contracts import ConnectorConfig, dtype_name, payload_bytes

logger = logging.getLogger("vllm.ext." + __name__)

# A consumer worker's pinned buffers for loads onto a CUDA device.
DEFAULT_LOAD_BUFFER_BYTES = 256 << 20


class RdmaWorker(OnDevice):
    """Worker-role logic; the connector class only routes to it."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        is_producer: bool,
        is_consumer: bool,
        rank: Rank | None = None,
    ) -> None:
        rd = config.rdma
        assert rd is not None
        self.config = config
        self.shm_dir = rd.shm_dir
        self.ttl = float(rd.slot_ttl_s)
        self.rank = rank or Rank()
        self.rank.announce("rdma")
        # Tensor-parallel rank 0 copies, once: the others hold the same output, and the
        # scheduler may read the slot before they finish their step.
        self.is_producer = is_producer and self.rank.lead
        self.is_consumer = is_consumer
        self.region: SharedRegion | None = None
        self._pending: dict[str, tuple[WritePlan, float]] = {}
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self.stats = LockedStats(RdmaStats)
        # Held by the writer around each write, here around an unmap.
        self._region_lock = threading.Lock()
        self.writer: RdmaWriter | None = None
        if self.is_producer:
            self.writer = RdmaWriter(
                self._region_lock,
                self.stats,
                stale_s=self.ttl / 2,
                staging_bytes=min(DEFAULT_SAVE_STAGING_BYTES, rd.buffer_bytes),
            )
        self._buffers: LoadBuffers | None = None  # made on the first load to a device
        self._uploads: DeviceUploads | None = None  # made on the first load to a CUDA device

    def _map(self, meta: RdmaMetadata) -> SharedRegion | None:
        """The scheduler's region, mapped once; None (and logged) if the metadata is off."""
        if self.region is not None and self.region.path == meta.region:
            return self.region
        if not is_region_path(meta.region, self.shm_dir):
            logger.error(
                "encoderpool: scheduler named region %r outside %s", meta.region, self.shm_dir
            )
            return None
        if self.region is not None:
            self._unmap()
        try:
            self.region = SharedRegion(meta.region, meta.region_bytes, create=False)
        except (OSError, ValueError) as e:
            logger.error("encoderpool: cannot map the rdma region %s: %r", meta.region, e)
            return None
        return self.region

    def _unmap(self) -> None:
        """Unmap the region, never under a write (saves queued for it are dropped)."""
        with self._region_lock:
            if self.region is not None:
                self.region.close()
                self.region = None

    # ---- producer ----

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor], meta: RdmaMetadata) -> None:
        """Take this step's plans; items already in the encoder cache are queued now (vLLM will
        not encode them again, so ``save_caches`` would never fire for them)."""
        now = time.monotonic()
        for mm_hash in [h for h, (_, t) in self._pending.items() if now - t > self.ttl]:
            del self._pending[mm_hash]
            self.stats.add("saves_dropped")
        if not meta.writes:
            self._summary()
            return
        if self._map(meta) is None:
            self.stats.add("saves_dropped", len(meta.writes))
            return
        for plan in meta.writes:
            self._pending[plan.mm_hash] = (plan, now)
            if plan.mm_hash in encoder_cache:
                self.save_caches(encoder_cache, plan.mm_hash)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        """Queue the output for the writer; never waits for a copy, a hash or the writer."""
        entry = self._pending.pop(mm_hash, None)
        tensor = encoder_cache.get(mm_hash)
        if entry is None or tensor is None or self.region is None or self.writer is None:
            if tensor is not None:  # no plan for it, or the region could not be mapped
                self.stats.add("saves_dropped")
            return
        try:
            self._queue(*entry, tensor)
        except Exception as e:  # never fail the encoder step over a save
            self.stats.add("saves_dropped")
            logger.warning(
                "encoderpool: queueing item %r for rdma memory failed: %r", mm_hash[:80], e
            )

    def _queue(self, plan: WritePlan, planned: float, tensor: torch.Tensor) -> None:
        """Mark the slot WRITING and hand the output to the writer; the mark goes again if
        the writer cannot take it (queue full, no staging memory: counted there)."""
        assert self.region is not None
        assert self.writer is not None
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        if nbytes > plan.capacity or not 1 <= t.dim() <= MAX_DIMS:
            self.stats.add("saves_dropped")
            logger.warning(
                "encoderpool: item %r is %d bytes of shape %s, its slot holds %d; not offered",
                plan.mm_hash[:80],
                nbytes,
                tuple(t.shape),
                plan.capacity,
            )
            return
        dtype_name(t.dtype)  # a dtype the header cannot name fails here, not on the writer
        region = self.region
        view = region.view
        # Before the submit: the writer may write the READY header at once.
        view[plan.offset : plan.offset + MARK_BYTES] = pack_writing(plan.generation)
        queued = False
        try:
            queued = self.writer.submit(plan.mm_hash, t, SlotWrite(plan, region, planned))
        finally:
            if not queued:
                view[plan.offset : plan.offset + 8] = bytes(8)

    def flush(self) -> None:
        """Wait until every queued save is written or dropped (tests, benchmarks)."""
        if self.writer is not None:
            self.writer.flush()

    def _summary(self, force: bool = False) -> None:
        """The producer's own log line: vLLM's V1 runner drops a producer worker's stats."""
        if self.is_producer:
            self.stats.summary(logger, "encoderpool rdma worker", force)

    # ---- consumer ----

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], meta: RdmaMetadata) -> None:
        """Copy out every planned item; one that fails on any rank is encoded by all instead."""
        if not meta.loads:
            return
        region = self._map(meta)
        failed = []
        for plan in meta.loads:
            if plan.mm_hash in encoder_cache:
                self._loaded.add(plan.mm_hash)
                failed.append(False)
                continue
            tensor = self._load(region, plan)
            if tensor is not None:
                encoder_cache[plan.mm_hash] = tensor
            failed.append(tensor is None)
        agreed = self.rank.agree(failed)
        redo = [
            Failing(plan.mm_hash, plan.request_id, plan.index)
            for plan, bad in zip(meta.loads, agreed, strict=True)
            if bad
        ]
        if redo:
            recompute(encoder_cache, meta.encoder_inputs, redo)
            self._failed.update(item.mm_hash for item in redo)

    def _load(self, region: SharedRegion | None, plan: LoadPlan) -> torch.Tensor | None:
        """The verified bytes as a tensor on this worker's device; None (logged) on failure."""
        t0 = time.perf_counter()
        dtype = TORCH_DTYPES[plan.dtype]
        try:
            if self.rank.injected_fault():
                raise OSError(f"test hook: loads on rank {self.rank.rank} fail")
            if region is None:
                raise RuntimeError("the rdma region is not mapped")
            nbytes = payload_bytes(plan.dtype, plan.shape)
            if plan.offset < 0 or plan.offset + nbytes > region.size:
                raise ValueError(f"load of {nbytes} bytes at {plan.offset} is outside the region")
            src = torch.frombuffer(region.map, dtype=torch.uint8, count=nbytes, offset=plan.offset)
            device = self._target_device()
            if device.type == "cpu":
                tensor = src.clone().view(dtype).view(plan.shape)
            else:
                staged = as_tensor(self._buffer(nbytes, device), torch.uint8, (nbytes,))
                staged.copy_(src)
                tensor = staged.view(dtype).view(plan.shape)
                del staged
                if device.type == "cuda":
                    # On the upload stream; the model's stream waits for it on the device and
                    # the pinned buffer stays lent until the copy ran.
                    tensor = (self._uploads or self._make_uploads(device)).start(tensor)
                else:
                    tensor = tensor.to(device)
            del src
            self.stats.add("loads")
            self._loaded.add(plan.mm_hash)
            return tensor
        except (OSError, RuntimeError, ValueError) as e:
            # A log record keeps ``e``; its traceback's frames would keep the load buffer lent.
            e.__traceback__ = None
            logger.error(
                "encoderpool: loading verified item %r failed on rank %d (%r); encoding it "
                "here instead",
                plan.mm_hash[:80],
                self.rank.rank,
                e,
            )
            return None
        finally:
            self.stats.add("load_seconds", time.perf_counter() - t0)

    def _make_uploads(self, device: torch.device) -> DeviceUploads:
        self._uploads = DeviceUploads(device)
        return self._uploads

    def _buffer(self, nbytes: int, device: torch.device) -> np.ndarray:
        """Host memory to stage one load for ``device`` in: a pooled buffer (pinned for
        CUDA), else fresh memory (counted: a slower upload, never a wrong one)."""
        if self._buffers is None:
            self._buffers = LoadBuffers(DEFAULT_LOAD_BUFFER_BYTES, pinned=device.type == "cuda")
        lent = self._buffers.lend_array(nbytes)
        if lent is not None:
            return lent
        if self._buffers.serves(nbytes):
            self.stats.add("load_buffer_fallbacks")
        return np.empty(nbytes, dtype=np.uint8)

    # ---- outputs ----

    def get_ec_connector_stats(self) -> RdmaStats | None:
        stats = self.stats.take()
        return stats if self.rank.lead else None

    def build_connector_worker_meta(self) -> RdmaWorkerMetadata | None:
        """Finished and failed loads, plus counters (the V1 runner drops worker stats); only
        the lead rank's counters, since every rank did the same loads."""
        stats = self.stats.take()
        if stats is not None and not self.rank.lead:
            stats = None
        if not self._loaded and not self._failed and stats is None:
            return None
        loaded, self._loaded = self._loaded, set()
        failed, self._failed = self._failed, set()
        return RdmaWorkerMetadata(loaded=loaded, failed=failed, stats=stats.data if stats else {})

    def shutdown(self) -> None:
        """Write what is queued (the writer logs the producer's totals), then unmap."""
        if self.writer is not None:
            self.writer.close()
        self._unmap()

"""Worker side of the RDMA connector: copy encoder outputs into the registered region
(producer), copy verified items out of it (consumer).

The region is the scheduler's tmpfs file, mapped here on the first step that
names it. A producer's copy is one memcpy plus a BLAKE3 of the payload (a few
milliseconds for a 9 MB item, beside an encoder step of hundreds), done inside
the step so that the slot is complete before the scheduler announces it.
Under tensor parallelism (``core.ranks``) only rank 0 copies in, every rank copies
out, and a load that fails on any rank is encoded by all in the same step.
"""

from __future__ import annotations

import logging
import time

import blake3
import torch

from encoderpool_connector.core.ranks import Failing, Rank, recompute
from encoderpool_connector.core.stats import LockedStats
from encoderpool_connector.core.tensors import TORCH_DTYPES, OnDevice
from encoderpool_connector.rdma.buffer import (
    HEADER_BYTES,
    MAX_DIMS,
    SharedRegion,
    SlotHeader,
    is_region_path,
    key_digest,
)
from encoderpool_connector.rdma.metadata import (
    LoadPlan,
    RdmaMetadata,
    RdmaWorkerMetadata,
    WritePlan,
)
from encoderpool_connector.rdma.stats import RdmaStats
from encoderpool_contracts import ConnectorConfig, dtype_name, payload_bytes

logger = logging.getLogger("vllm.ext." + __name__)


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
            self.region.close()
            self.region = None
        try:
            self.region = SharedRegion(meta.region, meta.region_bytes, create=False)
        except (OSError, ValueError) as e:
            logger.error("encoderpool: cannot map the rdma region %s: %r", meta.region, e)
            return None
        return self.region

    # ---- producer ----

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor], meta: RdmaMetadata) -> None:
        """Take this step's plans; items already in the encoder cache are copied now (vLLM will
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
        entry = self._pending.pop(mm_hash, None)
        tensor = encoder_cache.get(mm_hash)
        if entry is None or tensor is None or self.region is None:
            if tensor is not None:  # no plan for it, or the region could not be mapped
                self.stats.add("saves_dropped")
            return
        try:
            self._write(entry[0], tensor)
        except Exception as e:  # never fail the encoder step over a copy
            self.stats.add("saves_dropped")
            logger.warning(
                "encoderpool: copying item %r to rdma memory failed: %r", mm_hash[:80], e
            )

    def _write(self, plan: WritePlan, tensor: torch.Tensor) -> None:
        t0 = time.perf_counter()
        assert self.region is not None
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
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
        view = self.region.view
        view[plan.offset : plan.offset + 8] = bytes(8)  # invalidate the old header first
        start = plan.offset + HEADER_BYTES
        dst = torch.frombuffer(self.region.map, dtype=torch.uint8, count=nbytes, offset=start)
        dst.copy_(t.view(torch.uint8).reshape(-1))  # torch's copy: several times memoryview's
        del dst
        payload = view[start : start + nbytes]
        digest = blake3.blake3(payload, max_threads=blake3.blake3.AUTO).digest()
        header = SlotHeader(
            plan.generation,
            nbytes,
            dtype_name(t.dtype),
            tuple(int(x) for x in t.shape),
            key_digest(plan.mm_hash),
            digest,
        ).pack()
        view[plan.offset : plan.offset + len(header)] = header
        self.stats.add("saves")
        self.stats.add("save_bytes", nbytes)
        self.stats.add("save_seconds", time.perf_counter() - t0)
        self._summary()

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
            tensor = src.clone().view(dtype).view(plan.shape)
            del src
            device = self._target_device()
            if device.type != "cpu":
                tensor = tensor.to(device)
            self.stats.add("loads")
            self._loaded.add(plan.mm_hash)
            return tensor
        except (OSError, RuntimeError, ValueError) as e:
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
        self._summary(force=True)
        if self.region is not None:
            self.region.close()
            self.region = None

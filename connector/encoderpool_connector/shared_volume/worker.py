"""Worker side of the shared-volume connector: a background writer (producers), loads (consumers).

The producer's ``save_caches`` queues the output for the ``BackgroundWriter``, a
``core.savequeue.SaveQueue`` as the rdma writer is, so the two cannot drift: host
outputs by reference, device outputs through the bounded staging pool on a copy
stream, a full queue or pool dropping the save (counted), never the step waiting.
The writer checksums, writes a temp file, publishes it, and only then lets go of the
output or the lease.

The consumer loads only what the scheduler side verified and pinned, with
one read straight into a reused, already-touched buffer (``core.loadbuffers``):
on CPU the tensor vLLM keeps is a view of it (the buffer is reused only once
vLLM dropped every reference), on CUDA a pinned staging buffer whose copy to
the device runs on a side stream while the next item is read. Under tensor
parallelism (``core.ranks``) only rank 0 writes, every rank loads, and the
scheduler drops a pin once all ranks have.
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from typing import ClassVar

import numpy as np
import torch

from encoderpool_connector.core.loadbuffers import LoadBuffers, as_tensor
from encoderpool_connector.core.ranks import Failing, Rank, recompute
from encoderpool_connector.core.savequeue import QueuedSave, SaveQueue
from encoderpool_connector.core.stats import LockedStats
from encoderpool_connector.core.streams import DeviceUploads
from encoderpool_connector.core.tensors import TORCH_DTYPES, OnDevice
from encoderpool_connector.shared_volume.entry import EntryError, Header, entry_name
from encoderpool_connector.shared_volume.metadata import (
    LoadSpec,
    SharedVolumeMetadata,
    SharedVolumeWorkerMetadata,
)
from encoderpool_connector.shared_volume.split import SplitReader, default_threads
from encoderpool_connector.shared_volume.stats import SharedVolumeStats
from encoderpool_connector.shared_volume.store import SharedStore
from encoderpool_contracts import ConnectorConfig, dtype_name, payload_bytes
from encoderpool_contracts.integrity import checksum

logger = logging.getLogger("vllm.ext." + __name__)

# A consumer worker's load buffers when the config does not set
# shared_volume.load_buffer_bytes.
DEFAULT_LOAD_BUFFER_BYTES = 256 << 20
# A producer's staging memory for device saves (pinned), allocated on its first save: the
# bytes of outputs copied but not yet written. 256 MiB holds a step of eight 16.5 MB
# image embeddings with room to spare, or one output of up to 256 MiB. Host outputs,
# held by reference, are bounded by the same number of bytes.
DEFAULT_SAVE_STAGING_BYTES = 256 << 20


def writer_stats() -> LockedStats[SharedVolumeStats]:
    """Counters shared by the writer thread and the step path."""
    return LockedStats(SharedVolumeStats)


class BackgroundWriter(SaveQueue):
    """One thread that publishes queued encoder outputs as entries of the store
    (``core.savequeue``); ``close`` flushes what is queued."""

    queue_hint: ClassVar[str] = "raise shared_volume.writer_queue or check the volume"

    def __init__(
        self,
        store: SharedStore,
        fingerprint: str,
        maxsize: int,
        stats: LockedStats[SharedVolumeStats],
        staging_bytes: int = DEFAULT_SAVE_STAGING_BYTES,
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        super().__init__(maxsize, stats, staging_bytes)

    def _publish(self, item: QueuedSave) -> None:
        """Checksum the payload, write a temp file and rename it into place (``SharedStore``)."""
        t0 = time.perf_counter()
        try:
            t = item.tensor.contiguous()
            payload = memoryview(t.view(torch.uint8).numpy()).cast("B")
            header = Header(
                mm_hash=item.mm_hash,
                fingerprint=self.fingerprint,
                dtype=dtype_name(t.dtype),
                shape=tuple(int(x) for x in t.shape),
                checksum=checksum(payload),
            )
            result = self.store.publish(entry_name(self.fingerprint, item.mm_hash), header, payload)
        except Exception as e:  # one bad item never stops the writer
            self.stats.add("saves_dropped")
            logger.warning("encoderpool: could not publish item %r: %r", item.mm_hash[:80], e)
            return
        if result.published:
            self.stats.add("published")
            self.stats.add("publish_bytes", header.payload_bytes)
        elif result.reason == "already published":
            self.stats.add("publish_skipped")
        else:
            self.stats.add("saves_dropped")
            if not result.warned:
                logger.warning(
                    "encoderpool: not publishing %r: %s", item.mm_hash[:80], result.reason
                )
        if result.evicted:
            self.stats.add("evicted", result.evicted)
            self.stats.add("evicted_bytes", result.evicted_bytes)
        self.stats.add("write_seconds", time.perf_counter() - t0)


class SharedVolumeWorker(OnDevice):
    """Worker-role logic; the connector class only routes to it."""

    def __init__(
        self,
        config: ConnectorConfig,
        store: SharedStore,
        *,
        is_producer: bool,
        is_consumer: bool,
        rank: Rank | None = None,
    ) -> None:
        sv = config.shared_volume
        assert sv is not None
        self.config = config
        self.store = store
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.rank = rank or Rank()
        self.rank.announce("shared-volume")
        self.stats = writer_stats()
        self._failed: set[str] = set()
        self._released: set[str] = set()
        # Unset stays out of the rendered config, so connectors without the key still start.
        self._buffer_limit = (
            DEFAULT_LOAD_BUFFER_BYTES if sv.load_buffer_bytes is None else sv.load_buffer_bytes
        )
        self._buffers: LoadBuffers | None = None  # made on the first load (needs the device)
        self._load_threads = sv.load_threads
        self._reader: SplitReader | None = None  # made on the first load, on the step's thread
        self._uploads: DeviceUploads | None = None  # made on the first load to a CUDA device
        self._loaded_bytes = 0  # the payload size of the last load, for the step's counters
        self._fallback_logged = False
        self.writer: BackgroundWriter | None = None
        if is_consumer:
            # Resolve the directories now, as the scheduler side does, not at the first
            # load: a directory swapped in between would fail that load.
            store.layout()
        if is_producer and self.rank.lead:  # the other ranks hold the same outputs
            store.prepare_producer()
            self.writer = BackgroundWriter(
                store,
                config.model_fingerprint,
                sv.writer_queue,
                self.stats,
                staging_bytes=DEFAULT_SAVE_STAGING_BYTES,
            )

    # ---- producer ----

    def start_save_caches(
        self, encoder_cache: dict[str, torch.Tensor], metadata: SharedVolumeMetadata
    ) -> None:
        """Nothing to plan: every encoder output goes to the writer as ``save_caches`` sees it."""

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if self.writer is None:
            return
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return
        try:
            self.writer.submit(mm_hash, tensor)
        except Exception as e:  # never fail the encoder step over a save
            self.stats.add("saves_dropped")
            logger.warning("encoderpool: could not queue item %r: %r", mm_hash[:80], e)

    # ---- consumer ----

    def start_load_caches(
        self, encoder_cache: dict[str, torch.Tensor], metadata: SharedVolumeMetadata
    ) -> None:
        """Load every planned entry; one that fails on any rank is encoded by all instead."""
        if not metadata.loads:
            return
        t0 = time.perf_counter()
        failed = []
        loaded = loaded_bytes = 0
        for spec in metadata.loads:
            if spec.pinned:
                self._released.add(spec.name)  # the scheduler drops it after this step
            if spec.mm_hash in encoder_cache:
                failed.append(False)
                continue
            tensor = self._load(spec)
            if tensor is None:
                failed.append(True)
                continue
            encoder_cache[spec.mm_hash] = tensor
            failed.append(False)
            loaded += 1
            loaded_bytes += self._loaded_bytes
        # Counted once per step, not per load: on the step path every call is slow (the
        # copies leave the CPU caches cold), and each counter update is several.
        self.stats.add_many(
            {"loads": loaded, "load_bytes": loaded_bytes, "load_seconds": time.perf_counter() - t0}
        )
        if self.rank.world_size == 1 and True not in failed:
            return  # nothing to agree on with other ranks, nothing to encode instead
        agreed = self.rank.agree(failed)  # every rank calls it (a collective under TP)
        redo = [
            Failing(spec.mm_hash, spec.request_id, spec.index)
            for spec, bad in zip(metadata.loads, agreed, strict=True)
            if bad
        ]
        if redo:
            recompute(encoder_cache, metadata.encoder_inputs, redo)
            self._failed.update(item.mm_hash for item in redo)

    def _load(self, spec: LoadSpec) -> torch.Tensor | None:
        """The entry as a tensor on this worker's device; None (logged) on failure.

        The hot path is a handful of calls around the payload read (one ``preadv``, or
        parts on several threads for a large payload): the scheduler already verified the
        entry (checksum, mac, header) and hands over its dtype, shape, inode and payload
        offset, so nothing here parses or hashes.
        """
        try:
            if self.rank.injected_fault():
                raise OSError(f"test hook: loads on rank {self.rank.rank} fail")
            nbytes = self._loaded_bytes = payload_bytes(spec.dtype, spec.shape)
            device = self._target_device()
            target = self._buffer(nbytes, device)
            # Under the root's fds, never through a link, only the verified inode, and
            # only at the verified size: a directory swapped meanwhile cannot hand this
            # worker other bytes.
            fd = self.store.open_verified(spec.subdir, spec.name, spec.inode, spec.offset + nbytes)
            try:
                # Large payloads in parts on the worker's cores (or as configured); every
                # part is done before this returns or raises, so the fd and buffer outlive
                # them. The tensor is made while the helpers may still be reading.
                tensor = (self._reader or self._split_reader()).read_and(
                    fd,
                    target,
                    spec.offset,
                    nbytes,
                    partial(as_tensor, target, TORCH_DTYPES[spec.dtype], spec.shape),
                )
            finally:
                os.close(fd)
            if device.type == "cuda":
                # On the upload stream, while this thread reads the next item; the buffer
                # stays lent until the copy ran.
                tensor = (self._uploads or self._make_uploads(device)).start(tensor)
            elif device.type != "cpu":
                # A synchronous copy: once it returns the staging buffer is free again.
                tensor = tensor.to(device)
            return tensor
        except (EntryError, OSError, RuntimeError, ValueError) as e:
            # A log record keeps ``e``; its traceback's frames would keep the load buffer lent.
            e.__traceback__ = None
            logger.error(
                "encoderpool: loading verified item %r from %s failed on rank %d (%r); "
                "encoding it here instead",
                spec.mm_hash[:80],
                spec.path,
                self.rank.rank,
                e,
            )
            return None

    def _make_uploads(self, device: torch.device) -> DeviceUploads:
        self._uploads = DeviceUploads(device)
        return self._uploads

    def _split_reader(self) -> SplitReader:
        """Made on the first load, on the thread that loads: the default thread count
        follows that thread's CPU affinity, which the helpers inherit."""
        if self._reader is None:
            threads = self._load_threads or default_threads()
            self._reader = SplitReader(threads)
            logger.info("encoderpool: large entries are read with %d thread(s)", threads)
        return self._reader

    def _buffer(self, nbytes: int, device: torch.device) -> np.ndarray:
        """Host memory for one payload, the flat bytes to read into (``as_tensor`` makes
        the tensor over them): a pooled buffer, else fresh memory."""
        if self._buffers is None:
            self._buffers = LoadBuffers(self._buffer_limit, pinned=device.type == "cuda")
        lent = self._buffers.lend_array(nbytes)
        if lent is not None:
            return lent
        if self._buffers.serves(nbytes):
            self.stats.add("load_buffer_fallbacks")
            if not self._fallback_logged:
                self._fallback_logged = True
                logger.warning(
                    "encoderpool: all %d bytes of load buffers are in use; loading into fresh "
                    "memory (slower; raise shared_volume.load_buffer_bytes)",
                    self._buffers.limit_bytes,
                )
        return np.empty(nbytes, dtype=np.uint8)

    # ---- outputs ----

    def get_ec_connector_stats(self) -> SharedVolumeStats | None:
        stats = self.stats.take()
        return stats if self.rank.lead else None

    def build_connector_worker_meta(self) -> SharedVolumeWorkerMetadata | None:
        """Failed loads, released pins, and counters not yet taken by
        ``get_ec_connector_stats`` (V1 runner); only the lead rank's counters."""
        stats = self.stats.take()
        if stats is not None and not self.rank.lead:
            stats = None  # the lead did the same loads: one count per item, not per rank
        if not self._failed and not self._released and stats is None:
            return None
        failed, self._failed = self._failed, set()
        released, self._released = self._released, set()
        return SharedVolumeWorkerMetadata(
            failed=failed, released=released, stats=stats.data if stats else {}
        )

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._reader is not None:
            self._reader.close()

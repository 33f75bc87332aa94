"""Worker side of the shared-volume connector: a background writer (producers), loads (consumers).

The producer's ``save_caches`` queues the output for the ``BackgroundWriter``.
A host (CPU) output is queued as it is, by reference: vLLM never writes an
encoder output again, so copying it on the step would only cost the step. A
device output is copied into a lease of the writer's staging pool
(``core.staging``: pinned host memory allocated once) on a copy stream after the
encoder's work (``core.streams``), and the writer thread waits for it, never the
step. The writer checksums, writes a temp file, publishes it, and only then lets
go of the output or the lease. A full queue, or outputs past the staging limit,
drop the save (counted) instead of stalling the encoder or allocating on its step.

The consumer loads only what the scheduler side verified and pinned, with
one read straight into a reused, already-touched buffer (``core.loadbuffers``):
on CPU the tensor vLLM keeps is a view of it (the buffer is reused only once
vLLM dropped every reference), on CUDA a pinned staging buffer whose copy to
the device runs on a side stream while the next item is read. Under tensor
parallelism (``core.ranks``) only rank 0 writes, every rank loads, and the
scheduler drops a pin once all ranks have.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from encoderpool_connector.core.loadbuffers import LoadBuffers, as_tensor
from encoderpool_connector.core.ranks import Failing, Rank, recompute
from encoderpool_connector.core.staging import HeldBytes, StagingLease, StagingPool
from encoderpool_connector.core.stats import LockedStats
from encoderpool_connector.core.streams import CopyQueued, DeviceUploads, SaveCopies
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
# The writer starts on a save only once no other was submitted for this long. A step
# submits its outputs in one burst, and every torch call in a submit lets the GIL go: a
# writer already running Python would hold each submit up to the interpreter's switch
# interval (5 ms; measured on the 2-core VM: 5.3 ms per submit instead of 0.014).
WRITER_QUIET_S = 0.002
# ...but never waits longer than this for a quiet moment (saves that never pause).
WRITER_QUIET_MAX_S = 0.02


@dataclass
class _Save:
    mm_hash: str
    # A device output's bytes in ``lease`` (a view of the staging pool), or a host output
    # itself (held by reference, ``held`` bytes of the writer's budget).
    tensor: torch.Tensor
    ready: Any  # a device event to wait on before reading ``tensor``, or None
    lease: StagingLease | None  # given back once the entry is written (or failed)
    held: int = 0


def writer_stats() -> LockedStats[SharedVolumeStats]:
    """Counters shared by the writer thread and the step path."""
    return LockedStats(SharedVolumeStats)


class BackgroundWriter:
    """One thread that publishes queued encoder outputs; ``close`` flushes what is queued."""

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
        self.stats = stats
        self.staging = StagingPool(staging_bytes)
        self.held = HeldBytes(self.staging.limit_bytes)
        self._copies: SaveCopies | None = None  # made on the first CUDA save
        self._queue: queue.Queue[_Save | None] = queue.Queue(maxsize=maxsize)
        self._dropped_logged = 0.0
        self._staging_logged = 0.0
        self._last_submit = 0.0  # monotonic time of the latest submit (see WRITER_QUIET_S)
        # Daemon plus an atexit flush: vLLM calls shutdown() on some exit paths only, and a
        # non-daemon thread would keep a worker that skipped it from ever exiting.
        self._thread = threading.Thread(target=self._run, name="ep-writer", daemon=True)
        self._thread.start()
        self._closed = False
        atexit.register(self.close)

    def submit(self, mm_hash: str, tensor: torch.Tensor) -> bool:
        """Queue a save without blocking, allocating, or (host outputs) copying; False (and
        counted) when the queue is full or the staging limit is reached."""
        self._last_submit = time.monotonic()
        if self._queue.full():  # checked first: a save that cannot be queued is not copied
            self._drop_queue_full()
            return False
        t = tensor.detach()
        if self.by_reference(t):
            nbytes = t.numel() * t.element_size()
            save = _Save(mm_hash, t, None, None, nbytes) if self.held.take(nbytes) else None
        else:
            staged = self._to_host(t)
            save = None if staged is None else _Save(mm_hash, *staged)
        if save is None:
            self._drop_no_staging(t)
            return False
        try:
            self._queue.put_nowait(save)
        except queue.Full:  # another thread filled it meanwhile
            self._let_go(save, after=save.ready)
            self._drop_queue_full()
            return False
        self.stats.add("saves_queued")
        return True

    @staticmethod
    def by_reference(tensor: torch.Tensor) -> bool:
        """Whether the writer keeps the output itself rather than a staged copy: host
        memory, which vLLM only reads after the step and frees by dropping its reference
        (the encoder cache's ``pop``), so the bytes stay as they were while the writer
        holds them."""
        return bool(tensor.device.type == "cpu")

    def _let_go(self, save: _Save, after: Any = None) -> None:
        """Give back what ``save`` holds: its staging lease (once ``after`` reports done)
        or its bytes of the reference budget."""
        if save.lease is not None:
            self.staging.give_back(save.lease, after=after)
        if save.held:
            self.held.give_back(save.held)

    def _drop_queue_full(self) -> None:
        self.stats.add("saves_dropped")
        now = time.monotonic()
        if now - self._dropped_logged > 10:
            self._dropped_logged = now
            logger.warning(
                "encoderpool: writer queue full (%d); dropping saves, consumers will "
                "encode those items (raise shared_volume.writer_queue or check the volume)",
                self._queue.maxsize,
            )

    def _drop_no_staging(self, tensor: torch.Tensor) -> None:
        self.stats.add_many({"saves_dropped": 1, "saves_dropped_staging": 1})
        now = time.monotonic()
        if now - self._staging_logged > 10:
            self._staging_logged = now
            if self.by_reference(tensor):
                logger.warning(
                    "encoderpool: outputs waiting for the writer hold %d of %d bytes; dropping "
                    "a save of %d bytes, consumers will encode those items (the writer is "
                    "behind, or the output is bigger than the limit)",
                    self.held.held,
                    self.held.limit_bytes,
                    tensor.numel() * tensor.element_size(),
                )
                return
            logger.warning(
                "encoderpool: no free staging memory for a save of %d bytes (%d of %d free, "
                "largest range %d); dropping saves, consumers will encode those items "
                "(the writer is behind, or the output is bigger than the staging pool)",
                tensor.numel() * tensor.element_size(),
                self.staging.free_bytes,
                self.staging.limit_bytes,
                self.staging.largest_free,
            )

    def _to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any, StagingLease] | None:
        """The save's bytes in a staging lease, with the event to wait on before reading
        them (None where the copy is done on return); None when the pool has no free
        range that fits (the save is dropped: nothing is allocated, nothing waited for).

        CUDA: queued on the copy stream after the work already queued on the current
        stream (the encoder's); the writer thread waits for its event. Other
        accelerators: queued on the current stream, likewise waited for by the writer.
        A host tensor (only where ``by_reference`` says no): copied here."""
        t = tensor.detach()
        kind = t.device.type
        lease = self.staging.take(t.numel() * t.element_size(), pinned=kind != "cpu")
        if lease is None:
            return None
        host = lease.view(t.dtype, tuple(t.shape))
        ready: Any = None
        try:
            if kind == "cpu":
                host.copy_(t)
            elif kind == "cuda":
                if self._copies is None:
                    self._copies = SaveCopies()
                ready = self._copies.start(host, t)
            else:
                host.copy_(t, non_blocking=True)
                ready = torch.Event()
                ready.record()
        except CopyQueued:
            # A copy may still write into the lease: it stays lent (those bytes of the pool
            # are lost) rather than be reused under it.
            logger.error(
                "encoderpool: a staging copy failed after it was queued; %d bytes of staging "
                "memory stay out of use",
                lease.size,
            )
            raise
        except BaseException:
            self.staging.give_back(lease)
            raise
        return host, ready, lease

    def flush(self) -> None:
        """Block until everything queued so far is written (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self, timeout: float = 60.0) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(None)
        self._thread.join(timeout)
        self.stats.summary(logger, "encoderpool writer", force=True)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._let_the_step_finish()
                self._write(item)
            finally:
                self._queue.task_done()
            del item  # a host output held by reference goes now, not at the next save
            self.stats.summary(logger, "encoderpool writer")

    def _let_the_step_finish(self) -> None:
        """Sleep (the GIL free) until no save was submitted for ``WRITER_QUIET_S``, or
        ``WRITER_QUIET_MAX_S`` passed."""
        start = now = time.monotonic()
        while now - start < WRITER_QUIET_MAX_S:
            quiet = now - self._last_submit
            if quiet >= WRITER_QUIET_S:
                return
            time.sleep(min(WRITER_QUIET_S - quiet, WRITER_QUIET_S))
            now = time.monotonic()

    def _write(self, item: _Save) -> None:
        """Publish one save, then let go of its bytes: staging bytes are reused only after
        the copy into them finished and the entry was written from them."""
        if item.ready is not None:
            try:
                item.ready.synchronize()  # this thread waits for the copy, never the step
            except Exception as e:
                # The copy's state is unknown: its bytes stay lent rather than be reused
                # under a copy that may still write them.
                self.stats.add("saves_dropped")
                logger.error(
                    "encoderpool: waiting for the staging copy of %r failed (%r); %d bytes of "
                    "staging memory stay out of use",
                    item.mm_hash[:80],
                    e,
                    item.lease.size if item.lease is not None else 0,
                )
                return
        try:
            self._publish(item)
        finally:
            self._let_go(item)

    def _publish(self, item: _Save) -> None:
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

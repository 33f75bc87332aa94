"""A producer's saves off the encoder step: queued there, written by one thread.

The step only hands an output over (``SaveQueue.submit``). A host (CPU) output is
queued as it is, by reference: vLLM never writes an encoder output again, so copying
it on the step would only cost the step. A device output is copied into a lease of
the queue's staging pool (``core.staging``: pinned host memory allocated once) on a
copy stream after the encoder's work (``core.streams``); the writer thread waits for
the copy's event, never the step. The writer then hands the bytes to the transport's
``_publish`` and only after it returned lets go of the output or the lease. A full
queue, or outputs past the staging limit, drop the save (counted) instead of
stalling the encoder or allocating on its step.

Counters (each transport declares them in its table): ``saves_queued``,
``saves_dropped``, ``saves_dropped_staging``. A transport subclasses ``SaveQueue``
with its ``_publish`` (and ``_dropped`` for a queued save the writer gives up on): the
shared volume's ``BackgroundWriter`` and the rdma writer do.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from encoderpool_connector.core.staging import HeldBytes, StagingLease, StagingPool
from encoderpool_connector.core.stats import LockedStats
from encoderpool_connector.core.streams import CopyQueued, SaveCopies

logger = logging.getLogger("vllm.ext." + __name__)

# The writer starts on a save only once no other was submitted for this long. A step
# submits its outputs in one burst, and every torch call in a submit lets the GIL go: a
# writer already running Python would hold each submit up to the interpreter's switch
# interval (5 ms; measured on the 2-core VM: 5.3 ms per submit instead of 0.014).
WRITER_QUIET_S = 0.002
# ...but never waits longer than this for a quiet moment (saves that never pause).
WRITER_QUIET_MAX_S = 0.02


@dataclass
class QueuedSave:
    """One save between the step and the writer."""

    mm_hash: str
    # A device output's bytes in ``lease`` (a view of the staging pool), or a host output
    # itself (held by reference, ``held`` bytes of the writer's budget).
    tensor: torch.Tensor
    ready: Any  # a device event to wait on before reading ``tensor``, or None
    lease: StagingLease | None  # given back once the entry is written (or failed)
    held: int = 0
    plan: Any = None  # what the transport needs to publish it (``submit``'s ``plan``)


class SaveQueue:
    """One thread that publishes queued encoder outputs; ``close`` flushes what is queued."""

    thread_name: ClassVar[str] = "ep-writer"
    what: ClassVar[str] = "encoderpool writer"
    """How the periodic totals line names this writer."""
    queue_hint: ClassVar[str] = "raise the writer queue"
    """What the queue-full warning tells an operator to do."""
    quiet_s: ClassVar[float] = WRITER_QUIET_S
    quiet_max_s: ClassVar[float] = WRITER_QUIET_MAX_S

    def __init__(self, maxsize: int, stats: LockedStats[Any], staging_bytes: int) -> None:
        self.stats = stats
        self.staging = StagingPool(staging_bytes)
        self.held = HeldBytes(self.staging.limit_bytes)
        self._copies: SaveCopies | None = None  # made on the first CUDA save
        self._queue: queue.Queue[QueuedSave | None] = queue.Queue(maxsize=maxsize)
        self._dropped_logged = 0.0
        self._staging_logged = 0.0
        self._last_submit = 0.0  # monotonic time of the latest submit (see WRITER_QUIET_S)
        # Daemon plus an atexit flush: vLLM calls shutdown() on some exit paths only, and a
        # non-daemon thread would keep a worker that skipped it from ever exiting.
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        self._closed = False
        atexit.register(self.close)

    # ---- the step's side ----

    def submit(self, mm_hash: str, tensor: torch.Tensor, plan: Any = None) -> bool:
        """Queue a save without blocking, allocating, or (host outputs) copying; False (and
        counted) when the queue is full or the staging limit is reached."""
        self._last_submit = time.monotonic()
        if self._queue.full():  # checked first: a save that cannot be queued is not copied
            self._drop_queue_full()
            return False
        t = tensor.detach()
        if self.by_reference(t):
            nbytes = t.numel() * t.element_size()
            save = (
                QueuedSave(mm_hash, t, None, None, nbytes, plan) if self.held.take(nbytes) else None
            )
        else:
            staged = self._to_host(t)
            save = None if staged is None else QueuedSave(mm_hash, *staged, plan=plan)
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

    def _let_go(self, save: QueuedSave, after: Any = None) -> None:
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
                "encode those items (%s)",
                self._queue.maxsize,
                self.queue_hint,
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

    # ---- lifetime ----

    def flush(self) -> None:
        """Block until everything queued so far is written (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued (up to ``timeout``), then stop the thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(None)
        self._thread.join(timeout)
        self.stats.summary(logger, self.what, force=True)

    # ---- the writer's side ----

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
            self.stats.summary(logger, self.what)

    def _let_the_step_finish(self) -> None:
        """Sleep (the GIL free) until no save was submitted for ``quiet_s``, or
        ``quiet_max_s`` passed."""
        start = now = time.monotonic()
        while now - start < self.quiet_max_s:
            quiet = now - self._last_submit
            if quiet >= self.quiet_s:
                return
            time.sleep(min(self.quiet_s - quiet, self.quiet_s))
            now = time.monotonic()

    def _write(self, item: QueuedSave) -> None:
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
                self._dropped(item)
                return
        try:
            self._publish(item)
        finally:
            self._let_go(item)

    def _publish(self, item: QueuedSave) -> None:
        """Write ``item`` where consumers find it (the writer's thread). Never raises for one
        bad item: it counts and logs it."""
        raise NotImplementedError

    def _dropped(self, item: QueuedSave) -> None:
        """A queued save the writer gave up on before ``_publish`` (already counted)."""

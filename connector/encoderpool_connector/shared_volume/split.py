"""Reading one large payload in parts on more than one thread.

One ``preadv`` of a 9.3 MB payload out of the page cache is one thread copying;
a second core sits idle (vLLM's example connector gets both through torch's
parallel ``clone``). ``os.preadv`` releases the GIL, so a payload split in parts,
the calling thread reading the first and persistent helper threads the others,
copies on as many cores at once.

Bounded by construction: the helpers are made once per reader (one reader per
worker), each has a mailbox of one job, and the caller waits for every part
before it returns, so there is never more than one job per helper in flight and
never a thread per load. A second thread calling ``read`` while one is inside it
reads alone rather than queue behind it.

Safety is the caller's, unchanged: it opened the verified inode at the verified
size, and each part is read from that same fd. A short read or an error in any
part fails the whole read (``EntryError``: the load is a miss), and ``read``
returns or raises only after every part finished, so neither the fd nor the
buffer is released while a helper still uses it (the helper's job also holds the
buffer itself, never only a numpy slice of it: a slice does not keep its parent,
and the pool's weakref, alive).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from encoderpool_connector.shared_volume.entry import EntryError, read_payload

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger("vllm.ext." + __name__)

T = TypeVar("T")

# Payloads below this are read by the calling thread alone. The caller waits ~60-200 us
# for the helper's part (mostly its wake-up) on the 2-core VM measured
# (docs/benchmarks-connector.md): two parts took 0.90-1.14 of one read's
# time at 4 MiB, 0.84-1.05 at 6 MiB, 0.81-0.95 at 8 MiB.
MIN_SPLIT_BYTES = 6 << 20
# Where parts may start, relative to the payload: whole pages of the destination.
_PART_GRAIN = 64 << 10
# A part is at least this big: two parts at MIN_SPLIT_BYTES, as measured; more threads
# split only larger payloads further, so a helper's wake-up (~60-200 us) stays small
# beside the copy of its part.
MIN_PART_BYTES = MIN_SPLIT_BYTES // 2
# More helpers than this are not worth a thread each (and were never measured).
MAX_THREADS = 8
# cgroup v2's CPU limit of this container ("<quota> <period>", or "max <period>").
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def usable_cpus() -> int:
    """The CPUs this thread may run on: its affinity mask, lowered to the container's CPU
    quota where one is set (a pod limited to 4 CPUs on a 128-core node usually still has
    all 128 in its mask)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        with open(CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):  # no cgroup v2 limit readable: the mask alone
        pass
    return max(1, cpus)


def default_threads() -> int:
    """Threads per read when the config leaves it unset: one per CPU this thread may use
    (``usable_cpus``), at most ``MAX_THREADS``. Two copies at once beat one on a 2-core
    VM; a big node's loads are bounded by how many cores copy at once.

    ``sched_getaffinity(0)`` is the calling thread's mask, and a thread started later
    inherits it: a worker pinned to one core gets no helper that would only share it.
    """
    return min(usable_cpus(), MAX_THREADS)


def _nothing() -> None:
    return None


class _Job:
    """One part: read ``nbytes`` of ``fd`` at ``offset + start`` into ``out[start:]``."""

    __slots__ = ("fd", "nbytes", "offset", "out", "start")

    def __init__(self, fd: int, out: np.ndarray, offset: int, start: int, nbytes: int) -> None:
        self.fd = fd
        self.out = out  # the whole buffer: keeps it (and the pool's slot) lent
        self.offset = offset
        self.start = start
        self.nbytes = nbytes


class _Helper:
    """One persistent thread with a one-job mailbox: ``go`` hands it a job, ``done`` says
    the job finished. Two plain locks used as binary semaphores: the cheapest hand-off
    Python has, on a path where every call runs with cold CPU caches."""

    def __init__(self, name: str) -> None:
        self.job: _Job | None = None
        self.error: BaseException | None = None
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._closed = False
        # Daemon, as the writer: vLLM calls shutdown() on some exit paths only, and an idle
        # non-daemon thread would keep such a worker from exiting. An idle helper holds
        # nothing (no fd, no buffer) between reads.
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def start(self, job: _Job) -> None:
        self.job = job
        self.error = None
        self._go.release()

    def wait(self) -> BaseException | None:
        """Block until the job given to ``start`` finished; its error, if any."""
        self._done.acquire()
        return self.error

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.job = None
        self._go.release()  # a job of None: the thread returns
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self._go.acquire()
            job = self.job
            if job is None:
                return
            try:
                read_payload(
                    job.fd,
                    job.out[job.start : job.start + job.nbytes],
                    job.offset + job.start,
                    job.nbytes,
                )
            except BaseException as e:  # reported to the caller, never lost with the thread
                e.__traceback__ = None  # its frames hold the buffer
                self.error = e
            finally:
                self.job = job = None  # the buffer is free to go once the caller is done
                self._done.release()


class SplitReader:
    """Reads payloads of ``MIN_SPLIT_BYTES`` or more in up to ``threads`` parts at once,
    each at least ``MIN_PART_BYTES`` (the calling thread plus ``threads - 1`` helpers,
    made on the first such read)."""

    def __init__(self, threads: int, min_split_bytes: int = MIN_SPLIT_BYTES) -> None:
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be 1..{MAX_THREADS}, got {threads}")
        self.threads = threads
        self.min_split_bytes = max(min_split_bytes, _PART_GRAIN * threads)
        self._helpers: list[_Helper] = []
        self._busy = threading.Lock()
        self._closed = False

    @property
    def helper_threads(self) -> list[threading.Thread]:
        """The helpers started so far (tests, logs)."""
        return [h.thread for h in self._helpers]

    def read(self, fd: int, out: np.ndarray, offset: int, nbytes: int) -> None:
        """Fill ``out`` (a flat uint8 array of exactly ``nbytes``) from ``fd`` at ``offset``.

        EntryError when the file ends early in any part, OSError when a read fails; either
        way only after every part stopped."""
        self.read_and(fd, out, offset, nbytes, _nothing)

    def read_and(
        self, fd: int, out: np.ndarray, offset: int, nbytes: int, meanwhile: Callable[[], T]
    ) -> T:
        """``read``, and ``meanwhile()`` on the calling thread once its own part is read,
        while the helpers may still read theirs (the load makes its tensor there, off the
        copy's critical path); returns what ``meanwhile`` returned."""
        if (
            self.threads > 1
            and nbytes >= self.min_split_bytes
            and self._busy.acquire(blocking=False)  # else another read holds the helpers
        ):
            try:
                if not self._closed:  # read under the lock: close() takes it too
                    return self._split(fd, out, offset, nbytes, meanwhile)
            finally:
                self._busy.release()
        read_payload(fd, out, offset, nbytes)  # small, one thread, busy or closed: alone
        return meanwhile()

    def _split(
        self, fd: int, out: np.ndarray, offset: int, nbytes: int, meanwhile: Callable[[], T]
    ) -> T:
        if len(out) != nbytes:
            raise EntryError(f"buffer of {len(out)} bytes for a payload of {nbytes}")
        if not self._helpers:  # once per reader, on its first large read
            self._helpers = [_Helper(f"ep-load-{i}") for i in range(1, self.threads)]
        parts = max(2, min(self.threads, nbytes // MIN_PART_BYTES))
        part = -(-nbytes // parts // _PART_GRAIN) * _PART_GRAIN
        started = []
        try:
            for i, helper in enumerate(self._helpers, start=1):
                start = i * part
                if start >= nbytes:
                    break
                helper.start(_Job(fd, out, offset, start, min(part, nbytes - start)))
                started.append(helper)
            read_payload(fd, out[:part], offset, part)
            result = meanwhile()
        finally:
            # Every started part finishes before anything is raised or returned: the fd is
            # closed and the buffer may be reused only after this.
            errors = [e for e in (h.wait() for h in started) if e is not None]
        if errors:
            e = errors[0]
            if isinstance(e, (EntryError, OSError)):
                raise e
            raise EntryError(f"a read helper failed: {e!r}")
        return result

    def close(self) -> None:
        """Stop the helpers (shutdown); later reads use the calling thread alone."""
        self._closed = True
        with self._busy:
            helpers, self._helpers = self._helpers, []
        for h in helpers:
            h.close()

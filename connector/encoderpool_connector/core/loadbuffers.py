"""Reusable, already-touched host buffers that loads read entries into.

A load that reads into a freshly allocated tensor pays a page fault for every
4 KiB page it first writes (about 2,300 for a 9.3 MB embedding), which costs
as much as the copy out of the page cache itself. ``LoadBuffers`` keeps a
bounded set of slots whose pages were touched once, when the slot was made,
and hands out tensors over them.

Lifetime, so that nothing vLLM keeps is ever overwritten: a tensor handed out
owns a storage of its own (``torch.frombuffer`` over a numpy view of the
slot), and the slot goes back to the pool only when that storage is freed,
that is when the tensor and every view or slice of it are gone. On CPU vLLM
keeps the tensor in its encoder cache until the scheduler frees the item, and
the slot is reused after that; on an accelerator the worker copies it to the
device and drops it at once, so the slot is a (pinned) staging buffer reused
by the next load. When every slot is out and the byte limit is reached,
``take`` returns None and the caller allocates a fresh tensor (a slower load,
never a wrong one).

Slots are created on demand, sized to the payload (rounded up), so the pool
follows the largest entries seen; a slot too small for what is asked is
dropped when its bytes are needed for a bigger one.
"""

from __future__ import annotations

import collections
import logging
import mmap
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger("vllm.ext." + __name__)

# Below this a fresh allocation is about as fast (malloc reuses warm heap memory)
# and a slot would mostly hold unused bytes.
MIN_POOLED_BYTES = 1 << 20
# Slot sizes are multiples of a transparent huge page.
_GRAIN = 2 << 20
_PAGE = mmap.PAGESIZE


@dataclass(eq=False)
class _Slot:
    memory: torch.Tensor  # uint8, ``capacity`` bytes, every page touched
    array: np.ndarray = field(init=False)  # the same bytes, the base of what is handed out

    def __post_init__(self) -> None:
        self.array = self.memory.numpy()

    @property
    def capacity(self) -> int:
        return int(self.memory.numel())


def _slot_capacity(nbytes: int, pinned: bool) -> int:
    if pinned:
        # torch's pinned host allocator rounds every block up to a power of two;
        # asking for one keeps the byte accounting exact.
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // _GRAIN) * _GRAIN


def _allocate(capacity: int, pinned: bool) -> torch.Tensor:
    """``capacity`` bytes of host memory, every page already faulted in."""
    if pinned:
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=True)  # resident once pinned
    # Anonymous memory of our own, so it can ask for huge pages (fewer faults now, fewer
    # TLB misses in every copy later) whatever the process's allocator does.
    region = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    # The first touch, here rather than on a load: one write per page (the kernel
    # zeroes it; with huge pages only one write in 512 faults).
    memory.numpy()[::_PAGE] = 0
    return memory


def as_tensor(array: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of ``array`` as a tensor of ``dtype`` and ``shape`` with a storage of its
    own that keeps ``array`` alive (one ``frombuffer``, one ``view``)."""
    return torch.frombuffer(array, dtype=dtype).view(shape)


class LoadBuffers:
    """A pool of host buffers for loads, at most ``limit_bytes`` in slots (lent or free)."""

    def __init__(self, limit_bytes: int, *, pinned: bool = False) -> None:
        self.limit_bytes = limit_bytes
        self.pinned = pinned
        self.held_bytes = 0
        self._free: list[_Slot] = []
        # Slots whose tensor was freed. Appended from wherever the last reference
        # dies (any thread, even inside a garbage collection that interrupts
        # ``take``), so it is a deque (atomic append) and not guarded by the lock.
        self._returned: collections.deque[_Slot] = collections.deque()
        self._lent: dict[int, tuple[weakref.ref[np.ndarray], _Slot]] = {}
        self._lock = threading.Lock()

    def serves(self, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` is meant to come from the pool at all."""
        return MIN_POOLED_BYTES <= nbytes <= self.limit_bytes

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of exactly ``nbytes`` over a touched slot, or None when the pool
        does not serve that size or every slot is lent and the limit is reached.

        The slot returns to the pool when the tensor and all its views are freed.
        """
        array = self.lend_array(nbytes)
        return None if array is None else as_tensor(array, torch.uint8, (nbytes,))

    def lend_array(self, nbytes: int) -> np.ndarray | None:
        """A flat uint8 array of ``nbytes`` over a touched slot, to read into and then
        hand out with ``as_tensor``; the slot returns when the array, every tensor over
        it and every view of those are gone.

        Few steps, as a load is on the step path right after (or before) a copy that
        leaves the CPU caches cold, where each Python or torch call costs 10-50x its
        warm figure: a slice and a bare weakref.
        """
        if not self.serves(nbytes):
            return None
        with self._lock:
            while self._returned:
                self._free.append(self._returned.popleft())
            slot = self._best_fit(nbytes) or self._grow(nbytes)
        if slot is None:
            return None
        # The tensor's storage holds ``array`` (frombuffer keeps its buffer object alive
        # until the storage is freed), so the weakref's callback runs exactly when the
        # tensor and every view of it are gone. The ref is kept in ``_lent`` until then.
        array = slot.array[:nbytes]
        ref = weakref.ref(array, self._on_free)
        self._lent[id(ref)] = (ref, slot)
        return array

    def _on_free(self, ref: weakref.ref[np.ndarray]) -> None:
        """The lent array died (any thread, even inside a garbage collection): its slot is
        free again. A dict pop and a deque append are atomic; no lock."""
        self._returned.append(self._lent.pop(id(ref))[1])

    def _best_fit(self, nbytes: int) -> _Slot | None:
        best = None
        for s in self._free:
            if s.capacity >= nbytes and (best is None or s.capacity < best.capacity):
                best = s
        if best is not None:
            self._free.remove(best)
        return best

    def _grow(self, nbytes: int) -> _Slot | None:
        """A new slot, after dropping free ones (all too small) if the limit needs it."""
        capacity = _slot_capacity(nbytes, self.pinned)
        if capacity > self.limit_bytes:
            return None
        self._free.sort(key=lambda s: s.capacity)
        while self.held_bytes + capacity > self.limit_bytes and self._free:
            self.held_bytes -= self._free.pop(0).capacity
        if self.held_bytes + capacity > self.limit_bytes:
            return None
        try:
            slot = _Slot(_allocate(capacity, self.pinned))
        except (MemoryError, OSError, RuntimeError) as e:  # e.g. a pinned-memory limit
            logger.warning("encoderpool: no load buffer of %d bytes (%r)", capacity, e)
            return None
        self.held_bytes += capacity
        return slot

    @property
    def free_slots(self) -> int:
        """Slots not lent out right now (tests, logs)."""
        with self._lock:
            return len(self._free) + len(self._returned)

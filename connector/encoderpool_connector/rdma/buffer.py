"""Host memory of the RDMA transport: a shared region, its slot allocator, and slot headers.

vLLM runs the scheduler (engine core) and the model runner (worker) in
separate processes on CPU (the mp executor is forced), and the scheduler side
must answer ``request_finished`` / ``has_cache_item``. So the region the NIXL
agent registers is a file on tmpfs that both processes map: the producer's
worker copies encoder outputs into it, the producer's scheduler publishes
their coordinates; the consumer's scheduler READs into its own region and the
consumer's worker copies out of it.

The allocator is pure bookkeeping (offsets only): first fit over the gaps
between live slots, evicting the oldest evictable slot until a request fits.
No torch and no NIXL here.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import mmap
import os
import re
import secrets
import struct
import time
from bisect import insort
from dataclasses import dataclass, field

from encoderpool_contracts import payload_bytes

logger = logging.getLogger("vllm.ext." + __name__)

ALIGN = 64
HEADER_BYTES = 256  # room reserved in front of each producer slot's payload
# How a slot header spells each dtype of contracts.DTYPE_BYTES (a binary format).
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
MAX_DIMS = 8
_REGION_NAME = re.compile(r"^encoderpool-rdma-(\d{1,10})-[0-9a-f]{8}$")


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---- slot header (producer regions) ----

# A slot's header is written by the producer's worker and read by its scheduler (both in
# the pod; consumers READ only the payload behind it). Its life: the step that queues a
# save marks the header STATE_WRITING with the slot's generation (``pack_writing``); the
# worker's writer thread copies the payload, hashes it and writes the READY header
# (``write_header``: the state last); a save dropped after its mark gets the mark cleared
# (``clear_if_writing``). The scheduler waits, boundedly, only while it reads its own
# generation's WRITING mark (``slot_state``); anything else that is not a READY header of
# that generation is an unwritten slot.
SLOT_MAGIC = b"EPRS"
SLOT_VERSION = 1
STATE_EMPTY, STATE_READY, STATE_WRITING = 0, 1, 2
# magic, version, state, generation, payload bytes, dtype code, ndim, shape[8], key, checksum
_SLOT = struct.Struct("<4sHHQQBB6x8Q32s32s")
assert _SLOT.size <= HEADER_BYTES
# The header's first fields alone (magic, version, state, generation): the mark.
_MARK = struct.Struct("<4sHHQ")
MARK_BYTES = _MARK.size
_STATE_AT = 6  # the state's offset in the header; of its two bytes only the first varies


def pack_writing(generation: int) -> bytes:
    """The mark a slot gets while the write of ``generation`` is queued or running."""
    return _MARK.pack(SLOT_MAGIC, SLOT_VERSION, STATE_WRITING, generation)


def slot_state(raw: bytes | memoryview) -> tuple[int, int] | None:
    """(state, generation) of a header's first ``MARK_BYTES``; None if they are no header
    of ours (never raises)."""
    if len(raw) < MARK_BYTES:
        return None
    magic, version, state, generation = _MARK.unpack_from(raw)
    if magic != SLOT_MAGIC or version != SLOT_VERSION:
        return None
    return int(state), int(generation)


def write_header(view: memoryview, offset: int, header: bytes) -> None:
    """Write a packed header over a slot's WRITING mark, its state byte last, so that a
    reader that finds STATE_READY and then reads the header finds it whole (a reader on a
    weakly ordered CPU that still saw a torn one fails the header's own checks or the
    consumer's checksum: a miss, never wrong bytes)."""
    view[offset + _STATE_AT + 2 : offset + len(header)] = header[_STATE_AT + 2 :]
    view[offset : offset + _STATE_AT] = header[:_STATE_AT]
    view[offset + _STATE_AT : offset + _STATE_AT + 2] = header[_STATE_AT : _STATE_AT + 2]


def clear_if_writing(view: memoryview, offset: int, generation: int) -> bool:
    """Clear the slot's mark if it is still the WRITING mark of ``generation`` (a save given
    up on); whether it was. Another generation's mark or header is left alone."""
    if slot_state(view[offset : offset + MARK_BYTES]) != (STATE_WRITING, generation):
        return False
    view[offset : offset + 8] = bytes(8)
    return True


def key_digest(mm_hash: str) -> bytes:
    """A fixed-size stand-in for an mm_hash (which a client uuid can make arbitrary)."""
    return hashlib.sha256(mm_hash.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class SlotHeader:
    """What the producer's worker writes in front of a payload once it is complete."""

    generation: int
    payload_bytes: int
    dtype: str
    shape: tuple[int, ...]
    key: bytes
    checksum: bytes  # raw BLAKE3 digest (32 bytes)

    def pack(self) -> bytes:
        shape = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        return _SLOT.pack(
            SLOT_MAGIC,
            SLOT_VERSION,
            STATE_READY,
            self.generation,
            self.payload_bytes,
            DTYPE_CODES[self.dtype],
            len(self.shape),
            *shape,
            self.key,
            self.checksum,
        )


def unpack_slot_header(raw: bytes | memoryview) -> SlotHeader | None:
    """The header if it is a complete, version-1, ready one; None otherwise (never raises)."""
    if len(raw) < _SLOT.size:
        return None
    fields = _SLOT.unpack_from(raw)
    magic, version, state, generation, nbytes, dcode, ndim = fields[:7]
    shape = tuple(int(x) for x in fields[7 : 7 + MAX_DIMS])
    key, digest = fields[7 + MAX_DIMS], fields[8 + MAX_DIMS]
    if magic != SLOT_MAGIC or version != SLOT_VERSION or state != STATE_READY:
        return None
    if dcode not in DTYPE_NAMES or not 1 <= ndim <= MAX_DIMS:
        return None
    dtype = DTYPE_NAMES[dcode]
    shape = shape[:ndim]
    if payload_bytes(dtype, shape) != nbytes:
        return None
    return SlotHeader(generation, nbytes, dtype, shape, key, digest)


# ---- the allocator ----


@dataclass
class Slot:
    """One live allocation. ``locked`` slots are never evicted (in flight, or being loaded)."""

    offset: int
    size: int
    key: str
    generation: int
    created: float
    locked: bool = False
    refs: int = 0  # producer: announced READs not yet confirmed
    requests: set[str] = field(default_factory=set)


class SlotAllocator:
    """First-fit allocation of aligned byte ranges in ``[0, capacity)``, oldest evicted first.

    Not thread-safe: each role uses it from the scheduler thread only.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < ALIGN:
            raise ValueError(f"capacity {capacity} is smaller than one {ALIGN}-byte block")
        self.capacity = capacity // ALIGN * ALIGN
        self._by_offset: list[int] = []  # sorted offsets of live slots
        self._slots: dict[int, Slot] = {}
        self._generation = 0
        self.evicted = 0
        self.evicted_bytes = 0

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def used(self) -> int:
        return sum(s.size for s in self._slots.values())

    def get(self, offset: int) -> Slot | None:
        return self._slots.get(offset)

    def slots(self) -> list[Slot]:
        return [self._slots[o] for o in self._by_offset]

    def allocate(
        self, key: str, nbytes: int, *, now: float | None = None, evict: bool = True
    ) -> tuple[Slot | None, list[Slot]]:
        """A new locked slot of at least ``nbytes`` (None if it cannot fit), and the slots
        evicted to make room (oldest unlocked first; the caller forgets them)."""
        size = align(max(nbytes, 1))
        now = time.monotonic() if now is None else now
        evicted: list[Slot] = []
        if size > self.capacity:
            return None, evicted
        while True:
            offset = self._first_fit(size)
            if offset is not None:
                self._generation += 1
                slot = Slot(offset, size, key, self._generation, now, locked=True)
                self._slots[offset] = slot
                insort(self._by_offset, offset)
                return slot, evicted
            if not evict:
                return None, evicted
            victim = self._oldest_unlocked()
            if victim is None:
                return None, evicted
            self.free(victim.offset)
            self.evicted += 1
            self.evicted_bytes += victim.size
            evicted.append(victim)

    def free(self, offset: int) -> Slot | None:
        slot = self._slots.pop(offset, None)
        if slot is not None:
            self._by_offset.remove(offset)
        return slot

    def expire(self, older_than: float) -> list[Slot]:
        """Free every slot created before ``older_than`` (locked ones too: a backstop)."""
        old = [s for s in self._slots.values() if s.created < older_than]
        for s in old:
            self.free(s.offset)
        return old

    def _first_fit(self, size: int) -> int | None:
        cursor = 0
        for off in self._by_offset:
            if off - cursor >= size:
                return cursor
            cursor = off + self._slots[off].size
        return cursor if self.capacity - cursor >= size else None

    def _oldest_unlocked(self) -> Slot | None:
        candidates = [s for s in self._slots.values() if not s.locked]
        if not candidates:
            return None
        # Unconfirmed producer slots (refs > 0) go after confirmed ones of any age.
        return min(candidates, key=lambda s: (s.refs > 0, s.created, s.offset))


# ---- the shared region ----


class SharedRegion:
    """A tmpfs file mapped shared; the creator unlinks it on ``close``."""

    def __init__(self, path: str, size: int, *, create: bool, writable: bool = True) -> None:
        self.path = path
        self.size = size
        self.owner = create
        flags = os.O_RDWR if writable else os.O_RDONLY
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            if create:
                # Allocate every page now: a tmpfs too small for the buffer fails here with a
                # clear message instead of a SIGBUS on some later write, and first-touch page
                # allocation stays off the encoder step.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    raise OSError(
                        e.errno,
                        f"rdma.buffer_bytes: cannot allocate {size} bytes in {path} "
                        f"({e.strerror}); make rdma.shm_dir larger (in pods: a memory emptyDir "
                        "at /dev/shm with a sizeLimit above buffer_bytes) or lower buffer_bytes",
                    ) from None
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {size}")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self.map = mmap.mmap(fd, size, access=access)
        except BaseException:
            os.close(fd)
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        os.close(fd)
        self.view = memoryview(self.map)
        # The ctypes view is dropped at once, so it does not pin the map; the address stays
        # valid until close().
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self.map)) if writable else 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @classmethod
    def create(cls, directory: str, size: int) -> SharedRegion:
        """A new region in ``directory``, after sweeping regions of processes that died."""
        sweep_dead_regions(directory)
        name = f"encoderpool-rdma-{os.getpid()}-{secrets.token_hex(4)}"
        return cls(os.path.join(directory, name), size, create=True)

    @property
    def address(self) -> int:
        """Virtual address of byte 0 in this process (what NIXL registers)."""
        assert not self._closed
        assert self._address, "only writable maps are registered with NIXL"
        return self._address

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.view.release()
        with contextlib.suppress(BufferError):
            self.map.close()
        if self.owner:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def is_region_path(path: str, directory: str) -> bool:
    """Whether ``path`` names a region in ``directory`` (metadata paths are checked with it)."""
    return os.path.dirname(path) == directory.rstrip("/") and bool(
        _REGION_NAME.match(os.path.basename(path))
    )


def sweep_dead_regions(directory: str) -> int:
    """Unlink regions whose creating process no longer exists; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _REGION_NAME.match(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue
        except ProcessLookupError:
            pass
        except OSError:
            continue  # exists, but not ours to signal
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed += 1
    return removed

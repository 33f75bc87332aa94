"""The shared directory: layout, atomic publish, capacity-bounded eviction, pins.

Layout under the configured root (created by producers only; lookups create nothing)::

    entries/<digest>.epc   published entries, immutable once renamed into place
    tmp/                   entries being written (same filesystem, so rename is atomic)
    pins/<instance>/       hard links a consumer holds between verifying and loading
    lock                   flock'd while evicting and publishing, so concurrent
                           producers cannot push the total over the capacity

Entry mtime orders eviction: it is the publish time, and under ``lru`` a
consumer hit moves it to now. Pins are extra links to the same inode, so an
entry evicted while pinned stays readable until its pin is dropped.

No torch here: bytes in, bytes out (the writer thread and the benchmark share it).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from encoderpool_connector.shared_volume.entry import (
    EntryError,
    Expect,
    Header,
    check_header,
    encode_prefix,
    is_entry_name,
    read_prefix,
    write_file,
)

logger = logging.getLogger("vllm.ext." + __name__)

# A pin older than this belongs to a consumer that died; safe to remove.
STALE_PIN_SECONDS = 600.0
STALE_TMP_SECONDS = 600.0


@dataclass
class PublishResult:
    published: bool
    reason: str
    evicted: int = 0
    evicted_bytes: int = 0


class SharedStore:
    """One pool's cache directory, as seen by one process."""

    def __init__(self, root: str, capacity_bytes: int, eviction: str) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.eviction = eviction
        self.entries = os.path.join(root, "entries")
        self.tmp = os.path.join(root, "tmp")
        self.pins_root = os.path.join(root, "pins")
        self.lock_path = os.path.join(root, "lock")

    # ---- paths: every name below is produced here, never taken from input ----

    def entry_path(self, name: str) -> str:
        assert is_entry_name(name), name  # names come from entry_name(), never from input
        return os.path.join(self.entries, name)

    def prepare_producer(self) -> None:
        """Create the layout (producers only) and sweep temp files left by dead writers."""
        for d in (self.entries, self.tmp, self.pins_root):
            os.makedirs(d, exist_ok=True)
        with open(self.lock_path, "a"):
            pass
        self._sweep(self.tmp, STALE_TMP_SECONDS, "temp file")

    def exists(self, name: str) -> bool:
        return os.path.exists(self.entry_path(name))

    # ---- publish (producer) ----

    def publish(self, name: str, header: Header, payload: memoryview) -> PublishResult:
        """Write to a temp file, make room under the lock, rename into place.

        Concurrent producers publishing the same name each rename a complete
        file; the last one wins and readers see one or the other, never a mix.
        """
        prefix = encode_prefix(header)
        size = len(prefix) + header.payload_bytes
        if size > self.capacity_bytes:
            return PublishResult(False, f"entry of {size} bytes exceeds the capacity")
        final = self.entry_path(name)
        if self._valid_copy_exists(final, header):
            if self.eviction == "lru":
                with contextlib.suppress(OSError):
                    os.utime(final)
            return PublishResult(False, "already published")
        tmp = os.path.join(self.tmp, f"{name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                write_file(fd, prefix, payload)
            finally:
                os.close(fd)
            with self._locked():
                evicted, freed = self._make_room(size, keep=name)
                os.rename(tmp, final)
            return PublishResult(True, "published", evicted, freed)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _valid_copy_exists(self, final: str, header: Header) -> bool:
        """Skip rewriting an entry another producer already published intact (same header)."""
        try:
            fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            have, offset = read_prefix(fd)
            check_header(
                have,
                Expect(header.mm_hash, header.fingerprint, header.dtype, header.shape[0]),
                os.fstat(fd).st_size,
                offset,
            )
            return have.checksum == header.checksum
        except (EntryError, OSError):
            return False
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def scan(self) -> list[tuple[float, int, str]]:
        """(mtime, size, name) of every entry; entries vanishing mid-scan are skipped."""
        out = []
        with os.scandir(self.entries) as it:
            for e in it:
                if not is_entry_name(e.name):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, st.st_size, e.name))
        return out

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.scan())

    def _make_room(self, incoming: int, keep: str) -> tuple[int, int]:
        """Evict the oldest (by mtime) entries until ``incoming`` more bytes fit."""
        listing = sorted(self.scan())
        total = sum(size for _, size, name in listing if name != keep)
        evicted = freed = 0
        for _, size, name in listing:
            if total + incoming <= self.capacity_bytes:
                break
            if name == keep:
                continue  # replaced by the rename, not counted twice
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.entries, name))
                evicted += 1
                freed += size
            total -= size
        return evicted, freed

    # ---- consumer side ----

    def touch(self, name: str) -> None:
        """Mark a hit as recent (lru only); a lost race with eviction is harmless."""
        if self.eviction == "lru":
            with contextlib.suppress(OSError):
                os.utime(self.entry_path(name))

    def _sweep(self, directory: str, older_than: float, what: str) -> None:
        now = time.time()
        with contextlib.suppress(FileNotFoundError), os.scandir(directory) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    if e.is_file(follow_symlinks=False) and now - e.stat().st_mtime > older_than:
                        os.unlink(e.path)
                        logger.info("encoderpool: removed stale %s %s", what, e.path)


class Pins:
    """Hard links that keep a verified entry readable until the worker has loaded it.

    Verification happens on the pin, not on the entry name, so what the worker
    reads is exactly the inode that was checked, whatever producers and
    eviction do to the name meanwhile.
    """

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        instance = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.dir = os.path.join(store.pins_root, instance)
        self._made = False
        self._seq = 0

    def pin(self, name: str) -> str | None:
        """Link the entry under a fresh pin name; None if it is gone (a miss)."""
        if not self._made:
            if not os.path.isdir(self.store.pins_root):
                return None  # no producer has prepared this root: nothing to pin
            os.makedirs(self.dir, exist_ok=True)
            self._made = True
            self._sweep_stale()
        self._seq += 1
        pin = os.path.join(self.dir, f"{name}.{self._seq}")
        for _ in range(2):
            try:
                os.link(self.store.entry_path(name), pin)
                return pin
            except FileNotFoundError:
                if os.path.isdir(self.dir):
                    return None  # the entry is gone: a miss
                os.makedirs(self.dir, exist_ok=True)  # our directory was swept; once more
        return None

    def _sweep_stale(self) -> None:
        now = time.time()
        with contextlib.suppress(FileNotFoundError), os.scandir(self.store.pins_root) as it:
            for d in it:
                if d.path == self.dir or not d.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError), os.scandir(d.path) as files:
                    for f in files:
                        # ctime, not mtime: a pin shares the entry's inode (and
                        # its publish mtime); linking it updates the ctime.
                        if now - f.stat(follow_symlinks=False).st_ctime > STALE_PIN_SECONDS:
                            os.unlink(f.path)
                with contextlib.suppress(OSError):
                    if now - d.stat(follow_symlinks=False).st_mtime > STALE_PIN_SECONDS:
                        os.rmdir(d.path)  # an idle instance's directory; fails unless empty

    @staticmethod
    def drop(pin: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pin)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError, OSError), os.scandir(self.dir) as it:
            for f in it:
                with contextlib.suppress(OSError):
                    os.unlink(f.path)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)

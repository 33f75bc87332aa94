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

Anyone who mounts the volume can replace ``entries``, ``tmp`` or ``pins`` (or a pin
directory) with a link to elsewhere, or with another directory. So each process
resolves them once, with ``O_DIRECTORY | O_NOFOLLOW`` from the root it was configured
with, keeps the directory fds, and does every open, link, rename, unlink and stat
relative to them: a swap afterwards redirects nothing, and a link found at the start is
refused (every lookup a miss, every save dropped, with a warning) instead of followed.
The configured root itself is trusted (the operator's root is the volume's mount
point, which no pod can replace).

No torch here: bytes in, bytes out (the writer thread and the benchmark share it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from encoderpool_connector.shared_volume.entry import (
    EntryError,
    Expect,
    Header,
    check_header,
    encode_prefix,
    is_entry_name,
    open_entry,
    open_entry_stat,
    read_prefix,
    verify_fd_at,
    write_file,
)
from encoderpool_contracts.integrity import ChannelKey

logger = logging.getLogger("vllm.ext." + __name__)

# A pin older than this belongs to a consumer that died; safe to remove.
STALE_PIN_SECONDS = 600.0
STALE_TMP_SECONDS = 600.0
# A producer waits at most this long for the publish lock (anyone who mounts the volume
# can hold it forever); then the save is dropped.
LOCK_TIMEOUT_S = 10.0
# "The layout is unsafe" is said at most this often per process.
WARN_EVERY_S = 60.0

SUBDIRS = ("entries", "tmp", "pins")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
Inode = tuple[int, int]


class Verified(NamedTuple):
    """What verifying an entry established: everything a load of it needs."""

    header: Header
    inode: Inode
    """(st_dev, st_ino): a load reads this file and no other."""
    offset: int
    """Where the payload starts: a load reads from here without parsing the header again."""


class UnsafeLayout(OSError):
    """A directory of the layout is a link or not a directory: someone replaced it."""


@dataclass
class PublishResult:
    published: bool
    reason: str
    evicted: int = 0
    evicted_bytes: int = 0
    warned: bool = False  # the store has said why (at most once a minute): no warning per save


@dataclass(frozen=True)
class _Layout:
    """Directory fds, resolved once per process and kept for its life."""

    root: int
    entries: int
    tmp: int
    pins: int


def open_subdir(parent: int, name: str, *, create: bool = False) -> int:
    """An fd of directory ``name`` in ``parent``, never through a link.

    FileNotFoundError when it is missing (and not ``create``); UnsafeLayout when a link,
    a file or anything else but a directory is there.
    """
    assert "/" not in name, name
    assert name not in ("", ".", ".."), name
    for _ in range(2):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=parent)  # the umask applies, as with makedirs
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeLayout(
                    e.errno, f"{name} is a symbolic link or not a directory"
                ) from None
            raise
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


@contextlib.contextmanager
def listing(dir_fd: int) -> Iterator[Iterator[os.DirEntry[str]]]:
    """scandir over a fresh fd of the same directory (threads never share an offset)."""
    fd = os.open(".", _DIR_FLAGS, dir_fd=dir_fd)
    try:
        with os.scandir(fd) as it:
            yield it
    finally:
        os.close(fd)


class SharedStore:
    """One pool's cache directory, as seen by one process."""

    def __init__(
        self, root: str, capacity_bytes: int, eviction: str, key: ChannelKey | None = None
    ) -> None:
        self.root = root
        self.key = key  # the pool's key: signs what this process publishes
        self.capacity_bytes = capacity_bytes
        self.eviction = eviction
        self.entries = os.path.join(root, "entries")
        self.tmp = os.path.join(root, "tmp")
        self.pins_root = os.path.join(root, "pins")
        self._layout: _Layout | None = None
        self._opening = threading.Lock()
        self._warned = -WARN_EVERY_S
        self.unsafe = ""  # why the layout was last refused ("" = never)

    # ---- the layout: resolved once, then only fds ----

    def layout(self, *, create: bool = False) -> _Layout | None:
        """The directory fds; None while the layout is missing (a consumer before any
        producer) or unsafe (a link or a file where a directory belongs: warned)."""
        if self._layout is not None:
            return self._layout
        with self._opening:
            if self._layout is None:
                try:
                    self._layout = self._open(create)
                except FileNotFoundError:
                    return None
                except UnsafeLayout as e:
                    self._refuse(str(e.strerror))
                    return None
                except OSError as e:
                    self._refuse(f"cannot open it: {e}")
                    return None
            return self._layout

    def _open(self, create: bool) -> _Layout:
        if create:
            os.makedirs(self.root, exist_ok=True)
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        opened = [root]
        try:
            for name in SUBDIRS:
                opened.append(open_subdir(root, name, create=create))
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        return _Layout(*opened)

    def _refuse(self, why: str) -> None:
        self.unsafe = why
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            logger.warning(
                "encoderpool: the cache layout under %s is not usable (%s): every lookup is "
                "a miss and every save is dropped until it is (someone who mounts the "
                "volume replaced a directory?); nothing outside it is followed",
                self.root,
                why,
            )

    # ---- paths: every name below is produced here, never taken from input ----

    def entry_path(self, name: str) -> str:
        """For messages and tests only: every operation goes through the directory fds."""
        assert is_entry_name(name), name  # names come from entry_name(), never from input
        return os.path.join(self.entries, name)

    def prepare_producer(self) -> None:
        """Create the layout (producers only) and sweep temp files left by dead writers.

        An unsafe layout is warned about, never raised: the producer serves on and drops
        its saves until the layout is usable."""
        layout = self.layout(create=True)
        if layout is None:
            return
        fd = self._open_lock(layout)
        os.close(fd)
        self._sweep(layout.tmp, STALE_TMP_SECONDS, "temp file")

    def exists(self, name: str) -> bool:
        """Whether anything (a file, or whatever a hostile writer put) has this name."""
        assert is_entry_name(name), name
        layout = self.layout()
        if layout is None:
            return False
        try:
            os.stat(name, dir_fd=layout.entries, follow_symlinks=False)
        except OSError:
            return False
        return True

    @contextlib.contextmanager
    def directory(self, subdir: str) -> Iterator[int]:
        """An fd of ``entries`` or ``pins/<instance>``, every step without following a link."""
        fd, owned = self._directory(subdir)
        try:
            yield fd
        finally:
            if owned:
                os.close(fd)

    def _directory(self, subdir: str) -> tuple[int, bool]:
        """``directory`` without the context manager (the load path's fewer steps): the fd,
        and whether the caller must close it (a pin directory, opened now) or not (a
        layout fd, kept for the process's life)."""
        layout = self.layout()
        if layout is None:
            raise EntryError(f"the cache under {self.root} is missing or unsafe")
        top, _, rest = subdir.partition("/")
        if top == "pins":
            base = layout.pins
        elif top == "entries":
            base = layout.entries
        elif top == "tmp":
            base = layout.tmp
        else:
            raise EntryError(f"{subdir}: not a directory of the cache layout")
        if not rest:
            return base, False
        try:
            return open_subdir(base, rest), True
        except OSError as e:
            raise EntryError(f"{subdir}: {e.strerror or e}") from None

    def verify(self, subdir: str, name: str, expect: Expect) -> Verified:
        """Header, inode and payload offset of the entry (or pin) ``subdir/name``,
        verified in full."""
        with self.directory(subdir) as d:
            fd = open_entry(name, dir_fd=d)
        try:
            st = os.fstat(fd)
            header, offset = verify_fd_at(fd, expect)
            return Verified(header, (st.st_dev, st.st_ino), offset)
        finally:
            os.close(fd)

    def open_verified(self, subdir: str, name: str, inode: Inode, size: int) -> int:
        """An fd of ``subdir/name`` if it is still the inode that was verified, ``size``
        bytes long (payload offset plus payload bytes, as verified). One ``fstat``."""
        d, owned = self._directory(subdir)
        try:
            fd, st = open_entry_stat(name, dir_fd=d)
        finally:
            if owned:
                os.close(d)
        if st.st_ino != inode[1] or st.st_dev != inode[0]:
            os.close(fd)
            raise EntryError(f"{subdir}/{name} is not the file that was verified")
        if st.st_size != size:
            os.close(fd)
            raise EntryError(f"{subdir}/{name} has {st.st_size} bytes, {size} when it was verified")
        return fd

    def unlink(self, subdir: str, name: str) -> None:
        """Remove ``subdir/name`` inside the cache; gone already (or unsafe) is fine."""
        with contextlib.suppress(OSError, EntryError), self.directory(subdir) as d:
            os.unlink(name, dir_fd=d)

    # ---- publish (producer) ----

    def publish(self, name: str, header: Header, payload: memoryview) -> PublishResult:
        """Write to a temp file, make room under the lock, rename into place.

        Concurrent producers publishing the same name each rename a complete
        file; the last one wins and readers see one or the other, never a mix.
        """
        assert is_entry_name(name), name
        header = header.signed(self.key)
        prefix = encode_prefix(header)
        size = len(prefix) + header.payload_bytes
        if size > self.capacity_bytes:
            return PublishResult(False, f"entry of {size} bytes exceeds the capacity")
        layout = self.layout(create=True)
        if layout is None:
            return PublishResult(False, f"the cache layout is unsafe ({self.unsafe})", warned=True)
        if self._valid_copy_exists(layout, name, header):
            if self.eviction == "lru":
                with contextlib.suppress(OSError):
                    os.utime(name, dir_fd=layout.entries, follow_symlinks=False)
            return PublishResult(False, "already published")
        tmp = f"{name}.{os.getpid()}.{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=layout.tmp)
        try:
            try:
                write_file(fd, prefix, payload)
            finally:
                os.close(fd)
            with self._locked(layout):
                evicted, freed = self._make_room(layout, size, keep=name)
                os.rename(tmp, name, src_dir_fd=layout.tmp, dst_dir_fd=layout.entries)
            return PublishResult(True, "published", evicted, freed)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=layout.tmp)
            raise

    def _valid_copy_exists(self, layout: _Layout, name: str, header: Header) -> bool:
        """Skip rewriting an entry another producer already published intact (same header)."""
        try:
            fd = open_entry(name, dir_fd=layout.entries)
        except EntryError:
            return False
        try:
            have, offset = read_prefix(fd)
            check_header(
                have,
                Expect(header.mm_hash, header.fingerprint, header.dtype, header.shape[0]),
                os.fstat(fd).st_size,
                offset,
            )
            return have.checksum == header.checksum and have.mac == header.mac
        except (EntryError, OSError):
            return False
        finally:
            os.close(fd)

    @staticmethod
    def _open_lock(layout: _Layout) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open("lock", flags, 0o644, dir_fd=layout.root)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeLayout(errno.EINVAL, "the lock is not a regular file")
        return fd

    @contextlib.contextmanager
    def _locked(self, layout: _Layout) -> Iterator[None]:
        fd = self._open_lock(layout)
        try:
            deadline = time.monotonic() + LOCK_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"the publish lock was held for over {LOCK_TIMEOUT_S:.0f} s"
                        ) from None
                    time.sleep(0.005)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def scan(self) -> list[tuple[float, int, str]]:
        """(mtime, size, name) of every entry; entries vanishing mid-scan are skipped."""
        layout = self.layout()
        return [] if layout is None else self._scan(layout)

    @staticmethod
    def _scan(layout: _Layout) -> list[tuple[float, int, str]]:
        out = []
        with listing(layout.entries) as it:
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

    def _make_room(self, layout: _Layout, incoming: int, keep: str) -> tuple[int, int]:
        """Evict the oldest (by mtime) entries until ``incoming`` more bytes fit."""
        listing_ = sorted(self._scan(layout))
        total = sum(size for _, size, name in listing_ if name != keep)
        evicted = freed = 0
        for _, size, name in listing_:
            if total + incoming <= self.capacity_bytes:
                break
            if name == keep:
                continue  # replaced by the rename, not counted twice
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=layout.entries)  # a link is removed, never followed
                evicted += 1
                freed += size
            total -= size
        return evicted, freed

    # ---- consumer side ----

    def touch(self, name: str) -> None:
        """Mark a hit as recent (lru only); a lost race with eviction is harmless."""
        layout = self.layout()
        if self.eviction == "lru" and layout is not None:
            with contextlib.suppress(OSError):
                os.utime(name, dir_fd=layout.entries, follow_symlinks=False)

    @staticmethod
    def _sweep(dir_fd: int, older_than: float, what: str) -> None:
        now = time.time()
        with contextlib.suppress(OSError), listing(dir_fd) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than:
                        os.unlink(e.name, dir_fd=dir_fd)
                        logger.info("encoderpool: removed stale %s %s", what, e.name)


class Pins:
    """Hard links that keep a verified entry readable until the worker has loaded it.

    Verification happens on the pin, not on the entry name, so what the worker
    reads is exactly the inode that was checked (the worker compares the inode),
    whatever producers, eviction or anyone on the volume do to names meanwhile.
    """

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self.instance = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.subdir = f"pins/{self.instance}"
        self.dir = os.path.join(store.pins_root, self.instance)  # for messages and tests
        self._fd: int | None = None
        self._made = False
        self._seq = 0
        # Verify threads pin concurrently: one fd, reopened under the lock, never closed
        # while another thread links through it.
        self._lock = threading.Lock()

    def pin(self, name: str) -> str | None:
        """Link the entry under a fresh pin name (returned, relative to ``subdir``); None
        if it is gone or the layout is missing or unsafe (a miss)."""
        assert is_entry_name(name), name
        with self._lock:
            return self._pin(name)

    def _pin(self, name: str) -> str | None:
        layout = self.store.layout()
        if layout is None:
            return None  # no producer has prepared this root (or it is unsafe): a miss
        fd = self._dir_fd(layout)
        if fd is None:
            return None
        self._seq += 1
        pin = f"{name}.{self._seq}"
        try:
            # follow_symlinks=False: a link planted as an entry is pinned as a link
            # (and refused by the O_NOFOLLOW open), never as the file it points to.
            os.link(name, pin, src_dir_fd=layout.entries, dst_dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # the entry is gone: a miss
        return pin

    def _dir_fd(self, layout: _Layout) -> int | None:
        """Our pin directory, made again when it was swept, moved or replaced: the worker
        finds pins by name under ``pins``, so the fd must be what that name is now."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                now = os.stat(self.instance, dir_fd=layout.pins, follow_symlinks=False)
                held = os.fstat(self._fd)
                if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                    return self._fd
            os.close(self._fd)
            self._fd = None
        first = not self._made
        try:
            self._fd = open_subdir(layout.pins, self.instance, create=True)
        except UnsafeLayout as e:
            self.store._refuse(f"pins/{self.instance}: {e.strerror}")
            return None
        self._made = True
        if first:
            self._sweep_stale(layout)
        return self._fd

    def _sweep_stale(self, layout: _Layout) -> None:
        now = time.time()
        with contextlib.suppress(OSError), listing(layout.pins) as it:
            for d in it:
                if d.name == self.instance or not d.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(OSError):
                    fd = open_subdir(layout.pins, d.name)  # swapped for a link: refused
                    try:
                        with listing(fd) as files:
                            for f in files:
                                # ctime, not mtime: a pin shares the entry's inode (and
                                # its publish mtime); linking it updates the ctime.
                                if now - f.stat(follow_symlinks=False).st_ctime > STALE_PIN_SECONDS:
                                    os.unlink(f.name, dir_fd=fd)
                    finally:
                        os.close(fd)
                with contextlib.suppress(OSError):
                    if now - d.stat(follow_symlinks=False).st_mtime > STALE_PIN_SECONDS:
                        os.rmdir(d.name, dir_fd=layout.pins)  # fails unless empty

    def drop(self, pin: str) -> None:
        with self._lock, contextlib.suppress(OSError):
            if self._fd is not None:
                os.unlink(pin, dir_fd=self._fd)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError), listing(fd) as it:
            for f in it:
                with contextlib.suppress(OSError):
                    os.unlink(f.name, dir_fd=fd)
        os.close(fd)
        layout = self.store.layout()
        if layout is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self.instance, dir_fd=layout.pins)

"""The on-disk format of one cache entry, and the mapping from an ``mm_hash`` to its file name.

An entry is one file::

    b"EPEC" | u32 little-endian header length | header (JSON, UTF-8) | zero padding to 64 | payload

The header says what the payload is (dtype, shape, width), whose it is (model
fingerprint, the original ``mm_hash``) and carries a BLAKE3 digest of the
payload, so a reader can reject a truncated, corrupt or foreign entry before
the engine trusts it. The payload is the raw tensor bytes, 64-byte aligned so
it can be read straight into a tensor.

With the pool's key (env ``ENCODERPOOL_CHANNEL_KEY``, the rdma transport's channel key)
the header also carries ``mac``: HMAC-SHA256 over the other header fields, checksum
included, so a reader with the key refuses an entry written by anyone without it (any
other pod that mounts the volume). Without a key, entries are unsigned and a reader
checks no mac.

File names never contain the ``mm_hash``: a client can set an item's ``uuid``,
which replaces the hash, so any string may arrive. Names are a digest of
(fingerprint, mm_hash) and cannot name anything outside the entries directory.

This module imports neither torch nor vLLM (the benchmark and the unit tests
use it directly); tensors enter and leave as bytes plus dtype and shape.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import stat
import struct
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from typing_extensions import Buffer

from encoderpool_contracts import DTYPE_BYTES, payload_bytes
from encoderpool_contracts.integrity import ChannelKey, checksum

if TYPE_CHECKING:
    import numpy as np

# 2: the optional ``mac``. A version-1 entry (an older producer) is a miss.
FORMAT_VERSION = 2
MAC_LABEL = "encoderpool/shared-volume/entry/v2"
MAGIC = b"EPEC"
SUFFIX = ".epc"
ALIGN = 64
MAX_HEADER = 64 * 1024
# The largest payload a reader will allocate for: anyone who mounts the volume can
# write an entry whose header claims any shape (a sparse file makes the size match).
MAX_PAYLOAD = 1 << 30
# Never follow a link, never wait on a FIFO or device: whoever mounts the volume
# may have put one where an entry is expected.
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_PREFIX = struct.Struct("<4sI")
# How many bytes the first read takes: the whole header of any sane entry.
FIRST_READ = 4096


class EntryError(Exception):
    """The entry is missing, unreadable, malformed or not ours: a cache miss, never a crash."""


class EntryMissing(EntryError):
    """The entry is not there (never written, or evicted meanwhile): a plain miss."""


class EntryUnauthenticated(EntryError):
    """The reader holds the pool's key and the entry's mac is missing or wrong."""


def entry_name(fingerprint: str, mm_hash: str) -> str:
    """The file name of ``mm_hash``'s entry: a fixed-size hex digest plus suffix.

    Including the fingerprint keeps two models that share a directory apart.
    ``surrogatepass`` so that no string, however odd, raises here.
    """
    digest = hashlib.sha256()
    digest.update(fingerprint.encode())
    digest.update(b"\0")
    digest.update(mm_hash.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:40] + SUFFIX


def is_entry_name(name: str) -> bool:
    stem, dot, ext = name.partition(".")
    return dot == "." and "." + ext == SUFFIX and len(stem) == 40 and _is_hex(stem)


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


@dataclass(frozen=True)
class Header:
    """What an entry says about itself; verified against what the reader expects."""

    mm_hash: str
    fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    checksum: str
    version: int = FORMAT_VERSION
    mac: str = ""

    @property
    def width(self) -> int:
        return self.shape[-1] if self.shape else 0

    @property
    def payload_bytes(self) -> int:
        return payload_bytes(self.dtype, self.shape)

    def fields(self) -> dict[str, Any]:
        """Everything but the mac: what the mac covers."""
        return {
            "version": self.version,
            "mm_hash": self.mm_hash,
            "fingerprint": self.fingerprint,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "width": self.width,
            "payload_bytes": self.payload_bytes,
            "checksum": self.checksum,
        }

    def signed(self, key: ChannelKey | None) -> Header:
        """This header with its mac under ``key`` (unchanged without a key)."""
        if key is None:
            return self
        return replace(self, mac=key.mac(MAC_LABEL, self.fields()))

    def to_json(self) -> bytes:
        d = self.fields()
        if self.mac:
            d["mac"] = self.mac
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Header:
        try:
            d: Any = json.loads(raw)
            if not isinstance(d, dict):
                raise EntryError("header is not a JSON object")
            if d.get("version") != FORMAT_VERSION:
                raise EntryError(f"format version {d.get('version')!r}, expected {FORMAT_VERSION}")
            dtype = d["dtype"]
            if dtype not in DTYPE_BYTES:
                raise EntryError(f"unsupported dtype {dtype!r}")
            shape = tuple(int(x) for x in d["shape"])
            if not shape or any(x < 0 for x in shape):
                raise EntryError(f"bad shape {shape}")
            mac = d.get("mac", "")
            if not isinstance(mac, str) or len(mac) > 128:
                raise EntryError("malformed mac")
            header = cls(
                mm_hash=str(d["mm_hash"]),
                fingerprint=str(d["fingerprint"]),
                dtype=dtype,
                shape=shape,
                checksum=str(d["checksum"]),
                mac=mac,
            )
            if d.get("width") != header.width or d.get("payload_bytes") != header.payload_bytes:
                raise EntryError("header width/payload_bytes disagree with its shape")
            return header
        except (KeyError, TypeError, ValueError) as e:
            raise EntryError(f"malformed header: {e}") from None


def payload_offset(header_len: int) -> int:
    return -(-(_PREFIX.size + header_len) // ALIGN) * ALIGN


def encode_prefix(header: Header) -> bytes:
    """Magic, header length, header and padding: everything before the payload."""
    raw = header.to_json()
    if len(raw) > MAX_HEADER:
        raise EntryError(f"header of {len(raw)} bytes exceeds {MAX_HEADER}")
    head = _PREFIX.pack(MAGIC, len(raw)) + raw
    return head + b"\0" * (payload_offset(len(raw)) - len(head))


def parse_prefix(first: bytes) -> tuple[Header, int]:
    """Header and payload offset from the file's first bytes (at least the whole header)."""
    if len(first) < _PREFIX.size:
        raise EntryError(f"file too short ({len(first)} bytes) for an entry")
    magic, n = _PREFIX.unpack_from(first)
    if magic != MAGIC:
        raise EntryError("not an encoderpool entry (bad magic)")
    if n > MAX_HEADER:
        raise EntryError(f"header length {n} exceeds {MAX_HEADER}")
    if len(first) < _PREFIX.size + n:
        raise EntryError("file ends inside the header")
    return Header.from_json(first[_PREFIX.size : _PREFIX.size + n]), payload_offset(n)


def read_prefix(fd: int) -> tuple[Header, int]:
    """Read and parse the header of an open entry file."""
    first = os.pread(fd, FIRST_READ, 0)
    if len(first) >= _PREFIX.size:
        _, n = _PREFIX.unpack_from(first)
        if _PREFIX.size + n > len(first) and n <= MAX_HEADER:
            first = os.pread(fd, _PREFIX.size + n, 0)
    return parse_prefix(first)


@dataclass(frozen=True)
class Expect:
    """What the reader requires of an entry; ``None`` fields are not checked."""

    mm_hash: str
    fingerprint: str
    dtype: str | None = None
    num_tokens: int | None = None
    width: int | None = None
    key: ChannelKey | None = None
    """The pool's key: the entry's mac must verify under it. None: no mac is checked."""


def check_header(header: Header, expect: Expect, file_size: int, offset: int) -> None:
    """Everything checkable without reading the payload; raises EntryError naming the problem.

    The mac first: nothing else an unauthenticated header says is worth a look."""
    if expect.key is not None:
        if not header.mac:
            raise EntryUnauthenticated("unsigned entry (no mac) and this pool has a key")
        want = expect.key.mac(MAC_LABEL, header.fields())
        if not hmac.compare_digest(header.mac.encode(), want.encode()):
            raise EntryUnauthenticated("bad mac (written without this pool's key, or changed)")
    if header.fingerprint != expect.fingerprint:
        raise EntryError(
            f"written for model fingerprint {header.fingerprint!r}, "
            f"this pool serves {expect.fingerprint!r}"
        )
    if header.mm_hash != expect.mm_hash:
        raise EntryError("entry belongs to another item (mm_hash differs)")
    if expect.dtype is not None and header.dtype != expect.dtype:
        raise EntryError(f"dtype {header.dtype}, expected {expect.dtype}")
    if expect.width is not None and header.width != expect.width:
        raise EntryError(f"width {header.width}, expected {expect.width}")
    if expect.num_tokens is not None and header.shape[0] != expect.num_tokens:
        raise EntryError(f"{header.shape[0]} tokens, expected {expect.num_tokens}")
    if header.payload_bytes > MAX_PAYLOAD:
        raise EntryError(f"payload of {header.payload_bytes} bytes exceeds {MAX_PAYLOAD}")
    if file_size != offset + header.payload_bytes:
        raise EntryError(
            f"file has {file_size} bytes, header promises {offset + header.payload_bytes} "
            "(truncated or padded)"
        )


def open_entry(path: str, dir_fd: int | None = None) -> int:
    """An fd of the regular file at ``path`` (relative to ``dir_fd`` if given); EntryMissing,
    or EntryError for a link, a directory, a FIFO, a device or a socket (opened without
    blocking, never followed)."""
    return open_entry_stat(path, dir_fd)[0]


def open_entry_stat(path: str, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """``open_entry``, plus the file's stat (one ``fstat`` serves every later check)."""
    try:
        fd = os.open(path, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise EntryMissing("no such entry") from None
    except OSError as e:
        what = "a symbolic link" if e.errno == errno.ELOOP else f"not readable ({e.strerror})"
        raise EntryError(f"entry is {what}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise EntryError("entry is not a regular file")
    return fd, st


def verify_file(path: str, expect: Expect) -> Header:
    """Check header and payload checksum of the entry at ``path``; EntryError if anything is off."""
    fd = open_entry(path)
    try:
        return verify_fd_at(fd, expect)[0]
    finally:
        os.close(fd)


def verify_fd_at(fd: int, expect: Expect) -> tuple[Header, int]:
    """Check header (mac first) and payload checksum of an open entry; EntryError if off.
    Returns the header and the payload's offset in the file: what a later load reads
    from, so that it never parses the header again."""
    try:
        header, offset = read_prefix(fd)
        check_header(header, expect, os.fstat(fd).st_size, offset)
        payload = bytearray(header.payload_bytes)
        if _preadinto(fd, memoryview(payload), offset) != len(payload):
            raise EntryError("file ended early")
        if checksum(payload) != header.checksum:
            raise EntryError("payload checksum mismatch (corrupt entry)")
        return header, offset
    except OSError as e:
        raise EntryError(f"read failed: {e.strerror}") from None


def read_payload(fd: int, out: Buffer | np.ndarray, offset: int, nbytes: int) -> None:
    """Read the ``nbytes`` of payload of a verified, open entry from ``offset`` into ``out``
    (a writable, contiguous buffer of exactly that size: a numpy array, a bytearray).

    No header parse, no checksum: the caller opened the verified inode (pinned files are
    never written again) and checked its size, and takes dtype, shape and ``offset`` from
    the verification. One ``preadv`` on the hot path; more only after a short read.
    """
    buffers: list[Any] = [out]  # numpy's stubs declare no buffer protocol before 3.12
    done = os.preadv(fd, buffers, offset)
    if done == nbytes:
        return
    view = memoryview(cast(Buffer, out)).cast("B")
    if len(view) != nbytes:
        raise EntryError(f"buffer of {len(view)} bytes for a payload of {nbytes}")
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EntryError(f"file ended early ({done} of {nbytes} payload bytes)")
        done += n


def _preadinto(fd: int, out: memoryview, offset: int) -> int:
    """Fill ``out`` from ``fd`` at ``offset``; returns the bytes read (short only at EOF)."""
    done = 0
    view = out.cast("B")
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def write_file(fd: int, prefix: bytes, payload: memoryview) -> None:
    """Write prefix and payload fully to ``fd`` (a fresh temp file)."""
    for chunk in (memoryview(prefix), payload.cast("B")):
        done = 0
        while done < len(chunk):
            done += os.write(fd, chunk[done:])

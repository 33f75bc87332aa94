"""The RDMA transport's wire formats: coordinates, release notices, and the side channel.

Three things cross process boundaries, and each is versioned and validated on
receipt (everything from the network or a client is hostile until checked):

- **Coordinates** ride in ``ec_transfer_params[mm_hash]["encoderpool"]["rdma"]`` (the
  ``rdma`` field of ``contracts.Announcement``)
  from a producer's response, through the router (or any client), to a
  consumer: ``{"v": 1, "agent", "host", "port", "offset", "size", "dtype",
  "shape", "checksum", "gen"}``.
- **Release notices** are the NIXL notification a READ delivers to the
  producer when it completes: JSON ``{"v": 1, "slot": offset, "gen": n}``.
- **The side channel**: TCP on ``side_channel_port``; frames are a 4-byte
  big-endian length plus UTF-8 JSON. The consumer sends ``{"v": 1, "op":
  "meta"}``; the producer answers ``{"v": 1, "ok": true, "agent", "metadata"
  (base64 NIXL agent metadata), "base", "length", "fingerprint"}``, or
  ``{"v": 1, "ok": false, "error"}``. One request per connection.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import json
import logging
import re
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

from encoderpool_connector.contracts import DTYPE_BYTES, payload_bytes
from encoderpool_connector.rdma.buffer import MAX_DIMS

logger = logging.getLogger("vllm.ext." + __name__)

WIRE_VERSION = 1
MAX_REQUEST_FRAME = 4 << 10
MAX_REPLY_FRAME = 1 << 20
MAX_ITEM_BYTES = 1 << 34  # 16 GiB: far above any encoder output, far below overflow
MAX_CONNECTIONS = 32
_FRAME = struct.Struct(">I")
_AGENT = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*$")
_CHECKSUM = re.compile(r"^blake3:[0-9a-f]{64}$")
_FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")


class WireError(ValueError):
    """Something received does not follow the wire format; the message says what."""


# ---- small validators ----


def _int(obj: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = obj.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise WireError(f"{key} must be an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def _str(obj: dict[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not pattern.match(v):
        raise WireError(f"{key} must match {pattern.pattern}, got {v!r:.80}")
    return v


def _version(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise WireError(f"{what} must be a JSON object, got {type(obj).__name__}")
    if obj.get("v") != WIRE_VERSION:
        raise WireError(f"{what} has version {obj.get('v')!r:.20}; this side speaks {WIRE_VERSION}")
    return obj


def valid_host(host: str) -> bool:
    """An IP literal or a DNS name (no ports, schemes, paths or whitespace)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(host))


# ---- coordinates ----


@dataclass(frozen=True)
class Coordinates:
    """Where one encoder output lies in a producer's registered memory."""

    agent: str
    host: str
    port: int
    offset: int
    size: int
    dtype: str
    shape: tuple[int, ...]
    checksum: str
    gen: int

    def to_json(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "agent": self.agent,
            "host": self.host,
            "port": self.port,
            "offset": self.offset,
            "size": self.size,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "checksum": self.checksum,
            "gen": self.gen,
        }


def parse_coordinates(obj: Any) -> Coordinates:
    """Validated coordinates from a request's ``ec_transfer_params``; WireError otherwise."""
    obj = _version(obj, "rdma coordinates")
    host = obj.get("host")
    if not isinstance(host, str) or not valid_host(host):
        raise WireError(f"host must be an IP address or DNS name, got {host!r:.80}")
    dtype = obj.get("dtype")
    if dtype not in DTYPE_BYTES:
        raise WireError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r:.40}")
    shape = obj.get("shape")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_DIMS
        or any(type(d) is not int or not 0 < d < 1 << 32 for d in shape)
    ):
        raise WireError(f"shape must be 1-{MAX_DIMS} positive integers, got {shape!r:.80}")
    size = _int(obj, "size", 1, MAX_ITEM_BYTES)
    if payload_bytes(str(dtype), shape) != size:
        raise WireError(f"size {size} does not match shape {shape} of {dtype}")
    return Coordinates(
        agent=_str(obj, "agent", _AGENT),
        host=host,
        port=_int(obj, "port", 1, 65535),
        offset=_int(obj, "offset", 0, 1 << 50),
        size=size,
        dtype=str(dtype),
        shape=tuple(shape),
        checksum=_str(obj, "checksum", _CHECKSUM),
        gen=_int(obj, "gen", 1, 1 << 62),
    )


# ---- release notices ----


def encode_release(slot: int, gen: int) -> bytes:
    return json.dumps({"v": WIRE_VERSION, "slot": slot, "gen": gen}).encode()


def parse_release(raw: bytes) -> tuple[int, int]:
    """(slot offset, generation) of a READ's completion notice; WireError otherwise."""
    if len(raw) > 256:
        raise WireError(f"release notice of {len(raw)} bytes is too long")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"release notice is not JSON: {e}") from None
    obj = _version(obj, "release notice")
    return _int(obj, "slot", 0, 1 << 50), _int(obj, "gen", 1, 1 << 62)


# ---- side channel frames ----


def encode_frame(obj: dict[str, Any]) -> bytes:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return _FRAME.pack(len(raw)) + raw


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 16))
        if not chunk:
            raise WireError(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, limit: int) -> Any:
    """One frame's JSON; WireError on a bad length, truncation or non-JSON."""
    (n,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if not 0 < n <= limit:
        raise WireError(f"frame of {n} bytes is outside (0, {limit}]")
    try:
        return json.loads(_recv_exact(sock, n))
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"frame is not JSON: {e}") from None


@dataclass(frozen=True)
class PeerInfo:
    """A producer as its side channel describes it."""

    agent: str
    metadata: bytes
    base: int
    length: int
    fingerprint: str


def parse_meta_reply(obj: Any) -> PeerInfo:
    obj = _version(obj, "side channel reply")
    if obj.get("ok") is not True:
        raise WireError(f"producer refused: {str(obj.get('error'))[:200]}")
    raw = obj.get("metadata")
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_REPLY_FRAME:
        raise WireError("metadata must be a non-empty base64 string")
    try:
        metadata = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as e:
        raise WireError(f"metadata is not base64: {e}") from None
    return PeerInfo(
        agent=_str(obj, "agent", _AGENT),
        metadata=metadata,
        base=_int(obj, "base", 1, (1 << 64) - 1),
        length=_int(obj, "length", 1, 1 << 50),
        fingerprint=_str(obj, "fingerprint", _FINGERPRINT),
    )


def fetch_peer(host: str, port: int, timeout: float) -> PeerInfo:
    """Ask a producer's side channel for its agent metadata; WireError or OSError on failure."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(encode_frame({"v": WIRE_VERSION, "op": "meta"}))
        return parse_meta_reply(read_frame(sock, MAX_REPLY_FRAME))


class SideChannelServer:
    """The producer's side channel: answers ``meta`` requests from a fixed reply.

    One short-lived thread per connection, at most ``MAX_CONNECTIONS`` at once
    (more are closed at once), each with a read timeout, so a slow or hostile
    client can neither pile up threads nor hold one forever.
    """

    def __init__(self, bind_host: str, port: int, reply: dict[str, Any], timeout: float) -> None:
        self._reply = encode_frame({"v": WIRE_VERSION, "ok": True, **reply})
        self._timeout = timeout
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((bind_host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(
                e.errno,
                f"rdma.side_channel_port: cannot listen on {bind_host}:{port} ({e.strerror}); "
                "pick a free port or stop what holds it",
            ) from None
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self.served = 0
        self.refused = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ep-side-channel", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self.refused += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._timeout)
            req = _version(read_frame(conn, MAX_REQUEST_FRAME), "side channel request")
            if req.get("op") != "meta":
                raise WireError(f"unknown op {req.get('op')!r:.40}")
            conn.sendall(self._reply)
            self.served += 1
        except (WireError, OSError) as e:
            self.refused += 1
            with contextlib.suppress(OSError):
                conn.sendall(encode_frame({"v": WIRE_VERSION, "ok": False, "error": str(e)[:200]}))
        finally:
            conn.close()
            self._slots.release()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)

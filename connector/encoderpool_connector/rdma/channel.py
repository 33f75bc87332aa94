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

With the pool's channel key (``auth``), coordinates carry ``ts`` and ``mac``, requests
``ts``, ``nonce`` and ``mac``, replies the request's ``nonce`` and a ``mac``, and release
notices a ``mac``; anything that does not verify is refused before it is acted on.
Every connection has an absolute deadline (a peer that sends a byte a second is cut
off when it passes) and each client address at most ``MAX_PER_PEER`` connections.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import json
import logging
import re
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from encoderpool_connector.rdma.auth import (
    CLOCK_SKEW_S,
    COORDINATES,
    META_REPLY,
    META_REQUEST,
    RELEASE,
    REQUEST_WINDOW_S,
    NonceBook,
    OncePerPeer,
    check_time,
)
from encoderpool_connector.rdma.buffer import MAX_DIMS
from encoderpool_contracts import DTYPE_BYTES, payload_bytes
from encoderpool_contracts.integrity import AuthError, ChannelKey

logger = logging.getLogger("vllm.ext." + __name__)

WIRE_VERSION = 1
MAX_REQUEST_FRAME = 4 << 10
MAX_REPLY_FRAME = 1 << 20
MAX_ITEM_BYTES = 1 << 34  # 16 GiB: far above any encoder output, far below overflow
MAX_CONNECTIONS = 32
MAX_PER_PEER = 4  # connections at once from one client address (one request each)
_FRAME = struct.Struct(">I")
_AGENT = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*$")
_CHECKSUM = re.compile(r"^blake3:[0-9a-f]{64}$")
_FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")
_NONCE = re.compile(r"^[0-9a-f]{32}$")


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


def sign_coordinates(
    key: ChannelKey, coords: Coordinates, mm_hash: str, fingerprint: str, now: float
) -> dict[str, Any]:
    """The coordinates' JSON with ``ts`` and a ``mac`` bound to the item and the model."""
    body = {**coords.to_json(), "ts": round(now, 3)}
    mac = key.mac(COORDINATES, {"coords": body, "mm_hash": mm_hash, "fingerprint": fingerprint})
    return {**body, "mac": mac}


def verify_coordinates(
    key: ChannelKey, raw: Any, mm_hash: str, fingerprint: str, *, max_age: float, now: float
) -> None:
    """AuthError unless ``raw`` was signed with ``key`` for this item and model, and is not
    older than ``max_age`` (then no slot it could name is still alive)."""
    if not isinstance(raw, dict):
        raise AuthError(f"coordinates must be a JSON object, got {type(raw).__name__}")
    body = {k: v for k, v in raw.items() if k != "mac"}
    key.check(
        COORDINATES,
        {"coords": body, "mm_hash": mm_hash, "fingerprint": fingerprint, "mac": raw.get("mac")},
    )
    check_time(body.get("ts"), now, max_age=max_age, max_ahead=CLOCK_SKEW_S)


# ---- release notices ----


def encode_release(slot: int, gen: int, key: ChannelKey | None) -> bytes:
    body: dict[str, Any] = {"v": WIRE_VERSION, "slot": slot, "gen": gen}
    return json.dumps(key.sign(RELEASE, body) if key else body).encode()


def parse_release(raw: bytes, key: ChannelKey | None) -> tuple[int, int]:
    """(slot offset, generation) of a READ's completion notice; WireError (AuthError when
    it does not verify) otherwise."""
    if len(raw) > 256:
        raise WireError(f"release notice of {len(raw)} bytes is too long")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"release notice is not JSON: {e}") from None
    if key is not None:
        obj = key.check(RELEASE, obj)
    obj = _version(obj, "release notice")
    return _int(obj, "slot", 0, 1 << 50), _int(obj, "gen", 1, 1 << 62)


# ---- side channel frames ----


def encode_frame(obj: dict[str, Any]) -> bytes:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return _FRAME.pack(len(raw)) + raw


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise WireError(f"deadline passed {what}")
    return left


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        sock.settimeout(_left(deadline, f"after {got} of {n} bytes"))
        try:
            chunk = sock.recv(min(n - got, 1 << 16))
        except TimeoutError:
            raise WireError(f"deadline passed after {got} of {n} bytes") from None
        if not chunk:
            raise WireError(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, limit: int, deadline: float) -> Any:
    """One frame's JSON, all of it before ``deadline`` (monotonic); WireError on a bad
    length, truncation, non-JSON or the deadline."""
    (n,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size, deadline))
    if not 0 < n <= limit:
        raise WireError(f"frame of {n} bytes is outside (0, {limit}]")
    try:
        return json.loads(_recv_exact(sock, n, deadline))
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


def meta_request(key: ChannelKey | None, now: float) -> tuple[dict[str, Any], str]:
    """A side-channel request and its nonce ("" unsigned)."""
    if key is None:
        return {"v": WIRE_VERSION, "op": "meta"}, ""
    nonce = secrets.token_hex(16)
    body = {"v": WIRE_VERSION, "op": "meta", "ts": round(now, 3), "nonce": nonce}
    return key.sign(META_REQUEST, body), nonce


def fetch_peer(host: str, port: int, timeout: float, key: ChannelKey | None) -> PeerInfo:
    """Ask a producer's side channel for its agent metadata, all within ``timeout``;
    AuthError if the reply is not signed for this request, WireError or OSError otherwise."""
    deadline = time.monotonic() + timeout
    request, nonce = meta_request(key, time.time())
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(_left(deadline, "before sending"))
        sock.sendall(encode_frame(request))
        reply = read_frame(sock, MAX_REPLY_FRAME, deadline)
    if key is not None:
        if isinstance(reply, dict) and reply.get("ok") is False:
            raise WireError(f"producer refused: {str(reply.get('error'))[:200]}")
        reply = key.check(META_REPLY, reply)
        if reply.get("nonce") != nonce:
            raise AuthError("the reply answers another request (replayed)")
    return parse_meta_reply(reply)


class SideChannelServer:
    """The producer's side channel: answers ``meta`` requests from a fixed reply.

    One short-lived thread per connection, at most ``MAX_CONNECTIONS`` at once and
    ``MAX_PER_PEER`` per client address (more are closed at once), each cut off at an
    absolute deadline of ``timeout`` seconds from its accept, so slow or hostile clients
    can neither pile up threads nor hold the channel. With ``key``, a request must be
    signed, fresh and not replayed, and the reply is signed for it.
    """

    def __init__(
        self,
        bind_host: str,
        port: int,
        reply: dict[str, Any],
        timeout: float,
        *,
        key: ChannelKey | None,
        per_peer: int = MAX_PER_PEER,
    ) -> None:
        self._reply = {"v": WIRE_VERSION, "ok": True, **reply}
        self._unsigned_reply = encode_frame(self._reply)
        self._key = key
        self._timeout = timeout
        self._per_peer = per_peer
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()
        self._nonces = NonceBook(REQUEST_WINDOW_S)
        self._log = OncePerPeer("a side-channel request")
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
        self.unauthenticated = 0
        self.cut = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ep-side-channel", daemon=True)
        self._thread.start()

    def take_counts(self) -> dict[str, int]:
        """Refusals since the last call: {"unauthenticated", "channel_refused"}."""
        with self._lock:
            out = {"unauthenticated": self.unauthenticated, "channel_refused": self.refused}
            self.unauthenticated = self.refused = 0
        return out

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            deadline = time.monotonic() + self._timeout
            peer = str(addr[0])
            with self._lock:
                over = self._active.get(peer, 0) >= self._per_peer
                if not over:
                    self._active[peer] = self._active.get(peer, 0) + 1
            if over:
                self._count("refused")
                self._log.warn(peer, f"more than {self._per_peer} connections at once")
                conn.close()
                continue
            if not self._slots.acquire(blocking=False):
                self._count("refused")
                self._done(peer)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer, deadline), daemon=True).start()

    def _done(self, peer: str) -> None:
        with self._lock:
            n = self._active.get(peer, 0) - 1
            if n > 0:
                self._active[peer] = n
            else:
                self._active.pop(peer, None)

    def _answer(self, req: Any) -> bytes:
        req = _version(req, "side channel request")
        if self._key is None:
            if req.get("op") != "meta":
                raise WireError(f"unknown op {req.get('op')!r:.40}")
            return self._unsigned_reply
        body = self._key.check(META_REQUEST, req)
        if body.get("op") != "meta":
            raise WireError(f"unknown op {body.get('op')!r:.40}")
        check_time(
            body.get("ts"), time.time(), max_age=REQUEST_WINDOW_S, max_ahead=REQUEST_WINDOW_S
        )
        nonce = body.get("nonce")
        if not isinstance(nonce, str) or not _NONCE.match(nonce):
            raise AuthError("nonce must be 32 hex digits")
        self._nonces.add(nonce, time.monotonic())
        return encode_frame(self._key.sign(META_REPLY, {**self._reply, "nonce": nonce}))

    def _serve(self, conn: socket.socket, peer: str, deadline: float) -> None:
        try:
            reply = self._answer(read_frame(conn, MAX_REQUEST_FRAME, deadline))
            conn.settimeout(_left(deadline, "before replying"))
            conn.sendall(reply)
            self._count("served")
        except AuthError as e:
            self._count("unauthenticated")
            self._log.warn(peer, str(e))
            with contextlib.suppress(OSError):
                conn.settimeout(0.1)
                conn.sendall(
                    encode_frame({"v": WIRE_VERSION, "ok": False, "error": "unauthenticated"})
                )
        except (WireError, OSError) as e:
            self._count("refused")
            if "deadline" in str(e):
                self._count("cut")
                self._log.warn(peer, str(e))
            with contextlib.suppress(OSError):
                conn.settimeout(0.1)
                conn.sendall(encode_frame({"v": WIRE_VERSION, "ok": False, "error": str(e)[:200]}))
        finally:
            conn.close()
            self._slots.release()
            self._done(peer)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)

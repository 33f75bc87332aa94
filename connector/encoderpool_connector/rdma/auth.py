"""The rdma transport's message authentication: HMAC-SHA256 with the pool's channel key.

The operator creates one Secret per pool and gives its key to every producer and
consumer of the pool as env ``ENCODERPOOL_CHANNEL_KEY`` (``contracts.CHANNEL_KEY_ENV``).
With it, everything a consumer acts on before a NIXL connect or READ, and everything a
producer answers, is signed, and checked with ``hmac.compare_digest``:

- **coordinates** (producer -> router -> consumer): bound to the item's ``mm_hash``, the
  model fingerprint and the time they were issued; refused once older than the slot they
  name can live (``slot_ttl_s``). A replay inside that bound names the same item's bytes,
  which the READ verifies against the signed checksum.
- **side-channel requests** (consumer -> producer): a time and a random nonce; a producer
  refuses a request outside +-``REQUEST_WINDOW_S`` or a nonce it has seen in that window.
- **side-channel replies** (producer -> consumer): bound to the request's nonce, so an
  old or relayed reply is refused; only then does the consumer hand the agent metadata
  (the producer's memory keys) to NIXL.
- **release notices** (consumer -> producer, in the READ's NIXL notification).

Each kind signs under its own label, so one never verifies as another. Without the
env the transport runs unauthenticated and says so at start-up (docs/security.md).
The shared-volume transport signs its entries with the same key under a label of its
own (``shared_volume/entry.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from encoderpool_connector.contracts import CHANNEL_KEY_ENV

logger = logging.getLogger("vllm.ext." + __name__)

MIN_KEY_BYTES = 16
REQUEST_WINDOW_S = 30.0  # side-channel requests: how far their time may be from ours
CLOCK_SKEW_S = 30.0  # coordinates: how far in the future their issue time may be
MAX_LOGGED_PEERS = 256  # distinct peers named in "refused" warnings; then one summary

COORDINATES = "encoderpool/rdma/coordinates/v1"
META_REQUEST = "encoderpool/rdma/meta-request/v1"
META_REPLY = "encoderpool/rdma/meta-reply/v1"
RELEASE = "encoderpool/rdma/release/v1"


class AuthError(ValueError):
    """A message that does not verify: unsigned, wrong key, tampered, stale or replayed."""


def canonical(body: Mapping[str, Any]) -> bytes:
    """The bytes a MAC covers: sorted keys, no whitespace, ASCII (both sides agree)."""
    try:
        return json.dumps(
            body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as e:
        raise AuthError(f"not signable JSON: {e}") from None


class ChannelKey:
    """The pool's secret; signs and checks under a label per message kind."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(
                f"env {CHANNEL_KEY_ENV} holds {len(secret)} bytes; the channel key needs at "
                f"least {MIN_KEY_BYTES} (the operator's Secret holds 32 random bytes)"
            )
        self._secret = secret

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChannelKey | None:
        """The key in env ``ENCODERPOOL_CHANNEL_KEY``; None when it is unset or empty."""
        raw = (os.environ if environ is None else environ).get(CHANNEL_KEY_ENV, "").strip()
        return cls(raw.encode()) if raw else None

    def __repr__(self) -> str:  # never the secret
        return "ChannelKey(<hidden>)"

    def mac(self, label: str, body: Mapping[str, Any]) -> str:
        msg = label.encode() + b"\n" + canonical(body)
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def sign(self, label: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` plus its ``mac``."""
        return {**body, "mac": self.mac(label, body)}

    def check(self, label: str, signed: Any) -> dict[str, Any]:
        """``signed`` without its ``mac`` if the mac verifies; AuthError otherwise."""
        if not isinstance(signed, dict):
            raise AuthError(f"expected a signed JSON object, got {type(signed).__name__}")
        mac = signed.get("mac")
        if mac is None:
            raise AuthError("unsigned (no mac)")
        if not isinstance(mac, str) or len(mac) != 64:
            raise AuthError("malformed mac")
        body = {k: v for k, v in signed.items() if k != "mac"}
        if not hmac.compare_digest(mac.encode(), self.mac(label, body).encode()):
            raise AuthError("bad mac (another key, or the message was changed)")
        return body


def check_time(ts: Any, now: float, *, max_age: float, max_ahead: float) -> None:
    """AuthError unless ``now - max_age <= ts <= now + max_ahead``."""
    if type(ts) not in (int, float):
        raise AuthError(f"ts must be a number, got {ts!r:.40}")
    if ts < now - max_age:
        raise AuthError(f"stale: issued {now - ts:.0f} s ago (bound {max_age:.0f} s)")
    if ts > now + max_ahead:
        raise AuthError(f"issued {ts - now:.0f} s in the future (bound {max_ahead:.0f} s)")


class NonceBook:
    """Nonces seen in the last ``window`` seconds, at most ``capacity`` (bounded memory).

    Full of live nonces means a flood: new requests are refused until old ones age out,
    rather than forgetting nonces that could then be replayed.
    """

    def __init__(self, window: float, capacity: int = 8192) -> None:
        self.window = window
        self.capacity = capacity
        self._seen: dict[str, float] = {}  # insertion order = time order
        self._lock = threading.Lock()

    def add(self, nonce: str, now: float) -> None:
        """Record ``nonce``; AuthError if it was seen (a replay) or the book is full."""
        with self._lock:
            for old, t in list(self._seen.items()):
                if t >= now - self.window:
                    break
                del self._seen[old]
            if nonce in self._seen:
                raise AuthError("replayed (nonce already used)")
            if len(self._seen) >= self.capacity:
                raise AuthError("too many requests in the replay window")
            self._seen[nonce] = now


class OncePerPeer:
    """Warn about a peer's refused messages once (a hostile peer cannot flood the log)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, peer: str, why: str) -> None:
        with self._lock:
            if peer in self._seen or len(self._seen) > MAX_LOGGED_PEERS:
                return
            self._seen.add(peer)
            last = len(self._seen) > MAX_LOGGED_PEERS
        logger.warning(
            "encoderpool: refused %s from %s: %s (logged once per peer%s)",
            self.what,
            peer[:200],
            why[:300],
            "; further peers are only counted" if last else "",
        )


def warn_unauthenticated(role: str) -> None:
    logger.warning(
        "encoderpool rdma %s: env %s is not set: side-channel requests and item coordinates "
        "are NOT authenticated, so anyone who reaches this pod can ask a producer for its "
        "memory keys or point a consumer at any address. The operator sets it from the "
        "pool's Secret; run without it only for local development.",
        role,
        CHANNEL_KEY_ENV,
    )

"""The rdma transport's message authentication: HMAC-SHA256 with the pool's channel key.

The operator creates one Secret per pool and gives its key to every producer and
consumer of the pool as env ``ENCODERPOOL_CHANNEL_KEY``
(``encoderpool_contracts.CHANNEL_KEY_ENV``). With it, everything a consumer acts on
before a NIXL connect or READ, and everything a producer answers, is signed, and
checked with ``hmac.compare_digest``:

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
The key, its MAC and the payload checksum are ``encoderpool_contracts.integrity``'s,
shared with the shared-volume transport (which signs its entries under a label of its
own).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from encoderpool_contracts import CHANNEL_KEY_ENV
from encoderpool_contracts.integrity import AuthError

logger = logging.getLogger("vllm.ext." + __name__)

REQUEST_WINDOW_S = 30.0  # side-channel requests: how far their time may be from ours
CLOCK_SKEW_S = 30.0  # coordinates: how far in the future their issue time may be
MAX_LOGGED_PEERS = 256  # distinct peers named in "refused" warnings; then one summary

COORDINATES = "encoderpool/rdma/coordinates/v1"
META_REQUEST = "encoderpool/rdma/meta-request/v1"
META_REPLY = "encoderpool/rdma/meta-reply/v1"
RELEASE = "encoderpool/rdma/release/v1"


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

"""Integrity shared by both transports: the pool key's MAC and the payload checksum.

One implementation, here, so that the shared volume's signed entries and the rdma
transport's signed messages and checksummed READs cannot drift apart, and neither
transport imports the other. The key comes from env ``ENCODERPOOL_CHANNEL_KEY``
(``CHANNEL_KEY_ENV``), filled from the pool's Secret; each transport signs under
labels of its own, so a message of one kind never verifies as another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

import blake3

from encoderpool_contracts.keys import CHANNEL_KEY_ENV

MIN_KEY_BYTES = 16


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


def checksum(payload: memoryview | bytes | bytearray) -> str:
    """BLAKE3 of a payload (vLLM depends on blake3, so it is in every vLLM image); the
    shared volume's entries carry it, and rdma READs are verified against it."""
    return "blake3:" + blake3.blake3(payload, max_threads=blake3.blake3.AUTO).hexdigest()

"""Media items of a request: their limits (how many, per modality; the media kwargs a
trusted client may send), the URL a part names and the key that names an item. The URL
guard is ``url_guard``; what a producer is asked for one item, ``producer_request``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from blake3 import blake3

from encoderpool_router.content import modality

# Request fields that change what the encoder emits, so a producer must see them too:
# the HF processor's arguments, and how media are decoded (a video's frames: num_frames,
# fps). A producer that decoded otherwise would publish an embedding the consumer
# cannot use (other token count) and the consumer would encode the item itself.
ENCODER_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")
# A trusted request's media kwargs, serialised, at most this long: they are a few knobs
# (num_frames, fps, max_pixels), and each producer request of the body carries them.
MM_KWARGS_BYTES = 4096
# ... and nested at most this deep. Each producer request serialises them again, deeper
# in the stack than the check here: were the recursion limit the only bound, a value
# that passed here could fail there.
MM_KWARGS_DEPTH = 16


def mm_kwargs_problem(body: dict[str, Any], trusted: bool) -> str | None:
    """Why a request's ``mm_processor_kwargs`` / ``media_io_kwargs`` are refused (a 400's
    message), or None.

    They change how much work each item costs (frames decoded, pixels encoded), so vLLM
    refuses them unless started with ``--trust-request-mm-kwargs``, by the same rule
    (any non-empty value). Refused here too, before any producer is asked, rather than
    dropped: a request quietly answered with other frames than asked for would be
    wrong. Trusted, they pass on, bounded in size and depth.
    """
    for name in ENCODER_FIELDS:
        value = body.get(name)
        if not value:
            continue
        if not trusted:
            return (
                f"{name} is not accepted by this pool: per-request media kwargs change "
                "the encoder's cost; the pool owner enables them with "
                "spec.router.trustRequestMmKwargs (the router's --trust-request-mm-kwargs)"
            )
        if not isinstance(value, dict):
            return f"{name} must be an object"
        if _nested_past(value, MM_KWARGS_DEPTH):
            return f"{name} is nested too deeply (at most {MM_KWARGS_DEPTH} levels)"
        try:
            size = len(json.dumps(value))
        except RecursionError:  # deep past the values _nested_past walks: too big as well
            return f"{name} is nested too deeply (at most {MM_KWARGS_DEPTH} levels)"
        if size > MM_KWARGS_BYTES:
            return f"{name} is over {MM_KWARGS_BYTES} bytes serialised"
    return None


def _nested_past(value: Any, most: int) -> bool:
    """Whether ``value`` nests lists or objects more than ``most`` deep. Walked without
    recursion, and over at most ``MM_KWARGS_BYTES`` values: each serialises to a byte at
    least, so past that the size refuses it anyway."""
    todo = [(value, 1)]
    for _ in range(MM_KWARGS_BYTES):
        if not todo:
            return False
        item, depth = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth > most:
                return True
            todo.extend((child, depth + 1) for child in item)
    return False


def over_limits(items: list[dict[str, Any]], most: int, per_modality: dict[str, int]) -> str | None:
    """Why ``items`` (canonical parts, ``content.read_media``'s) are too many for one
    request (a 400's message), or None."""
    if len(items) > most:
        return f"{len(items)} media items in one request; at most {most} are accepted"
    counts: dict[str, int] = {}
    for part in items:
        kind = modality(part)
        counts[kind] = counts.get(kind, 0) + 1
    for kind, n in sorted(counts.items()):
        limit = per_modality.get(kind)
        if limit is not None and n > limit:
            return f"{n} {kind} items in one request; this model accepts at most {limit}"
    return None


def media_url(part: dict[str, Any]) -> str | None:
    """The URL a part names (``image_url.url`` ...), if it names one."""
    payload = part.get(str(part.get("type")))
    url = payload.get("url") if isinstance(payload, dict) else None
    return url if isinstance(url, str) else None


def media_key(
    part: dict[str, Any], utf8_of: Callable[[str], memoryview | None] | None = None
) -> bytes:
    """A digest naming the item, for producer affinity and ``--reuse-encoded-s``.

    The client's ``uuid`` when given (vLLM then uses it as the item's hash),
    else the part itself (URL or inline data): the same media sent again picks
    the same producer. It is not vLLM's ``mm_hash`` (that needs the decoded
    media), only a stable stand-in for it: a collision would cost an item a
    second encode, never a wrong answer, but clients do not trust each other, so
    the digest is still a cryptographic one. BLAKE3, not SHA-256: with AVX2 or
    AVX-512 it is 3-4x faster than SHA-256 even with SHA-NI (0.36 against 1.2 ms
    for a 2 MB image here). ``utf8_of`` (``ClientBody.utf8_of``) gives a long
    URL's UTF-8 as the client's own bytes, so it is not encoded again: the same
    key either way. A lone surrogate (``content`` refuses it before) is hashed as
    itself (``surrogatepass``), not raised on: the key is total.
    """
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return blake3(b"uuid\0" + _utf8(uuid)).digest(16)
    payload = part.get(str(part.get("type")))
    url = payload.get("url") if isinstance(payload, dict) else None
    if isinstance(url, str):
        raw = utf8_of(url) if utf8_of is not None else None
        return blake3(raw if raw is not None else _utf8(url)).digest(16)
    data = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return blake3(data).digest(16)


def _utf8(text: str) -> bytes:
    """``text``'s UTF-8, a lone surrogate encoded as itself instead of raising: bytes no
    valid string's UTF-8 holds, so distinct strings still give distinct bytes."""
    return text.encode("utf-8", "surrogatepass")

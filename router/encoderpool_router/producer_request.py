"""What a producer is asked for one media item: the item alone in a chat request with
the fields that change what the encoder emits, serialised once (a long data: URL copied
from the client's bytes, not encoded again)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from encoderpool_router.media import ENCODER_FIELDS, media_url


def encoder_request(body: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """One item alone, decoding nothing: the producer encodes and publishes it."""
    req: dict[str, Any] = {
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
        "stream": False,
    }
    if "model" in body:
        req["model"] = body["model"]
    for name in ENCODER_FIELDS:
        if name in body:
            req[name] = body[name]
    return req


def encoder_request_bytes(
    body: dict[str, Any],
    part: dict[str, Any],
    literal: Callable[[str], memoryview | None] | None = None,
) -> bytes:
    """``encoder_request`` serialised. A long media URL (a data: URL of a large image)
    is not serialised again: ``literal`` finds its JSON literal in the client's bytes
    (``ClientBody.literal``) and that is copied in, once."""
    parts = encoder_request_parts(body, part, literal)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def encoder_request_parts(
    body: dict[str, Any],
    part: dict[str, Any],
    literal: Callable[[str], memoryview | None] | None = None,
) -> tuple[bytes] | tuple[bytes, memoryview, bytes]:
    """``encoder_request_bytes`` unjoined: with a literal found, the serialised head,
    the literal (a view of the client's bytes) and the tail, sent as they are."""
    req = encoder_request(body, part)
    url = media_url(part)
    found = literal(url) if literal is not None and url is not None else None
    if found is None:
        return (json.dumps(req).encode(),)
    kind = str(part["type"])
    marker = "\u0000encoderpool-url\u0000"
    stub = {**part, kind: {**part[kind], "url": marker}}
    text = json.dumps({**req, "messages": [{"role": "user", "content": [stub]}]}).encode()
    quoted = json.dumps(marker).encode()
    if text.count(quoted) != 1:  # the marker spelled elsewhere too (a client's key or value)
        return (json.dumps(req).encode(),)
    head, _, tail = text.partition(quoted)
    return head, found, tail

"""The first steps of a request, before anything goes upstream: its body read and
parsed, its content parts classified, its media items checked.

Each step answers a bad request by raising ``Refused`` (408, 400; a body over
``--max-body-bytes`` is aiohttp's 413; a body the memory budget cannot hold 413, 429
or 503).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web import RequestPayloadError

from encoderpool_router.body import ClientBody, NotAnObject, parse
from encoderpool_router.budget import BODY_COPIES, Lease
from encoderpool_router.config import RouterSettings
from encoderpool_router.content import PartRefused, ReadItems
from encoderpool_router.media import media_key, media_url, mm_kwargs_problem, over_limits
from encoderpool_router.protocol import INVALID, TOO_DEEP, Refused, invalid
from encoderpool_router.responses import Unsupported
from encoderpool_router.url_guard import url_problem

# An API's reader of media items (``content.read_media`` for chat): the body and whether
# client uuids are kept; ``PartRefused`` or ``responses.Unsupported`` for a refusal.
Reader = Callable[[dict[str, Any], bool], ReadItems]


@dataclass(frozen=True, slots=True)
class Media:
    """A request's media items: canonical parts (``content.read_media``'s), in order,
    and their media keys.

    The keys are computed from what the router read itself, after the client's uuids
    went: a client steers its request (to a producer, to a consumer) only through the
    media it sends.
    """

    parts: list[dict[str, Any]]
    keys: list[bytes]

    @property
    def affinity(self) -> bytes | None:
        """The first item's key, which ranks the consumers for ``media-affinity``."""
        return self.keys[0] if self.keys else None

    @property
    def distinct(self) -> int:
        return len(set(self.keys))


async def read_body(request: web.Request, settings: RouterSettings, lease: Lease) -> ClientBody:
    """The client's JSON object (the fields the router owns dropped: ``body.parse``), its
    memory held in ``lease`` before it is spent (``Refused``: 413, 429, 503)."""
    try:
        raw = await _read(request, settings.max_body_bytes, settings.body_read_timeout_s, lease)
    except RequestPayloadError as e:  # e.g. a body not in its Content-Encoding
        raise Refused(
            400, f"request body cannot be read: {e}", INVALID, "bad_request", close=True
        ) from None
    except TimeoutError:
        raise Refused(
            408,
            f"request body not received within {settings.body_read_timeout_s:g} s",
            "timeout",
            "body_timeout",
            close=True,
        ) from None
    try:
        return parse(raw, lease.grow_to)
    except NotAnObject as e:
        raise invalid(str(e)) from None
    except ValueError as e:  # UnicodeDecodeError included
        raise invalid(f"request body is not JSON: {e}") from None
    except RecursionError:  # json's C parser refuses nesting past the recursion limit
        raise invalid(TOO_DEEP) from None


# A body of unknown length (chunked) is read and reserved this much at a time.
UNKNOWN_LENGTH_CHUNK = 1 << 20


async def _read(request: web.Request, limit: int, timeout_s: float, lease: Lease) -> bytes:
    """The body, at most ``limit`` bytes (else 413), copied once: aiohttp's ``read``
    copies a large body twice (into a bytearray, then into bytes).

    Its memory is reserved before it is read: a declared length whole (and a copy for
    the parse, ``BODY_COPIES``), so a body that cannot fit is refused unread; a body
    of unknown length a chunk at a time, aiohttp's read-ahead kept to a chunk. A
    compressed body (aiohttp decompresses it) declares its compressed length: what it
    grows to beyond that is reserved as it comes."""
    length = request.content_length
    if length is not None and length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=length)
    content = request.content
    if length is not None:
        lease.grow_to(BODY_COPIES * length)
        content.set_read_chunk_size(max(length, 1))  # no pause/resume per 64 KiB
    else:
        content.set_read_chunk_size(UNKNOWN_LENGTH_CHUNK)
    chunks: list[bytes] = []
    size = 0
    async with asyncio.timeout(timeout_s):
        while chunk := await content.readany():
            size += len(chunk)
            if size > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
            if length is None or size > length:  # unsized, or decompressed past its length
                lease.grow_to(BODY_COPIES * (size + UNKNOWN_LENGTH_CHUNK))
            chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def classify(body: ClientBody, reader: Reader | None, settings: RouterSettings) -> Media:
    """The request's media items, every content part read as vLLM reads it (``reader``:
    the endpoint's; None, it carries none), media parts rewritten in ``body`` to their
    canonical form; refused when a part cannot be read, the media kwargs are not
    trusted, or the items are too many."""
    model = body.data.get("model")
    if model is not None and not isinstance(model, str):  # as vLLM's request models
        raise invalid("'model' must be a string")
    if refused := mm_kwargs_problem(body.data, settings.trust_request_mm_kwargs):
        raise invalid(refused)
    parts: list[dict[str, Any]] = []
    if reader is not None:
        try:
            read = reader(body.data, settings.trust_client_media_ids)
        except PartRefused as e:
            raise invalid(str(e)) from None
        except Unsupported as e:  # vLLM's own answer, status and field
            raise Refused(e.status, str(e), INVALID, "bad_request", param=e.param) from None
        if read.changed:
            body.changed()
        parts = read.parts
    if too_many := over_limits(parts, settings.max_items_per_request, settings.limit_mm_per_prompt):
        raise invalid(too_many, "too_many_items")
    return Media(parts, [media_key(part, body.utf8_of) for part in parts])


async def check_media_urls(media: Media, settings: RouterSettings) -> None:
    """Refuse a media URL that may not be fetched (the SSRF guard, ``media.url_problem``);
    inline data is fetched from nowhere."""
    for part in media.parts:
        url = media_url(part)
        if url is None or url[:5].lower() == "data:":
            continue
        problem = await asyncio.to_thread(
            url_problem, url, settings.allowed_media_domains, settings.allow_private_media
        )
        if problem:
            raise invalid(problem, "media_url_refused")

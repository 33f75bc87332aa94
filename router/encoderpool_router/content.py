"""Content parts of a chat request, read by the rules of vLLM's chat parser.

vLLM does not decide what is media by a part's ``type`` alone: a part without a
``type``, or with a ``uuid``, is read by the first media key it holds
(``{"image_url": "...", "uuid": "..."}`` is an image), and ``input_image`` is an
image too. A part the router read otherwise would reach producers and consumers
unexamined: with its client ``uuid`` (vLLM's cache key for the item: another
client's image could answer it), past the URL guard and the item limits.

So every part is read here by vLLM's rules (``vllm/renderers/chat_utils.py``,
``_parse_chat_message_content_mm_part`` of the versions the project supports;
``tests/router/test_content_vllm.py`` proves the agreement against that code and
vLLM's request model), and every media part is replaced by the one canonical
spelling of what was read: producers and consumers see only what the router
checked. A part that cannot be read with certainty is refused with its place
(``messages[1].content[2]``), never passed on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# Part types vLLM reads without media (text, and a tool reference's name).
TEXT_TYPES = frozenset(
    {"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"}
)
# Media part types -> the modality vLLM counts them under (--limit-mm-per-prompt).
MEDIA_TYPES = {
    "image_url": "image",
    "input_image": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "video_url": "video",
}
# Parts that bring their own embeddings or objects instead of media: they would skip
# the encoder (and its producers) and vLLM takes them only with --enable-mm-embeds.
EMBEDDING_TYPES = frozenset(
    {"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil"}
)
# The keys vLLM looks for, in its order, in a part without a type or with a uuid.
_KEY_ORDER = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
_MEDIA_KEYS = frozenset(_KEY_ORDER) - {"tool_reference"}
# What a URL-bearing part is sent on as (input_image is an image_url to vLLM).
_CANONICAL = {
    "image_url": "image_url",
    "input_image": "image_url",
    "audio_url": "audio_url",
    "video_url": "video_url",
}
# A UTF-16 surrogate standing alone, as JSON's "\ud800" escape gives it.
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# What a refusal says of such a string.
NOT_TEXT = "holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text"
# How much of urlsplit's complaint (which may quote the URL) a refusal repeats.
_COMPLAINT = 200


class PartRefused(ValueError):
    """A message or content part the router cannot read with certainty (a 400)."""


@dataclass(frozen=True, slots=True)
class ReadItems:
    """The media parts of a request, in order, each in its canonical spelling (and
    already put in the body in place of the client's); ``changed``: some part was
    rewritten, so the body must be serialised again."""

    parts: list[dict[str, Any]]
    changed: bool


def lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate: such a string has no UTF-8 encoding, so
    it can be neither hashed nor fetched as sent, and is no name of anything."""
    return not text.isascii() and _SURROGATE.search(text) is not None


def url_unreadable(url: str) -> str | None:
    """Why a media URL cannot be read with certainty (a 400's message), or None.

    The URL guard (``media.url_problem``) reads it with ``urlsplit``: a URL that
    parser refuses, or that is not text, names nothing the guard could check. Inline
    data is not parsed (the guard skips it, and it may be megabytes).
    """
    if lone_surrogate(url):
        return f"the media URL {NOT_TEXT}"
    if url[:5].lower() == "data:":
        return None
    try:
        urlsplit(url)
    except ValueError as e:
        return f"the media URL cannot be parsed: {str(e)[:_COMPLAINT]}"
    return None


def modality(part: dict[str, Any]) -> str:
    """The modality of a canonical media part (``read_media``'s)."""
    return MEDIA_TYPES[str(part["type"])]


def read_media(body: dict[str, Any], trust_ids: bool) -> ReadItems:
    """Every media part of a chat request, read as vLLM reads it, rewritten in place to
    its canonical form: ``{"type": t, t: {"url": url}}`` for URL kinds and
    ``{"type": "input_audio", "input_audio": {"data": d, "format": f}}``, with the
    client's ``uuid`` only when ``trust_ids``. ``PartRefused`` names what cannot be
    read; malformed messages beside media parts are refused too, since vLLM would
    read their parts all the same."""
    messages = body.get("messages")
    if messages is None:
        return ReadItems([], False)
    if not isinstance(messages, list):
        raise PartRefused("'messages' must be a list of messages")
    found: list[dict[str, Any]] = []
    changed = False
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PartRefused(f"messages[{m}] must be an object")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise PartRefused(f"messages[{m}].content must be a string or a list of parts")
        for p, part in enumerate(content):
            if isinstance(part, str):
                continue
            where = f"messages[{m}].content[{p}]"
            if not isinstance(part, dict):
                raise PartRefused(f"{where} must be a string or an object")
            canonical = read_part(part, where, trust_ids)
            if canonical is None:
                continue
            if canonical is not part:
                content[p] = canonical
                changed = True
            found.append(canonical)
    return ReadItems(found, changed)


def _kind(part: dict[str, Any], where: str) -> str:
    """The part's type as vLLM's parser decides it: its ``type`` when known and there is
    no ``uuid``; else the first media key it holds."""
    type_ = part.get("type")
    uuid = part.get("uuid")
    if (
        isinstance(type_, str)
        and uuid is None
        and (type_ in TEXT_TYPES or type_ in MEDIA_TYPES or type_ in EMBEDDING_TYPES)
    ):
        return type_
    if type_ is None or uuid is not None:
        for key in _KEY_ORDER:
            if key in part:
                return key
        raise PartRefused(f"{where} has no 'type' and no media key ({', '.join(_KEY_ORDER)})")
    if not isinstance(type_, str):
        raise PartRefused(f"{where}: 'type' must be a string")
    raise PartRefused(f"{where} has an unsupported type {type_[:64]!r}")


def read_part(part: dict[str, Any], where: str, trust_ids: bool) -> dict[str, Any] | None:
    """The canonical form of a media part (``part`` itself when already canonical);
    None for a text part. The other APIs' readers (``responses``, ``anthropic``) read
    what becomes a chat part with it, so all follow one set of rules."""
    kind = _kind(part, where)
    media_keys = _MEDIA_KEYS.intersection(part)
    if kind in TEXT_TYPES:
        if media_keys:  # read as text today; a key order apart from an image
            raise PartRefused(
                f"{where} is a {kind!r} part holding media ({', '.join(sorted(media_keys))}): "
                "send the media as a part of its own"
            )
        return None
    if kind in EMBEDDING_TYPES:
        raise PartRefused(
            f"{where}: {kind!r} parts are not accepted; this pool encodes media itself "
            "(send the image, audio or video)"
        )
    if media_keys - {"image_url" if kind == "input_image" else kind}:
        raise PartRefused(
            f"{where} holds more than one kind of media ({', '.join(sorted(media_keys))}): "
            "send one item per part"
        )
    typed = part.get("type") == kind and part.get("uuid") is None
    uuid = part.get("uuid")
    if uuid is not None and not isinstance(uuid, str):
        raise PartRefused(f"{where}: 'uuid' must be a string")
    if uuid is not None and lone_surrogate(uuid):
        raise PartRefused(f"{where}: 'uuid' {NOT_TEXT}")
    keep_id = trust_ids and uuid is not None
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not (
            isinstance(audio, dict)
            and isinstance(audio.get("data"), str)
            and audio["data"]
            and isinstance(audio.get("format"), str)
        ):
            raise PartRefused(
                f"{where}: 'input_audio' must be an object with string 'data' and 'format'"
            )
        if lone_surrogate(audio["data"]) or lone_surrogate(audio["format"]):
            raise PartRefused(f"{where}: 'input_audio' {NOT_TEXT}")
        if typed and "uuid" not in part and set(audio) == {"data", "format"}:
            return part
        canonical: dict[str, Any] = {
            "type": "input_audio",
            "input_audio": {"data": audio["data"], "format": audio["format"]},
        }
    else:
        url = _url(part, kind, typed)
        if url is None:
            raise PartRefused(
                f"{where}: the {kind!r} part names no media URL (a media uuid alone is "
                "not accepted: send the item itself)"
            )
        if unreadable := url_unreadable(url):
            raise PartRefused(f"{where}: {unreadable}")
        out = _CANONICAL[kind]
        payload = part.get(out)
        if (
            kind == out
            and typed
            and "uuid" not in part
            and isinstance(payload, dict)
            and set(payload) <= {"url", "detail"}
        ):
            return part
        canonical = {"type": out, out: {"url": url}}
    if keep_id:
        canonical["uuid"] = uuid
    return canonical


def _url(part: dict[str, Any], kind: str, typed: bool) -> str | None:
    """The URL vLLM reads from a part of ``kind``: ``image_url.url`` for a typed part,
    a string or ``{"url": ...}`` for a part read by its key; ``input_image`` carries a
    string."""
    value = part.get("image_url" if kind == "input_image" else kind)
    if kind == "input_image":
        return value if isinstance(value, str) and value else None
    if isinstance(value, dict):
        value = value.get("url")
    elif typed:
        return None  # a typed part's URL is an object (vLLM's request model)
    return value if isinstance(value, str) and value else None

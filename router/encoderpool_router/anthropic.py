"""Content blocks of an Anthropic Messages request (``/v1/messages``), read as vLLM reads
them.

vLLM turns a Messages request into a chat request (``AnthropicServingMessages.
to_chat_completion_request``): an ``image`` block of a user or assistant message becomes
an ``image_url`` part (a ``base64`` source a data URL, a ``url`` source its URL), and
the images of a user's ``tool_result`` become a user message placed before the message
that holds them. The router reads the same blocks, in that order, as canonical chat
parts (what producers get, checked by chat's rules: URL guard, limits, keys); the body
goes on unchanged (Anthropic blocks carry no uuid). What vLLM reads otherwise or not at
all is refused with its place (``messages[1].content[0].source``) rather than passed
on: an image source of an unknown type or without data, images in system text or in
an assistant's tool result (vLLM reads those as text), an unknown block type.
``tests/router/test_apis_vllm.py`` proves the agreement.
"""

from __future__ import annotations

from typing import Any

from encoderpool_router.content import PartRefused, ReadItems, url_unreadable

# Blocks vLLM reads without media.
TEXT_BLOCKS = frozenset(
    {
        "text",
        "thinking",
        "redacted_thinking",
        "tool_use",
        "tool_reference",
        "tool_addition",
        "tool_removal",
    }
)
# What a user's tool_result content may hold (vLLM skips anything else unread).
_RESULT_ITEMS = frozenset({"text", "image", "tool_reference"})


def read_blocks_media(body: dict[str, Any], trust_ids: bool) -> ReadItems:
    """Every image of the request, in vLLM's order, as canonical chat parts; the body is
    left as it is. ``trust_ids`` has nothing to keep: Anthropic images carry no uuid."""
    _refuse_images(body.get("system"), "system")
    messages = body.get("messages")
    if messages is None:
        return ReadItems([], False)
    if not isinstance(messages, list):
        raise PartRefused("'messages' must be a list of messages")
    found: list[dict[str, Any]] = []
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PartRefused(f"messages[{m}] must be an object")
        role, content = message.get("role"), message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise PartRefused(f"messages[{m}].content must be a string or a list of blocks")
        if role not in ("user", "assistant"):
            _refuse_images(content, f"messages[{m}].content")
        results: list[dict[str, Any]] = []  # a tool result's images: a message before
        own: list[dict[str, Any]] = []
        for b, block in enumerate(content):
            where = f"messages[{m}].content[{b}]"
            if not isinstance(block, dict):
                raise PartRefused(f"{where} must be an object")
            type_ = block.get("type")
            if type_ == "image":
                own.append(_image(block.get("source"), f"{where}.source"))
            elif type_ == "tool_result":
                results.extend(_result_images(block.get("content"), where, role))
            elif type_ not in TEXT_BLOCKS:
                shown = type_[:64] if isinstance(type_, str) else type_
                raise PartRefused(f"{where} has an unsupported type {shown!r}")
        found += results + own
    return ReadItems(found, False)


def _result_images(content: Any, where: str, role: object) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        return []
    out: list[dict[str, Any]] = []
    for k, item in enumerate(content):
        at = f"{where}.content[{k}]"
        if not isinstance(item, dict) or item.get("type") not in _RESULT_ITEMS:
            raise PartRefused(f"{at} must be a text, image or tool_reference object")
        if item.get("type") != "image":
            continue
        if role != "user":
            raise PartRefused(f"{at}: vLLM reads an assistant's tool result as text, not images")
        out.append(_image(item.get("source"), f"{at}.source"))
    return out


def _refuse_images(blocks: Any, where: str) -> None:
    """System text: vLLM keeps only the text of these blocks."""
    if not isinstance(blocks, list):
        return
    for b, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "image":
            raise PartRefused(
                f"{where}[{b}]: vLLM reads only text here; send images in a user message"
            )


def _image(source: Any, where: str) -> dict[str, Any]:
    """The chat part vLLM makes of an image source (``_convert_image_source_to_url``)."""
    if not isinstance(source, dict):
        raise PartRefused(f"{where} must be an object of type 'base64' or 'url'")
    kind = source.get("type")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise PartRefused(f"{where}: a 'url' source needs a non-empty string 'url'")
    elif kind == "base64":
        data, media_type = source.get("data"), source.get("media_type", "image/jpeg")
        if not (isinstance(data, str) and data and isinstance(media_type, str)):
            raise PartRefused(f"{where}: a 'base64' source needs string 'data' and 'media_type'")
        url = f"data:{media_type};base64,{data}"
    else:
        raise PartRefused(f"{where}: the source type must be 'base64' or 'url'")
    if problem := url_unreadable(url):
        raise PartRefused(f"{where}: {problem}")
    return {"type": "image_url", "image_url": {"url": url}}

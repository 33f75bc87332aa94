"""Input items of an OpenAI Responses request (``/v1/responses``), read as vLLM reads them.

vLLM validates ``input`` with the OpenAI SDK's item types, turns the items into chat
messages (``construct_input_messages``) and reads their parts with its chat parser: an
``input_image`` part, in a message or in a function call's output, is an image. The
router reads the same places by the same chat rules (``content.read_part``), so uuids,
URLs, limits and keys follow chat's, and rewrites each image to the one Responses
spelling of what it read (``{"type": "input_image", "image_url": url}``, its ``detail``
kept):
consumers see only what the router checked. What it cannot read with certainty is a
400 naming the field (``input[2].content[0]``): an item type it does not know, another
API's media spelling, and images in an assistant message (vLLM reads or drops those by
position, differently from one release to the next). ``tests/router/test_apis_vllm.py``
proves the agreement.

Stored responses and background mode are refused as vLLM refuses them with its store
off (its default): a pool's consumers keep no shared store, so a
``previous_response_id`` could never be found reliably even with it on.
"""

from __future__ import annotations

from typing import Any

from encoderpool_router.content import PartRefused, ReadItems, read_part

# Input items vLLM turns into text (tool calls, reasoning): no media in them.
TEXT_ITEMS = frozenset({"function_call", "custom_tool_call", "reasoning"})
# Tool results: their ``output`` is text or a list of parts, read like a message's.
OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})
_MEDIA_KEYS = frozenset({"image_url", "audio_url", "video_url", "input_audio", "image_pil"})


class Unsupported(ValueError):
    """A Responses feature vLLM refuses in a pool: ``status`` and ``param`` are vLLM's."""

    def __init__(self, status: int, message: str, param: str) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def unsupported(body: dict[str, Any]) -> Unsupported | None:
    """vLLM's own refusal of what the pool cannot serve (its store is off): a
    ``previous_response_id`` is not found (404), background mode needs the store (400)."""
    previous = body.get("previous_response_id")
    if previous is not None:
        return Unsupported(404, f"Response with id '{previous}' not found.", "response_id")
    if body.get("background"):
        if body.get("store", True) is False:
            return Unsupported(
                400, "background can only be used when `store` is true", "background"
            )
        return Unsupported(
            400,
            "This vLLM engine does not support `store=True` and therefore does not support "
            "the background mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            "background",
        )
    return None


def read_input_media(body: dict[str, Any], trust_ids: bool) -> ReadItems:
    """Every image of ``input``, as canonical chat parts (what producers get), each
    rewritten in the body to its Responses spelling; ``PartRefused`` names what cannot
    be read."""
    items = body.get("input")
    if items is None or isinstance(items, str):
        return ReadItems([], False)
    if not isinstance(items, list):
        raise PartRefused("'input' must be a string or a list of input items")
    found: list[dict[str, Any]] = []
    changed = False
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise PartRefused(f"{where} must be an object")
        type_ = item.get("type")
        if "role" in item and type_ in (None, "message"):
            parts, name = item.get("content"), "content"
            if item["role"] == "assistant" and _holds_media(parts):
                raise PartRefused(
                    f"{where}: an assistant message holding images is not accepted (vLLM "
                    "reads or drops them by position and release); send them in user input"
                )
        elif type_ in OUTPUT_ITEMS:
            parts, name = item.get("output"), "output"
        elif type_ in TEXT_ITEMS:
            continue
        else:
            shown = type_[:64] if isinstance(type_, str) else type_
            raise PartRefused(f"{where} has an unsupported type {shown!r}")
        if parts is None or isinstance(parts, str):
            continue
        if not isinstance(parts, list):
            raise PartRefused(f"{where}.{name} must be a string or a list of parts")
        for p, part in enumerate(parts):
            canonical, spelled = _read(part, f"{where}.{name}[{p}]", trust_ids)
            if canonical is None:
                continue
            if name == "output" and "detail" not in part:  # vLLM's model requires it here
                raise PartRefused(f"{where}.{name}[{p}]: an 'input_image' here needs 'detail'")
            found.append(canonical)
            if spelled != part:
                parts[p] = spelled
                changed = True
    return ReadItems(found, changed)


def _holds_media(parts: Any) -> bool:
    return isinstance(parts, list) and any(
        isinstance(p, dict) and (p.get("type") == "input_image" or _MEDIA_KEYS.intersection(p))
        for p in parts
    )


def _read(
    part: Any, where: str, trust_ids: bool
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A part's canonical chat form and its Responses spelling; (None, None) for text."""
    if not isinstance(part, dict):
        raise PartRefused(f"{where} must be an object")
    if part.get("type") != "input_image" and _MEDIA_KEYS.intersection(part):
        raise PartRefused(
            f"{where}: media in a Responses input part are an 'input_image' "
            "(chat's image_url, audio and video parts are not Responses input)"
        )
    canonical = read_part(part, where, trust_ids)  # input_text, refusal ...: None
    if canonical is None:
        return None, None
    spelled: dict[str, Any] = {"type": "input_image", "image_url": canonical["image_url"]["url"]}
    if "detail" in part:  # as sent: vLLM requires it in a tool's output, defaults it elsewhere
        spelled["detail"] = part["detail"]
    if "uuid" in canonical:
        spelled["uuid"] = canonical["uuid"]
    return canonical, spelled

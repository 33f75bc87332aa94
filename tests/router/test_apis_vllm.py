"""The router reads Responses input items and Anthropic content blocks as vLLM does:
proven against vLLM's own code.

Each body goes through vLLM's request model (``ResponsesRequest``,
``AnthropicMessagesRequest``), its conversion into chat messages
(``construct_input_messages``, ``AnthropicServingMessages.to_chat_completion_request``)
and its chat parser, recording each media item instead of fetching it
(``test_content_vllm``'s recorder); and through the router's reader. Where the router
accepts a body, vLLM accepts it and reads the same items (modality, URL or inline data,
uuid, in order), and reads the body the router sends on as the same items. Where the
router refuses, vLLM refuses too or the case says why the pool refuses that form.
"""

from __future__ import annotations

import copy
import importlib
import json
import random
import sys
import types
from typing import Any

import pytest

from encoderpool_router.anthropic import read_blocks_media
from encoderpool_router.content import PartRefused
from encoderpool_router.responses import read_input_media, unsupported
from tests.router.test_content_vllm import IMG, IMG2, Item, _parse_chat_message_content, _Tracker

_responses = importlib.import_module("vllm.entrypoints.openai.responses.protocol")
_responses_utils = importlib.import_module("vllm.entrypoints.openai.responses.utils")
_anthropic = importlib.import_module("vllm.entrypoints.anthropic.protocol")


def _import_anthropic_serving() -> Any:
    """vLLM's Anthropic serving module. From 0.33 a module it imports loads orjson at the
    top (to write answers); the conversion read here never writes one, and the venv (0.32's
    requirements) has no orjson, so a stand-in on json lets the module load."""
    try:
        importlib.import_module("orjson")
    except ImportError:
        pass
    else:
        return importlib.import_module("vllm.entrypoints.anthropic.serving")

    def flag(name: str) -> int:
        # Only orjson's OPT_* flags: any other missing name (``__file__``, ``__spec__``)
        # must stay missing, or code that inspects every loaded module breaks mid-import
        # (seen: torch's op registry importing vLLM's ops twice in the same process).
        if name.startswith("OPT_"):
            return 0
        raise AttributeError(name)

    stub = types.ModuleType("orjson")
    stub.dumps = lambda obj, *_, **__: json.dumps(obj).encode()  # type: ignore[attr-defined]
    stub.loads = json.loads  # type: ignore[attr-defined]
    stub.JSONDecodeError = json.JSONDecodeError  # type: ignore[attr-defined]
    stub.__getattr__ = flag  # type: ignore[method-assign]
    sys.modules["orjson"] = stub
    try:
        return importlib.import_module("vllm.entrypoints.anthropic.serving")
    finally:
        del sys.modules["orjson"]  # the stand-in served that import, and no other


_anthropic_serving = _import_anthropic_serving()

PNG = "iVBORw0KGgo="  # any base64: nothing is decoded here


def _parse(messages: list[Any]) -> list[Item]:
    tracker = _Tracker()
    for message in messages:
        _parse_chat_message_content(
            message, tracker, content_format="string", interleave_strings=False
        )
    return tracker.parser.items


def vllm_responses_items(body: dict[str, Any]) -> list[Item] | None:
    """The media items vLLM reads from a Responses body; None when it refuses it."""
    try:
        request = _responses.ResponsesRequest.model_validate(copy.deepcopy(body))
        messages = _responses_utils.construct_input_messages(
            request_instructions=request.instructions, request_input=request.input
        )
        return _parse(messages)
    except Exception:  # any refusal of vLLM's (its 400s), whatever the class
        return None


def vllm_messages_items(body: dict[str, Any]) -> list[Item] | None:
    """The media items vLLM reads from an Anthropic Messages body; None when refused."""
    try:
        request = _anthropic.AnthropicMessagesRequest.model_validate(copy.deepcopy(body))
        chat = _anthropic_serving.AnthropicServingMessages.to_chat_completion_request(request)
        return _parse(chat.messages)
    except Exception:
        return None


def router_items(reader: Any, body: dict[str, Any], trust_ids: bool = False) -> list[Item] | None:
    try:
        read = reader(body, trust_ids)
    except PartRefused:
        return None
    return [("image", p["image_url"]["url"], p.get("uuid")) for p in read.parts]


def responses(*items: Any) -> dict[str, Any]:
    return {"model": "m", "input": list(items)}


def user(*parts: Any, role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": [*parts, {"type": "input_text", "text": "what is it?"}]}


def image(url: str = IMG, **more: Any) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, **more}


# Every Responses shape vLLM accepts, with media in each place it reads them.
RESPONSES_ACCEPTED = {
    "string input": {"model": "m", "input": "hi"},
    "instructions": {**responses(user(image())), "instructions": "be brief"},
    "input_image": responses(user(image())),
    "detail low": responses(user(image(detail="low"))),
    "detail auto": responses(user(image(detail="auto"))),
    "uuid": responses(user(image(uuid="U"))),
    "uuid null": responses(user(image(uuid=None))),
    "data url": responses(user(image("data:image/png;base64," + PNG))),
    "typed message": responses({"type": "message", **user(image())}),
    "two images, two messages": responses(user(image()), user(image(IMG2))),
    "system message": responses(user(image(), role="system")),
    "developer message": responses(user(image(), role="developer")),
    "text only": responses(user()),
    "string content": responses({"role": "user", "content": "hi"}),
    "assistant text": responses({"role": "assistant", "content": "ok"}, user(image())),
    "output message": responses(
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "t", "annotations": []}],
        },
        user(image()),
    ),
    "function call and output": responses(
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "42"},
    ),
    "function output with an image": responses(
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [image(detail="high")]},
    ),
    "reasoning": responses(
        {
            "type": "reasoning",
            "id": "r",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hmm"}],
        },
        user(image()),
    ),
}
RESPONSES_REFUSED_BY_BOTH = {
    "input not a list": {"model": "m", "input": 3},
    "item a number": responses(7),
    "unknown item type": responses({"type": "frob"}),
    "chat image part": responses(user({"type": "image_url", "image_url": {"url": IMG}})),
    "type-less image part": responses(user({"image_url": IMG})),
    "video part": responses(user({"type": "video_url", "video_url": {"url": IMG}})),
    "input_audio part": responses(
        user({"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}})
    ),
    "function output image without detail": responses(
        {"type": "function_call_output", "call_id": "c", "output": [image()]}
    ),
    "input_file": responses(user({"type": "input_file", "file_data": "x", "filename": "a"})),
    "computer screenshot": responses(
        {
            "type": "computer_call_output",
            "call_id": "c",
            "output": {"type": "computer_screenshot", "image_url": IMG},
        }
    ),
}
# vLLM accepts these; the pool refuses them on purpose.
RESPONSES_REFUSED_BY_THE_POOL = {
    # vLLM reads the image when it comes first and drops it after text: by position.
    "assistant image first": responses({"role": "assistant", "content": [image()]}),
    "assistant image after text": responses(
        {"role": "assistant", "content": [{"type": "input_text", "text": "t"}, image()]}
    ),
    "two kinds of media": responses(user(image(video_url=IMG2))),
    # vLLM's parser takes it as an image of no URL, which fails only when fetched.
    "input_image without url": responses(user({"type": "input_image", "file_id": "f"})),
}


@pytest.mark.parametrize("name", sorted(RESPONSES_ACCEPTED))
@pytest.mark.parametrize("trust", [False, True], ids=["uuids-dropped", "uuids-kept"])
def test_responses_read_as_vllm_reads_them(name: str, trust: bool) -> None:
    body = RESPONSES_ACCEPTED[name]
    theirs = vllm_responses_items(body)
    assert theirs is not None, f"vLLM refuses {name}"
    sent = copy.deepcopy(body)
    ours = router_items(read_input_media, sent, trust)
    if trust:
        assert ours == theirs
    else:
        assert ours == [(m, url, None) for m, url, _ in theirs]
    if name == "function output with an image" or name.startswith("output message"):
        assert theirs, "media in this place are read by vLLM"
    # What the consumer gets: the body as rewritten, read by vLLM as the same items.
    assert vllm_responses_items(sent) == ours


@pytest.mark.parametrize("name", sorted(RESPONSES_REFUSED_BY_BOTH))
def test_responses_refused_by_both(name: str) -> None:
    body = RESPONSES_REFUSED_BY_BOTH[name]
    assert vllm_responses_items(body) is None
    assert router_items(read_input_media, copy.deepcopy(body)) is None


@pytest.mark.parametrize("name", sorted(RESPONSES_REFUSED_BY_THE_POOL))
def test_responses_refused_by_the_pool(name: str) -> None:
    body = RESPONSES_REFUSED_BY_THE_POOL[name]
    assert vllm_responses_items(body) is not None
    with pytest.raises(PartRefused, match=r"input\[0\]"):
        read_input_media(copy.deepcopy(body), False)


def test_vllm_reads_assistant_images_by_position_and_release() -> None:
    """Why assistant images are refused: vLLM 0.32 and 0.33 read one that comes first
    and drop one after text; 0.34 drops both. No rule the pool could follow for all."""
    first = vllm_responses_items(RESPONSES_REFUSED_BY_THE_POOL["assistant image first"])
    after = vllm_responses_items(RESPONSES_REFUSED_BY_THE_POOL["assistant image after text"])
    assert first in ([("image", IMG, None)], [])
    assert after == []


def test_unsupported_features_as_vllm_answers_them() -> None:
    missing = unsupported({"input": "hi", "previous_response_id": "resp_1"})
    assert missing is not None
    assert (missing.status, missing.param) == (404, "response_id")
    assert str(missing) == "Response with id 'resp_1' not found."
    background = unsupported({"input": "hi", "background": True})
    assert background is not None
    assert (background.status, background.param) == (400, "background")
    assert "VLLM_ENABLE_RESPONSES_API_STORE" in str(background)
    no_store = unsupported({"input": "hi", "background": True, "store": False})
    assert no_store is not None
    assert "store" in str(no_store)
    # vLLM's own request model refuses background without the store, with that message.
    with pytest.raises(Exception, match="background can only be used when `store` is true"):
        _responses.ResponsesRequest.model_validate(
            {"model": "m", "input": "hi", "background": True, "store": False}
        )
    assert unsupported({"input": "hi", "store": True, "background": False}) is None


# --- Anthropic Messages -------------------------------------------------------------------


def messages(*items: Any, **more: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": list(items), **more}


def said(*blocks: Any, role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": [*blocks, {"type": "text", "text": "what is it?"}]}


def b64(data: str = PNG, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def url_image(url: str = IMG) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "url", "url": url}}


def tool_result(*content: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": "t", "content": list(content)}


MESSAGES_ACCEPTED = {
    "string content": messages({"role": "user", "content": "hi"}),
    "base64 image": messages(said(b64())),
    "base64 jpeg": messages(said(b64(media_type="image/jpeg"))),
    "url image": messages(said(url_image())),
    "two images": messages(said(b64(), url_image(IMG2))),
    "assistant image": messages(said(url_image(), role="assistant"), said()),
    "system text": messages(said(b64()), system="be brief"),
    "system blocks": messages(said(b64()), system=[{"type": "text", "text": "be brief"}]),
    "tool result images before the message's own": messages(
        said(url_image(IMG2), tool_result({"type": "text", "text": "r"}, url_image(IMG)))
    ),
    "tool result as text": messages(said(tool_result({"type": "text", "text": "r"}))),
    "tool result string": messages(said({**tool_result(), "content": "r"})),
    "tool use and thinking": messages(
        said(
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "tool_use", "id": "t", "name": "f", "input": {}},
            role="assistant",
        ),
        said(tool_result({"type": "text", "text": "r"}), b64()),
    ),
}
MESSAGES_REFUSED_BY_BOTH = {
    "messages not a list": {"model": "m", "max_tokens": 8, "messages": 3},
    "unknown block type": messages(said({"type": "picture", "source": {}})),
    "block a number": messages({"role": "user", "content": [7]}),
    "tool result item a number": messages(said(tool_result(7))),
}
MESSAGES_REFUSED_BY_THE_POOL = {
    # vLLM makes "data:image/jpeg;base64," of these, or skips an empty source: nothing to read.
    "source without type": messages(said({"type": "image", "source": {"data": PNG}})),
    "empty source": messages(said({"type": "image", "source": {}})),
    "url source without url": messages(said({"type": "image", "source": {"type": "url"}})),
    "base64 without data": messages(said({"type": "image", "source": {"type": "base64"}})),
    # vLLM reads these as text (system) or str() of the blocks (an assistant's tool result).
    "system image": messages(said(), system=[b64()]),
    "system message image": messages(said(b64(), role="system"), said()),
    "assistant tool result image": messages(said(tool_result(b64()), role="assistant")),
    "tool result document": messages(said(tool_result({"type": "document", "source": {}}))),
}


@pytest.mark.parametrize("name", sorted(MESSAGES_ACCEPTED))
def test_messages_read_as_vllm_reads_them(name: str) -> None:
    body = MESSAGES_ACCEPTED[name]
    theirs = vllm_messages_items(body)
    assert theirs is not None, f"vLLM refuses {name}"
    sent = copy.deepcopy(body)
    assert router_items(read_blocks_media, sent) == theirs
    assert sent == body  # sent on unchanged


@pytest.mark.parametrize("name", sorted(MESSAGES_REFUSED_BY_BOTH))
def test_messages_refused_by_both(name: str) -> None:
    body = MESSAGES_REFUSED_BY_BOTH[name]
    assert vllm_messages_items(body) is None
    assert router_items(read_blocks_media, copy.deepcopy(body)) is None


@pytest.mark.parametrize("name", sorted(MESSAGES_REFUSED_BY_THE_POOL))
def test_messages_refused_by_the_pool(name: str) -> None:
    body = MESSAGES_REFUSED_BY_THE_POOL[name]
    assert vllm_messages_items(body) is not None
    with pytest.raises(PartRefused, match=r"messages\[0\]|system"):
        read_blocks_media(copy.deepcopy(body), False)


# --- generated shapes -------------------------------------------------------------------


def _random_responses_part(rng: random.Random) -> Any:
    kind = rng.choice(["input_image", "input_text", "image_url", None, "input_file", 3])
    part: dict[str, Any] = {} if kind is None else {"type": kind}
    for key, values in (
        ("image_url", [IMG, "", None, {"url": IMG}, 5, "data:image/png;base64," + PNG]),
        ("text", ["t", None]),
        ("detail", ["auto", "low", "huge", None]),
        ("uuid", ["U", None, 4]),
        ("file_id", ["f"]),
        ("video_url", [IMG2]),
    ):
        if rng.random() < 0.35:
            part[key] = rng.choice(values)
    return part if rng.random() > 0.03 else rng.choice(["str", 1, None])


def _random_responses_item(rng: random.Random) -> Any:
    shape = rng.choice(["message", "typed", "output", "call", "other"])
    parts = [_random_responses_part(rng) for _ in range(rng.randint(0, 3))]
    role = rng.choice(["user", "user", "system", "developer", "assistant", "tool"])
    if shape == "message":
        return {"role": role, "content": parts if rng.random() < 0.9 else "text"}
    if shape == "typed":
        return {"type": "message", "role": role, "content": parts}
    if shape == "output":
        return {"type": "function_call_output", "call_id": "c", "output": parts}
    if shape == "call":
        return {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    return {"type": rng.choice(["frob", "item_reference", None]), "id": "x"}


def test_generated_responses_bodies_agree() -> None:
    """600 generated bodies: where the router accepts, vLLM reads the same items from
    the client's body and from the one sent on; where it refuses, vLLM refuses too or
    the router names a reason of the pool's (assistant images, another API's media)."""
    rng = random.Random(20261207)  # noqa: S311 - a fixed corpus, not a secret
    outcomes = {"agree": 0, "both refuse": 0, "pool refuses": 0}
    for _ in range(600):
        body = responses(*(_random_responses_item(rng) for _ in range(rng.randint(1, 3))))
        theirs = vllm_responses_items(body)
        sent = copy.deepcopy(body)
        try:
            read = read_input_media(sent, True)
        except PartRefused as e:
            if theirs is None:
                outcomes["both refuse"] += 1
            else:
                reasons = (
                    "assistant",
                    "more than one kind",
                    "are an 'input_image'",
                    "no media URL",
                )
                assert any(r in str(e) for r in reasons), (body, e)  # noqa: PT017
                outcomes["pool refuses"] += 1
            continue
        ours = [("image", p["image_url"]["url"], p.get("uuid")) for p in read.parts]
        if theirs is None:  # a shape vLLM's model refuses: what is sent on is refused too
            assert vllm_responses_items(sent) is None, json.dumps(body)
            outcomes["both refuse"] += 1
            continue
        assert ours == theirs, json.dumps(body)
        assert vllm_responses_items(sent) == ours, json.dumps(body)
        outcomes["agree"] += 1
    assert all(outcomes.values()), outcomes


def _random_block(rng: random.Random) -> Any:
    kind = rng.choice(["image", "text", "tool_result", "thinking", "picture"])
    block: dict[str, Any] = {"type": kind}
    if kind == "text":
        block["text"] = "t"
    if kind == "thinking":
        block.update(thinking="hmm", signature="s")
    if kind in ("image", "picture") or rng.random() < 0.1:
        source: dict[str, Any] = {}
        for key, values in (
            ("type", ["base64", "url", "file", None]),
            ("data", [PNG, "", 3]),
            ("media_type", ["image/png", 1]),
            ("url", [IMG, "", None]),
        ):
            if rng.random() < 0.6:
                source[key] = rng.choice(values)
        block["source"] = source
    if kind == "tool_result":
        block["tool_use_id"] = "t"
        block["content"] = [_random_block(rng) for _ in range(rng.randint(0, 2))]
    return block


def test_generated_messages_bodies_agree() -> None:
    """600 generated bodies: accepted ones read as vLLM reads them, sent on unchanged;
    refused ones refused by vLLM too, or for a reason the router names."""
    rng = random.Random(7)  # noqa: S311 - a fixed corpus, not a secret
    outcomes = {"agree": 0, "both refuse": 0, "pool refuses": 0}
    for _ in range(600):
        items = []
        for _ in range(rng.randint(1, 3)):
            role = rng.choice(["user", "user", "assistant", "system"])
            blocks = [_random_block(rng) for _ in range(rng.randint(0, 3))]
            items.append({"role": role, "content": blocks})
        body = messages(*items)
        theirs = vllm_messages_items(body)
        try:
            ours = router_items(read_blocks_media, body)
        except Exception as e:
            raise AssertionError(json.dumps(body)) from e
        if ours is None:
            outcomes["both refuse" if theirs is None else "pool refuses"] += 1
            continue
        assert theirs is not None, json.dumps(
            body
        )  # the router never passes what vLLM refuses unread
        assert ours == theirs, json.dumps(body)
        outcomes["agree"] += 1
    assert all(outcomes.values()), outcomes

"""The router reads content parts as vLLM does: proven against vLLM's own code.

Each body goes through vLLM's request model (``ChatCompletionRequest``, what its
server validates a request with) and its chat parser (``_parse_chat_message_content``,
with a parser that records each media item instead of fetching it), and through the
router's ``read_media``. Where the router accepts a body, vLLM accepts it too and
reads the same items (modality, URL or inline data, in order); vLLM reads the body
the router sends on (canonical parts) as the same items, with no client uuid unless
the pool trusts them. Where the router refuses, the case says why: vLLM refuses it as
well, or the pool refuses that form on purpose (embeddings, a uuid alone, two kinds
of media in one part).
"""

from __future__ import annotations

import copy
import importlib
import json
import random
from collections.abc import Callable
from typing import Any

import pytest
import vllm.entrypoints.openai.chat_completion.protocol as protocol

from encoderpool_router.content import MEDIA_TYPES, PartRefused, read_media


def _vllm_chat_parser() -> tuple[Callable[..., Any], type, Any]:
    """vLLM's chat parser (parse one message; the parser base class; vLLM's own parser),
    wherever the release keeps it: the module ``vllm/renderers/chat_utils.py`` (0.32), or
    the package ``vllm/renderers/chat_utils/`` (0.33 on). In neither place the module
    fails to load, naming both: a supported vLLM without it is a failure, never a skip."""
    places = (
        ("vllm.renderers.chat_utils", "_parse_chat_message_content", "vllm.renderers.chat_utils"),
        (
            "vllm.renderers.chat_utils.chat_message",
            "parse_chat_message_content",
            "vllm.renderers.chat_utils.content_parser",
        ),
    )
    for message_module, parse_name, parser_module in places:
        try:
            parse = getattr(importlib.import_module(message_module), parse_name)
            parsers = importlib.import_module(parser_module)
            return parse, parsers.BaseMultiModalContentParser, parsers.MultiModalContentParser
        except (ImportError, AttributeError):
            continue
    tried = "; ".join(f"{m}.{p} with {c}.BaseMultiModalContentParser" for m, p, c in places)
    raise ImportError(f"vLLM's chat parser is in none of the places known: {tried}")


_parse_chat_message_content, _BaseParser, _VllmParser = _vllm_chat_parser()

Item = tuple[str, str | None, str | None]  # modality, URL (inline audio as vLLM's data URL), uuid

IMG, IMG2, VID, AUD = (
    "http://media.example/a.png",
    "http://media.example/b.png",
    ("http://media.example/v.mp4"),
    "http://media.example/s.wav",
)


class _Recorder(_BaseParser):  # type: ignore[misc,valid-type]
    """vLLM's parser interface, recording what vLLM hands it instead of fetching."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[Item] = []

    @property
    def model_config(self) -> Any:
        class _Config:
            enable_prompt_embeds = False

        return _Config()

    def parse_image(self, image_url: str | None, uuid: str | None = None) -> None:
        self.items.append(("image", image_url, uuid))

    def parse_image_pil(self, image_pil: Any, uuid: str | None = None) -> None:
        self.items.append(("image_pil", None, uuid))

    def parse_image_embeds(self, image_embeds: Any, uuid: str | None = None) -> None:
        self.items.append(("image_embeds", None, uuid))

    def parse_audio(self, audio_url: str | None, uuid: str | None = None) -> None:
        self.items.append(("audio", audio_url, uuid))

    def parse_input_audio(self, input_audio: Any, uuid: str | None = None) -> None:
        # vLLM's own conversion of inline audio into a data URL, then parse_audio.
        _VllmParser.parse_input_audio(self, input_audio, uuid)

    def parse_audio_embeds(self, audio_embeds: Any, uuid: str | None = None) -> None:
        self.items.append(("audio_embeds", None, uuid))

    def parse_prompt_embeds(self, data: str) -> None:
        self.items.append(("prompt_embeds", None, None))

    def parse_video(self, video_url: str | None, uuid: str | None = None) -> None:
        self.items.append(("video", video_url, uuid))

    def parse_video_embeds(self, video_embeds: Any, uuid: str | None = None) -> None:
        self.items.append(("video_embeds", None, uuid))


class _Tracker:
    def __init__(self) -> None:
        self.parser = _Recorder()

    def create_parser(self, mm_processor_kwargs: Any = None) -> _Recorder:
        return self.parser


def vllm_items(body: dict[str, Any]) -> list[Item] | None:
    """The media items vLLM reads from ``body``; None when it refuses the request."""
    try:
        request = protocol.ChatCompletionRequest.model_validate(copy.deepcopy(body))
        tracker = _Tracker()
        for message in request.messages:
            _parse_chat_message_content(
                message, tracker, content_format="string", interleave_strings=False
            )
    except Exception:  # any refusal of vLLM's (its 400s), whatever the class
        return None
    return tracker.parser.items


def router_items(body: dict[str, Any], trust_ids: bool = False) -> list[Item] | None:
    """The media items the router reads (canonical parts as items); None when refused."""
    try:
        read = read_media(body, trust_ids)
    except PartRefused:
        return None
    out: list[Item] = []
    for part in read.parts:
        kind = str(part["type"])
        if kind == "input_audio":
            audio = part["input_audio"]
            url = f"data:audio/{audio['format']};base64,{audio['data']}"
        else:
            url = part[kind]["url"]
        out.append((MEDIA_TYPES[kind], url, part.get("uuid")))
    return out


def chat(*parts: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, "what is this?"]}]}


# Forms vLLM accepts: the router reads each as vLLM does.
ACCEPTED = {
    "image typed": {"type": "image_url", "image_url": {"url": IMG}},
    "image typed, detail": {"type": "image_url", "image_url": {"url": IMG, "detail": "low"}},
    "image typed, uuid": {"type": "image_url", "image_url": {"url": IMG}, "uuid": "U"},
    "image no type": {"image_url": IMG},
    "image no type, uuid": {"image_url": IMG, "uuid": "U"},
    "image no type, object url, uuid": {"image_url": {"url": IMG}, "uuid": "U"},
    "input_image": {"type": "input_image", "image_url": IMG, "detail": "auto"},
    "input_image, uuid": {"type": "input_image", "image_url": IMG, "detail": "auto", "uuid": "U"},
    "text type, uuid, image key": {"type": "image_url", "uuid": "U", "image_url": IMG},
    "video typed": {"type": "video_url", "video_url": {"url": VID}},
    "video typed, uuid": {"type": "video_url", "video_url": {"url": VID}, "uuid": "U"},
    "video no type": {"video_url": VID},
    "video no type, uuid": {"video_url": VID, "uuid": "U"},
    "audio typed": {"type": "audio_url", "audio_url": {"url": AUD}},
    "audio typed, uuid": {"type": "audio_url", "audio_url": {"url": AUD}, "uuid": "U"},
    "audio no type": {"audio_url": AUD},
    "input_audio typed": {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
    "input_audio typed, uuid": {
        "type": "input_audio",
        "input_audio": {"data": "UklG", "format": "wav"},
        "uuid": "U",
    },
    "data url": {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
    "uuid null": {"type": "image_url", "image_url": {"url": IMG}, "uuid": None},
}
# Refused by both: vLLM refuses the request, the router the part.
REFUSED_BY_BOTH = {
    "unknown type": {"type": "picture", "picture": IMG},
    "type not a string": {"type": 3, "image_url": IMG},
    "no type, no media key": {"url": IMG},
    "text with a uuid": {"type": "text", "text": "hi", "uuid": "U"},
    "image typed, string url": {"type": "image_url", "image_url": IMG},
    "image typed, no url": {"type": "image_url", "image_url": {}},
    "a number": 7,
    "a list": [IMG],
}
# Accepted by vLLM, refused by the pool on purpose (each message says why).
REFUSED_BY_THE_POOL = {
    "uuid alone": {"image_url": None, "uuid": "U"},
    "two kinds of media": {"type": "video_url", "video_url": {"url": VID}, "image_url": IMG},
    "two kinds, uuid": {"video_url": VID, "image_url": IMG2, "uuid": "U"},
    "text holding media": {"type": "text", "text": "hi", "image_url": {"url": IMG}},
    "image embeddings": {"type": "image_embeds", "image_embeds": "AAAA"},
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
@pytest.mark.parametrize("trust_ids", [False, True], ids=["untrusted", "trusted"])
def test_every_form_vllm_accepts_is_read_as_vllm_reads_it(name: str, trust_ids: bool) -> None:
    body = chat(ACCEPTED[name], {"type": "text", "text": "and"})
    theirs = vllm_items(body)
    assert theirs is not None, f"vLLM refused {name}"
    sent = copy.deepcopy(body)
    ours = router_items(sent, trust_ids)
    assert ours is not None, f"the router refused {name}"
    want = [(m, url, uuid if trust_ids else None) for m, url, uuid in theirs]
    assert ours == want
    # What goes on is read by vLLM as exactly what the router checked.
    assert vllm_items(json.loads(json.dumps(sent))) == want


@pytest.mark.parametrize("name", sorted(REFUSED_BY_BOTH))
def test_what_vllm_refuses_the_router_refuses(name: str) -> None:
    body = chat(REFUSED_BY_BOTH[name])
    assert vllm_items(body) is None
    assert router_items(body) is None


@pytest.mark.parametrize("name", sorted(REFUSED_BY_THE_POOL))
def test_forms_the_pool_refuses_on_purpose_are_named(name: str) -> None:
    body = chat({"type": "text", "text": "look"}, REFUSED_BY_THE_POOL[name])
    with pytest.raises(PartRefused, match=r"messages\[0\]\.content\[1\]"):
        read_media(body, trust_ids=False)


def test_the_type_less_uuid_attack_is_read_as_an_image_and_loses_its_uuid() -> None:
    """Client B's type-less image with client A's uuid: vLLM would key it by the uuid
    (and answer about A's image); the router reads it as B's image and drops the uuid."""
    body = chat({"image_url": IMG2, "uuid": "shared-U"})
    assert vllm_items(body) == [("image", IMG2, "shared-U")]
    read = read_media(body, trust_ids=False)
    assert read.changed
    assert read.parts == [{"type": "image_url", "image_url": {"url": IMG2}}]
    assert body["messages"][0]["content"][0] is read.parts[0]


def test_canonical_parts_are_left_as_the_client_sent_them() -> None:
    part = {"type": "image_url", "image_url": {"url": IMG}}
    body = chat(part)
    read = read_media(body, trust_ids=False)
    assert not read.changed
    assert read.parts[0] is part


@pytest.mark.parametrize(
    "messages",
    [{"role": "user"}, [1], [{"role": "user", "content": {"type": "text"}}]],
    ids=["not-a-list", "message-not-an-object", "content-an-object"],
)
def test_malformed_messages_are_refused_by_both(messages: Any) -> None:
    body = {"model": "m", "messages": messages}
    assert vllm_items(body) is None
    with pytest.raises(PartRefused):
        read_media(body, trust_ids=False)


def test_every_role_s_parts_are_read() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "assistant", "content": [{"image_url": IMG, "uuid": "U"}]},
            {"role": "user", "content": [{"video_url": VID}]},
        ],
    }
    theirs = vllm_items(body)
    assert theirs == [("image", IMG, "U"), ("video", VID, None)]
    assert router_items(body) == [("image", IMG, None), ("video", VID, None)]


# Why the pool refuses a form vLLM takes (the messages of ``read_media``'s refusals).
_ON_PURPOSE = (
    "names no media URL",
    "more than one kind of media",
    "holding media",
    "are not accepted",
    "'uuid' must be a string",
    "'input_audio' must be an object",
)
_VALUES: dict[str, list[Any]] = {
    "type": [
        *sorted(MEDIA_TYPES),
        "text",
        "image_embeds",
        "tool_reference",
        "picture",
        3,
        None,
    ],
    "uuid": ["U", None, 5],
    "image_url": [IMG, {"url": IMG}, {"url": IMG, "detail": "auto"}, {}, None, 4],
    "video_url": [VID, {"url": VID}, None],
    "audio_url": [AUD, {"url": AUD}],
    "input_audio": [{"data": "UklG", "format": "wav"}, {"data": "UklG"}, "UklG"],
    "text": ["hi", 1],
    "detail": ["auto", "high"],
}


def _generated_parts(n: int) -> list[dict[str, Any]]:
    """``n`` parts made of the keys vLLM's parser looks at, each present or not, with
    well- and ill-formed values (a fixed seed: the same parts every run)."""
    rng = random.Random(20261204)  # noqa: S311 - a fixed corpus, not a secret
    parts = []
    for _ in range(n):
        part: dict[str, Any] = {}
        for key, values in _VALUES.items():
            if rng.random() < (0.8 if key == "type" else 0.35):
                part[key] = rng.choice(values)
        parts.append(part)
    return parts


@pytest.mark.parametrize("trust_ids", [False, True], ids=["untrusted", "trusted"])
def test_generated_parts_are_read_as_vllm_reads_them_or_refused_for_a_stated_reason(
    trust_ids: bool,
) -> None:
    """Where vLLM takes a part, the router reads the same item or refuses it for one of
    the pool's stated reasons. Where the router takes a part vLLM's request model
    refuses (its union of part shapes is stricter in places: an object URL needs a
    ``type``), the canonical part it sends on is one vLLM reads as the same item: a
    repaired spelling, never another reading. A text part vLLM refuses goes on as it
    came (it holds no media): vLLM refuses the request."""
    outcomes = {"agreed": 0, "refused": 0, "purposely": 0, "repaired": 0}
    for part in _generated_parts(800):
        body = chat(part)
        theirs = vllm_items(body)
        sent = copy.deepcopy(body)
        try:
            read_media(sent, trust_ids)
        except PartRefused as e:
            why = str(e)
        else:
            why = ""
        if why:
            if theirs is None:
                outcomes["refused"] += 1
            else:
                assert any(reason in why for reason in _ON_PURPOSE), (part, why)
                outcomes["purposely"] += 1
            continue
        ours = router_items(copy.deepcopy(body), trust_ids)
        onward = vllm_items(json.loads(json.dumps(sent)))
        # vLLM reads no item the router did not check (or refuses the request).
        assert onward is None or onward == ours, part
        if theirs is None:
            outcomes["refused" if onward is None else "repaired"] += 1
            continue
        assert ours == [(m, url, uuid if trust_ids else None) for m, url, uuid in theirs], part
        outcomes["agreed"] += 1
    # The corpus exercises every outcome (measured: about 60 agreed, 450 refused by
    # both, 270 refused on purpose, 20 repaired of 800, each way of trusting ids).
    assert outcomes["agreed"] > 30, outcomes
    assert outcomes["refused"] > 100, outcomes
    assert outcomes["purposely"] > 20, outcomes
    assert outcomes["repaired"] > 0, outcomes

"""The pool through the clients people use: the OpenAI and Anthropic Python SDKs against
the router over real vLLM (the package's shared producer and consumer), each call also
made against the monolithic server. Answers are the same tokens (chat, completions) or
the same text (Responses and Messages expose no token ids), errors the same SDK
exception classes; where a call carries an image, the producer encoded it and the
consumer did not.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from e2e.media import MODEL, anthropic_messages, data_url, image, responses_input
from e2e.vllm_server import post_json
from tests.router.fixtures import Epd, encoded_hashes

pytestmark = pytest.mark.vllm
PROMPT = "Describe this image."
MAX_TOKENS = 8
# This SDK's Messages methods take no temperature argument; vLLM reads it from the body.
GREEDY = {"temperature": 0}


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


def both(epd: Epd) -> tuple[str, str]:
    return epd.mono.url, epd.router.url


@pytest.fixture
def encodes(epd: Epd) -> Callable[[], tuple[int, int]]:
    """New encoder runs since the test began: (producer, consumer)."""
    before = encoded_hashes(epd.producer.log_text()), encoded_hashes(epd.consumer.log_text())

    def now() -> tuple[int, int]:
        produced = encoded_hashes(epd.producer.log_text()) - before[0]
        consumed = encoded_hashes(epd.consumer.log_text()) - before[1]
        return len(produced), len(consumed)

    return now


def chat_messages(png: bytes) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(png)}},
                {"type": "text", "text": PROMPT},
            ],
        }
    ]


def test_chat_and_streamed_chat(epd: Epd, encodes: Callable[[], tuple[int, int]]) -> None:
    answers = []
    for url in both(epd):
        client = oai(url)
        whole = client.chat.completions.create(
            model=MODEL, messages=chat_messages(image(1700)), temperature=0,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True},
        )  # fmt: skip
        ids: list[int] = []
        chunks: Any = client.chat.completions.create(
            model=MODEL, messages=chat_messages(image(1701)), temperature=0,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS, stream=True, extra_body={"return_token_ids": True},
        )  # fmt: skip
        for chunk in chunks:
            for choice in chunk.model_dump()["choices"]:
                ids += choice.get("token_ids") or []
        answers.append((whole.model_dump()["choices"][0]["token_ids"], ids))
    assert answers[0] == answers[1]
    assert all(answers[0])
    assert encodes() == (2, 0)


def test_completions_and_models(epd: Epd) -> None:
    answers = []
    for url in both(epd):
        client = oai(url)
        done = client.completions.create(
            model=MODEL, prompt="The sky is", temperature=0, max_tokens=MAX_TOKENS,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        models = [m.id for m in client.models.list()]
        answers.append((done.model_dump()["choices"][0]["token_ids"], models))
    assert answers[0] == answers[1]
    assert answers[0][1] == [MODEL]


def test_responses_with_an_image(epd: Epd, encodes: Callable[[], tuple[int, int]]) -> None:
    texts = []
    for url in both(epd):
        got = oai(url).responses.create(
            model=MODEL, input=responses_input(image(1710)),  # type: ignore[arg-type]
            temperature=0, max_output_tokens=MAX_TOKENS,
        )  # fmt: skip
        # incomplete: max_output_tokens; the tiny model's text may be empty (special tokens)
        assert got.usage is not None
        texts.append((got.status, got.output_text, got.usage.output_tokens))
    assert texts[0] == texts[1]
    assert texts[0][2] == MAX_TOKENS
    assert encodes() == (1, 0)
    assert (
        epd.router.metric("encoderpool_router_requests_total", endpoint="/v1/responses", code="200")
        >= 1
    )


def test_streamed_responses(epd: Epd, encodes: Callable[[], tuple[int, int]]) -> None:
    """The typed events arrive as vLLM sends them: the same types in the same order,
    the same text."""
    runs = []
    for url in both(epd):
        kinds, text = [], ""
        stream: Any = oai(url).responses.create(
            model=MODEL, input=responses_input(image(1711)),  # type: ignore[arg-type]
            temperature=0, max_output_tokens=MAX_TOKENS, stream=True,
        )  # fmt: skip
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += str(getattr(event, "delta", ""))
        runs.append((kinds, text))
    assert runs[0] == runs[1]
    assert runs[0][0][0] == "response.created"
    assert runs[0][0][-1] in ("response.completed", "response.incomplete")
    assert encodes() == (1, 0)


def test_errors_are_the_same_classes(epd: Epd) -> None:
    """An unknown model (vLLM's 404), a stored response (404: the pool keeps no store,
    as vLLM's default), background mode (400), an unreadable part (400)."""
    calls: list[Callable[[openai.OpenAI], Any]] = [
        lambda c: c.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ),
        lambda c: c.responses.create(model=MODEL, input="hi", previous_response_id="resp_x"),
        lambda c: c.responses.create(model=MODEL, input="hi", background=True),
        lambda c: c.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}],
        ),
    ]
    for call in calls:
        classes = []
        for url in both(epd):
            with pytest.raises(openai.APIStatusError) as raised:
                call(oai(url))
            classes.append((type(raised.value), raised.value.status_code))
        assert classes[0] == classes[1]


@pytest.mark.parametrize("source", ["base64", "url"])
def test_anthropic_messages_with_an_image(
    epd: Epd, encodes: Callable[[], tuple[int, int]], source: str
) -> None:
    index = 1720 if source == "base64" else 1722
    answers = []
    for url in both(epd):
        client = claude(url)
        whole = client.messages.create(
            model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY,
            messages=anthropic_messages(image(index), source),  # type: ignore[arg-type]
        )  # fmt: skip
        with client.messages.stream(
            model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY,
            messages=anthropic_messages(image(index + 1), source),  # type: ignore[arg-type]
        ) as stream:  # fmt: skip
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        counted = client.messages.count_tokens(
            model=MODEL,
            messages=anthropic_messages(image(index), source),  # type: ignore[arg-type]
        )
        text = "".join(b.text for b in whole.content if b.type == "text")
        tokens = (whole.usage.output_tokens, final.usage.output_tokens)
        answers.append((text, streamed, tokens, counted.input_tokens))
    assert answers[0] == answers[1]
    # The tiny model's text may be empty, and some images end it early: tokens were made.
    assert all(0 < n <= MAX_TOKENS for n in answers[0][2])
    assert answers[0][3] > 16  # the image's tokens are counted
    assert encodes() == (2, 0)  # count_tokens runs no encoder, here or there
    with pytest.raises(anthropic.NotFoundError):
        claude(epd.router.url).messages.create(
            model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_detokenize_version_and_other_paths(epd: Epd) -> None:
    """Image tokens counted as vLLM counts them; anything else a 404 naming what is served."""
    chat = {"model": MODEL, "messages": chat_messages(image(1730))}
    mono, pool = (post_json(u + "/tokenize", chat) for u in both(epd))
    assert pool == mono
    assert mono["count"] > 16  # the image's tokens are in
    back = [post_json(u + "/detokenize", {"model": MODEL, "tokens": mono["tokens"][:8]})
            for u in both(epd)]  # fmt: skip
    assert back[0] == back[1]
    assert _get(epd.router.url + "/version") == _get(epd.mono.url + "/version")
    status, body = _get(epd.router.url + "/v1/embeddings")
    assert status == 404
    assert "POST /v1/responses" in body["error"]["message"]
    assert epd.router.metric("encoderpool_router_requests_total", endpoint="other", code="404") >= 1

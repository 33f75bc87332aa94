"""The real engine on this machine: the tiny model serves images, greedily and repeatably,
and vLLM's built-in example EC connector reproduces a monolithic server (our baseline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.media import chat_request, encoder_request, image, media_parts, token_ids
from e2e.vllm_server import VllmServer, running
from tests.conftest import ServerFactory

pytestmark = pytest.mark.vllm


def test_monolithic_is_repeatable_across_requests_and_restarts(
    monolithic: VllmServer, vllm_server: ServerFactory
) -> None:
    """What lets tests share one monolithic server: its answer to a request depends on
    nothing it served before (the session's server has served other tests by now), and
    a fresh server of the same configuration gives the same answer."""
    body = chat_request(image(1))
    first = monolithic.chat(body)
    second = monolithic.chat(body)
    other = monolithic.chat(chat_request(image(2)))
    assert first["choices"][0]["message"]["content"] is not None
    assert first["usage"]["prompt_tokens"] > 16  # 16 image tokens plus the text
    assert len(token_ids(first)) == 8
    assert token_ids(first) == token_ids(second)
    assert token_ids(other) != token_ids(first)  # the image really matters

    fresh = vllm_server("mono-restarted", args=list(monolithic.args), start=False)
    with running(fresh) as (again,):
        assert token_ids(again.chat(body)) == token_ids(first)


def test_example_connector_epd_matches_monolithic(
    monolithic: VllmServer, vllm_server: ServerFactory, tmp_path: Path
) -> None:
    store = {"shared_storage_path": str(tmp_path / "ec")}
    images = [image(i) for i in range(10, 14)]
    producer = vllm_server("producer", ec=("ECExampleConnector", "ec_producer", store), start=False)
    consumer = vllm_server("consumer", ec=("ECExampleConnector", "ec_consumer", store), start=False)
    with running(producer, consumer):
        for png in images:
            body = chat_request(png)
            expected = token_ids(monolithic.chat(body))
            (part,) = media_parts(body)
            encoded = producer.chat(encoder_request(part))
            assert encoded["usage"]["completion_tokens"] == 0
            assert encoded.get("ec_transfer_params"), encoded
            assert token_ids(consumer.chat(body)) == expected
    saved = list((tmp_path / "ec").glob("*/encoder_cache.safetensors"))
    assert len(saved) == len(images)

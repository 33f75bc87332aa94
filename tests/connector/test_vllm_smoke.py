"""The real engine on this machine: the tiny model serves images, greedily and repeatably.

vLLM's own ECExampleConnector is not run as a server pair here (two engine starts, ~90 s
of CI): the width Job runs it as a producer (tests/connector/test_measure.py), and
benchmarks/connector_throughput.py times its save and load beside ours."""

from __future__ import annotations

import pytest

from e2e.media import chat_request, image, token_ids
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

"""The Responses API, Anthropic's Messages API and vLLM's utility paths through the router,
against fake backends: what producers and consumers get, what is refused before anything
goes upstream (and in which shape), streams' endings, the 404 of paths not served, and
the requests counted by endpoint."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import pytest

from e2e.media import data_url, image
from tests.router.fixtures import FakeBackend, fake_mm_hash, fakes, router_at, run
from tests.router.test_proxy import post, sample

IMAGE = {"type": "image_url", "image_url": {"url": data_url(image(1))}}


def responses_body(**part: Any) -> dict[str, Any]:
    image_part = {"type": "input_image", "image_url": data_url(image(1)), **part}
    return {
        "model": "m",
        "input": [{"role": "user", "content": [image_part, {"type": "input_text", "text": "?"}]}],
    }


@pytest.mark.parametrize("uuid", [None, "client-id"])
def test_a_responses_image_goes_to_a_producer_and_params_to_the_consumer(
    uuid: str | None,
) -> None:
    body = responses_body(**({"uuid": uuid} if uuid else {}))

    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (router, url):
            status, out, _ = await post(url + "/v1/responses", body)
        assert status == 200, out
        (encode,) = p.seen
        assert encode.path == "/v1/chat/completions"
        assert encode.body is not None
        assert encode.body["messages"][0]["content"] == [IMAGE]
        (seen,) = c.seen
        assert seen.path == "/v1/responses"
        assert seen.body is not None
        assert seen.body["ec_transfer_params"] == {fake_mm_hash(IMAGE): {"by": "producer"}}
        sent = seen.body["input"][0]["content"][0]
        assert sent == {"type": "input_image", "image_url": data_url(image(1))}  # no uuid
        assert sample(router, "encoderpool_router_media_items_total", encoded="remote") == 1
        labels = {"endpoint": "/v1/responses", "code": "200"}
        assert sample(router, "encoderpool_router_requests_total", **labels) == 1

    run(scenario())


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"previous_response_id": "resp_1"}, 404, "response_id"),
        ({"background": True}, 400, "background"),
        ({"background": True, "store": False}, 400, "background"),
    ],
)
def test_what_vllm_cannot_serve_in_a_pool_is_refused_as_vllm_refuses_it(
    extra: dict[str, Any], status: int, param: str
) -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (_, url):
            got, out, _ = await post(url + "/v1/responses", {**responses_body(), **extra})
        assert (got, out["error"]["param"], out["error"]["type"]) == (
            status, param, "invalid_request_error",
        )  # fmt: skip
        assert p.seen == []
        assert c.seen == []

    run(scenario())


def test_an_unreadable_responses_item_is_a_400_naming_it() -> None:
    body = {"model": "m", "input": ["hi", {"type": "computer_call_output", "output": {}}]}

    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at([], [curl]) as (_, url):
            status, out, _ = await post(url + "/v1/responses", body)
        assert status == 400
        assert out["error"]["message"].startswith("input[0] must be an object")
        assert c.seen == []

    run(scenario())


def anthropic_body(source: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    blocks = [{"type": "image", "source": source}, {"type": "text", "text": "?"}]
    return {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": blocks}],
        "stream": stream,
    }


def test_an_anthropic_image_goes_to_a_producer_and_the_body_on_unchanged() -> None:
    data = base64.b64encode(image(1)).decode()
    body = anthropic_body({"type": "base64", "media_type": "image/png", "data": data})

    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (_, url):
            status, out, _ = await post(url + "/v1/messages", body)
        assert status == 200, out
        (encode,) = p.seen
        assert encode.body is not None
        assert encode.body["messages"][0]["content"] == [IMAGE]
        (seen,) = c.seen
        assert seen.path == "/v1/messages"
        assert seen.body is not None
        assert seen.body.pop("ec_transfer_params") == {fake_mm_hash(IMAGE): {"by": "producer"}}
        assert seen.body == body

    run(scenario())


def test_anthropic_refusals_are_in_anthropic_s_shape() -> None:
    body = anthropic_body({"type": "file", "file_id": "f"})

    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at([], [curl]) as (_, url):
            status, out, _ = await post(url + "/v1/messages", body)
        assert status == 400
        assert out["type"] == "error"
        assert out["error"]["type"] == "invalid_request_error"
        assert "messages[0].content[0].source" in out["error"]["message"]
        assert c.seen == []

    run(scenario())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages/count_tokens", anthropic_body({"type": "url", "url": data_url(image(2))})),
        ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": [IMAGE]}]}),
    ],
)
def test_counting_tokens_reads_media_but_encodes_nothing(path: str, body: dict[str, Any]) -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (_, url):
            status, _, _ = await post(url + path, body)
            refused, _, _ = await post(url + path, {**body, "messages": [{"content": [7]}]})
        assert status == 200
        assert refused == 400
        assert p.seen == []
        assert [s.path for s in c.seen] == [path]

    run(scenario())


def test_detokenize_and_version_go_to_a_consumer() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at([], [curl]) as (_, url):
            status, _, _ = await post(url + "/detokenize", {"model": "m", "tokens": [1]})
            async with aiohttp.ClientSession() as s, s.get(url + "/version") as r:
                version = r.status
        assert (status, version) == (200, 200)
        assert [s.path for s in c.seen] == ["/detokenize", "/version"]

    run(scenario())


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_broken_stream_ends_with_the_api_s_own_error_event(path: str) -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer", mode="stream_break")
        async with (
            fakes(c) as (curl,),
            router_at([], [curl]) as (_, url),
            aiohttp.ClientSession() as s,
            s.post(url + path, json={"model": "m", "stream": True}) as r,
        ):
            text = (await r.read()).decode()
        assert text.endswith("\n\n")
        last = text.strip().split("\n\n")[-1]
        assert last.startswith("event: error\ndata: ")
        assert "[DONE]" not in text

    run(scenario())


def test_other_paths_are_a_404_naming_what_the_pool_serves() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with (
            fakes(c) as (curl,),
            router_at([], [curl]) as (router, url),
            aiohttp.ClientSession() as s,
        ):
            async with s.post(url + "/v1/embeddings", json={}) as r:
                missing = (r.status, await r.json())
            async with s.get(url + "/v1/responses/resp_1") as r:
                stored = r.status
            async with s.get(url + "/v1/responses") as r:
                method = (r.status, r.headers.get("Allow"))
        assert missing[0] == 404
        message = missing[1]["error"]["message"]
        for served in ("POST /v1/responses", "POST /v1/messages", "POST /tokenize", "GET /version"):
            assert served in message
        assert stored == 404
        assert method == (405, "POST")
        assert c.seen == []
        labels = {"endpoint": "other", "code": "404"}
        assert sample(router, "encoderpool_router_requests_total", **labels) == 2

    run(scenario())


def test_no_consumer_on_the_messages_path_is_a_503_in_anthropic_s_shape() -> None:
    async def scenario() -> None:
        async with router_at([], ["http://127.0.0.1:9"]) as (router, url):
            router.consumers.replace([])
            status, out, _ = await post(url + "/v1/messages", anthropic_body({}) | {"messages": []})
        assert status == 503
        assert out == {
            "type": "error",
            "error": {"type": "service_unavailable", "message": "no consumer is available"},
        }

    run(scenario())

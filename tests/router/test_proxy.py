"""The router's HTTP behaviour against in-process fake producers and consumers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from e2e.media import chat_request, data_url, image, media_parts
from encoderpool_router.app import Router, build_metrics_app
from tests.router.fixtures import FakeBackend, fake_mm_hash, fakes, router_at, run, serve
from tests.waiting import async_wait_until


async def post(
    url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return (
            r.status,
            await r.json(content_type=None),
            {k.lower(): v for k, v in r.headers.items()},
        )


def sample(router: Router, name: str, **labels: str) -> float:
    value = router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_each_item_goes_alone_to_a_producer_and_params_reach_the_consumer() -> None:
    body = chat_request(image(1), image(2))
    parts = media_parts(body)

    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (router, url):
            status, out, headers = await post(
                url + "/v1/chat/completions", body, {"x-request-id": "trace-7"}
            )
        assert status == 200, out
        assert headers["x-request-id"] == "trace-7"
        assert len(p.seen) == 2
        sent = sorted((s.body for s in p.seen), key=lambda b: json.dumps(b))
        for part in parts:
            assert {
                "model": body["model"],
                "messages": [{"role": "user", "content": [part]}],
                "max_tokens": 1,
                "stream": False,
            } in sent
        assert {s.headers["x-request-id"] for s in p.seen} == {"trace-7-enc0", "trace-7-enc1"}
        (seen,) = c.seen
        assert seen.headers["x-request-id"] == "trace-7"
        assert seen.body is not None
        assert seen.body["ec_transfer_params"] == {
            fake_mm_hash(part): {"by": "producer"} for part in parts
        }
        assert {k: v for k, v in seen.body.items() if k != "ec_transfer_params"} == body
        assert sample(router, "encoderpool_router_media_items_total", encoded="remote") == 2
        assert sample(router, "encoderpool_router_producer_latency_seconds_count") == 2
        assert (
            sample(
                router,
                "encoderpool_router_requests_total",
                endpoint="/v1/chat/completions",
                code="200",
            )
            == 1
        )

    run(scenario())


def test_text_only_requests_and_completions_skip_producers() -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (_, url):
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            assert (await post(url + "/v1/chat/completions", chat))[0] == 200
            assert (await post(url + "/v1/completions", {"model": "m", "prompt": "hi"}))[0] == 200
        assert p.seen == []
        assert [s.path for s in c.seen] == ["/v1/chat/completions", "/v1/completions"]
        assert c.seen[0].body == chat

    run(scenario())


def test_a_clients_ec_transfer_params_are_dropped() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at([], [curl]) as (_, url):
            body = {"messages": [], "ec_transfer_params": {"evil": {"addr": 1}}}
            status, out, _ = await post(url + "/v1/chat/completions", body)
        assert status == 200
        assert out["ec_transfer_params_seen"] is None

    run(scenario())


@pytest.mark.parametrize("mode", ["error", "hang", "no_params", "down", "unauthorized"])
def test_a_failing_producer_leaves_the_item_to_the_consumer(mode: str) -> None:
    body = chat_request(image(1), image(2))

    async def scenario() -> None:
        bad = FakeBackend("producer-bad", mode="ok" if mode == "down" else mode)
        good, c = FakeBackend("producer-good"), FakeBackend("consumer")
        async with fakes(bad, good, c) as (bad_url, good_url, curl):
            if mode == "down":
                bad_url = "http://127.0.0.1:9"  # nothing listens: connection refused
            async with router_at(
                [bad_url, good_url], [curl], producer_timeout_s=0.5, producer_load_bound=1
            ) as (router, url):
                status, out, _ = await post(url + "/v1/chat/completions", body)
                assert status == 200, out
                # The bound sends one item to each producer, so exactly one fails.
                params = out["ec_transfer_params_seen"]
                assert list(params.values()) == [{"by": "producer-good"}]
                assert sample(router, "encoderpool_router_media_items_total", encoded="local") == 1
                kind = "producer_timeout" if mode == "hang" else "producer_error"
                assert sample(router, "encoderpool_router_errors_total", kind=kind) == 1
                # The failed producer is avoided for a while: the next request uses the good one.
                before = len(good.seen)
                status, out, _ = await post(url + "/v1/chat/completions", body)
                assert status == 200
                assert len(out["ec_transfer_params_seen"]) == 2
                assert len(good.seen) == before + 2

    run(scenario())


def test_no_producers_means_the_consumer_encodes_everything() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at([], [curl]) as (router, url):
            status, out, _ = await post(url + "/v1/chat/completions", chat_request(image(3)))
        assert status == 200
        assert out["ec_transfer_params_seen"] is None
        assert sample(router, "encoderpool_router_media_items_total", encoded="local") == 1
        assert sample(router, "encoderpool_router_errors_total", kind="producer_unavailable") == 1

    run(scenario())


@pytest.mark.parametrize("mode", ["unavailable", "error", "down"])
def test_a_failing_consumer_is_retried_once_on_another_without_params(mode: str) -> None:
    body = chat_request(image(4))

    async def scenario() -> None:
        p = FakeBackend("producer")
        bad, good = FakeBackend("consumer-bad", mode=mode), FakeBackend("consumer-good")
        async with fakes(p, bad, good) as (purl, bad_url, good_url):
            if mode == "down":
                bad_url = "http://127.0.0.1:9"
            async with router_at([purl], [bad_url, good_url]) as (router, url):
                # Make the bad one the least loaded choice: the good one looks busy.
                router.consumers.backends[
                    [b.url for b in router.consumers.backends].index(good_url)
                ].in_flight = 5
                status, out, _ = await post(url + "/v1/chat/completions", body)
                assert status == 200, out
                assert out["served_by"] == "consumer-good"
                # The retry carries no params: the second consumer loads or encodes by itself.
                assert out["ec_transfer_params_seen"] is None
                assert sample(router, "encoderpool_router_consumer_retries_total") == 1
                assert sample(router, "encoderpool_router_errors_total", kind="consumer_error") == 1
        if mode != "down":
            assert len(bad.seen) == 1

    run(scenario())


def test_when_the_retry_fails_too_the_client_gets_the_error() -> None:
    async def scenario() -> None:
        a, b = (
            FakeBackend("consumer-a", mode="unavailable"),
            FakeBackend("consumer-b", mode="unavailable"),
        )
        async with fakes(a, b) as urls, router_at([], urls) as (router, url):
            status, out, _ = await post(url + "/v1/chat/completions", {"messages": []})
            # The last try's answer is the client's: the consumer's own 503.
            assert (status, out) == (503, {"error": {"message": "unavailable"}})
            assert (len(a.seen), len(b.seen)) == (1, 1)
            assert sample(router, "encoderpool_router_consumer_retries_total") == 1
        async with router_at([], ["http://127.0.0.1:9"]) as (router, url):
            status, out, _ = await post(url + "/v1/chat/completions", {"messages": []})
            # Nobody answered: 502, naming no internal address (the log names it).
            assert status == 502
            assert out["error"]["message"].startswith("no consumer answered (request id ")
            assert "127.0.0.1" not in json.dumps(out)
            assert sample(router, "encoderpool_router_errors_total", kind="consumer_error") == 2

    run(scenario())


def test_a_client_error_from_the_consumer_passes_through_unretried() -> None:
    async def scenario() -> None:
        a, b = (
            FakeBackend("consumer-a", mode="bad_request"),
            FakeBackend("consumer-b", mode="bad_request"),
        )
        async with fakes(a, b) as urls, router_at([], urls) as (router, url):
            status, out, _ = await post(url + "/v1/chat/completions", {"messages": []})
        assert status == 400
        assert out == {"error": {"message": "bad_request"}}
        assert len(a.seen) + len(b.seen) == 1
        assert sample(router, "encoderpool_router_consumer_retries_total") == 0

    run(scenario())


def test_bad_json_is_a_400_naming_the_problem() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at([], [curl]) as (router, url):
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", data=b"{nope") as r:
                    assert r.status == 400
                    assert "not JSON" in (await r.json())["error"]["message"]
                async with s.post(url + "/v1/chat/completions", json=[1]) as r:
                    assert r.status == 400
            assert sample(router, "encoderpool_router_errors_total", kind="bad_request") == 2
        assert c.seen == []

    run(scenario())


@pytest.mark.parametrize("depth", [100_000, 990], ids=["past-json-s-limit", "near-it"])
def test_deeply_nested_json_is_a_400_never_a_500(depth: int) -> None:
    """Past the recursion limit json refuses the body; just under it, the body parses
    but writing it again (a type-less part makes the router re-serialise) would not."""
    nested = b"[" * depth + b"]" * depth
    part = b'{"image_url": "data:image/png;base64,iVBO"}'
    raw = b'{"messages": [{"role": "user", "content": [' + part + b']}], "x": ' + nested + b"}"

    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at([], [curl]) as (router, url):
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/chat/completions", data=raw) as r,
            ):
                assert r.status == 400 if depth > 10_000 else r.status in (200, 400)
                if r.status == 400:
                    assert "nested too deeply" in (await r.json())["error"]["message"]
                else:  # parsed and written again from this stack: sent on whole
                    assert len(c.seen) == 1
            path = "/v1/chat/completions"
            fails = sample(router, "encoderpool_router_requests_total", endpoint=path, code="500")
            assert fails == 0

    run(scenario())


def test_streams_pass_through_chunk_by_chunk() -> None:
    body = chat_request(image(5), stream=True)

    async def scenario() -> None:
        gate = asyncio.Event()
        p, c = FakeBackend("producer"), FakeBackend("consumer", gate=gate)
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl]) as (_, url),
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/chat/completions", json=body) as r,
        ):
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            # The consumer holds the rest until the client has the first chunk.
            first = await r.content.readuntil(b"\n\n")
            assert json.loads(first.removeprefix(b"data: "))["choices"][0]["token_ids"] == [0]
            gate.set()
            rest = (await r.read()).decode()
        events = [e.removeprefix("data: ") for e in rest.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        assert [json.loads(e)["choices"][0]["token_ids"] for e in events[:-1]] == [[1], [2], [3]]
        assert c.seen[0].body is not None
        assert c.seen[0].body["ec_transfer_params"]

    run(scenario())


def test_a_broken_stream_ends_with_an_error_event() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer", mode="stream_break")
        async with fakes(c) as (curl,), router_at([], [curl]) as (router, url):
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/chat/completions", json={"messages": [], "stream": True}) as r,
            ):
                text = (await r.read()).decode()
            assert '"error"' in text
            assert text.endswith("data: [DONE]\n\n")
            assert sample(router, "encoderpool_router_errors_total", kind="stream_broken") == 1

    run(scenario())


@pytest.mark.parametrize("phase", ["producer", "consumer", "stream"])
def test_a_client_disconnect_cancels_upstream_work(phase: str) -> None:
    async def scenario() -> None:
        gate = asyncio.Event()  # never set: the stream stalls after its first chunk
        p = FakeBackend("producer", mode="hang" if phase == "producer" else "ok")
        c = FakeBackend("consumer", mode="hang" if phase == "consumer" else "ok", gate=gate)
        body = chat_request(image(6), stream=phase == "stream")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (router, url):
            async with aiohttp.ClientSession() as s:
                task = asyncio.create_task(s.post(url + "/v1/chat/completions", json=body))
                target = p if phase == "producer" else c
                await async_wait_until(f"the {phase} request", lambda: len(target.seen) == 1)
                if phase == "stream":
                    r = await task
                    await r.content.readuntil(b"\n\n")
                    r.close()
                else:
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
            await async_wait_until(f"the {phase} to see the cancel", lambda: target.cancelled == 1)
            await async_wait_until(
                "the disconnect to be counted",
                lambda: (
                    sample(router, "encoderpool_router_errors_total", kind="client_disconnect") == 1
                ),
            )
            assert all(b.in_flight == 0 for b in router.consumers.backends)
            assert all(b.in_flight == 0 for b in router.producers.backends)

    run(scenario())


def test_health_models_and_metrics() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with (
            fakes(c) as (curl,),
            router_at([], [curl]) as (router, url),
            aiohttp.ClientSession() as s,
        ):
            async with s.get(url + "/health") as r:
                assert r.status == 200
                assert await r.json() == {"status": "ok", "producers": 0, "consumers": 1}
            async with s.get(url + "/v1/models", headers={"x-request-id": "m1"}) as r:
                assert (await r.json())["data"] == [{"id": "consumer"}]
                assert r.headers["x-request-id"] == "m1"
            router.consumers.replace([])
            async with s.get(url + "/health") as r:
                assert r.status == 503  # unready while consumers roll ...
            async with s.get(url + "/livez") as r:
                assert r.status == 200  # ... but alive: liveness must not restart it
            async with s.post(url + "/v1/chat/completions", json={"messages": []}) as r:
                assert r.status == 503
            async with s.get(url + "/metrics") as r:
                assert r.status == 404  # metrics have a port of their own
            async with (
                serve(build_metrics_app(router)) as metrics_url,
                s.get(metrics_url + "/metrics") as r,
            ):
                text = await r.text()
        assert c.seen[0].headers["x-request-id"] == "m1"
        for name in (
            "encoderpool_router_requests_total",
            "encoderpool_router_media_items_total",
            "encoderpool_router_producer_latency_seconds_bucket",
            "encoderpool_router_consumer_latency_seconds_bucket",
            'encoderpool_router_errors_total{kind="consumer_unavailable"} 1.0',
            'encoderpool_router_backends{role="consumer"} 0.0',
            # Never requested, there from the start: rate() sees a first 5xx burst.
            'encoderpool_router_requests_total{code="502",endpoint="/v1/completions"} 0.0',
        ):
            assert name in text

    run(scenario())


def test_fifty_concurrent_requests_each_get_their_own_answer() -> None:
    async def scenario() -> None:
        ps = [FakeBackend(f"producer-{i}", delay_s=0.01) for i in range(2)]
        cs = [FakeBackend(f"consumer-{i}", delay_s=0.02) for i in range(2)]
        async with (
            fakes(*ps, *cs) as urls,
            router_at(
                urls[:2],
                urls[2:],
                producer_load_bound=1000,  # affinity only; the bound is tested apart
            ) as (router, url),
        ):
            bodies = [chat_request(image(i % 10), text=f"request {i}") for i in range(50)]
            async with aiohttp.ClientSession() as s:

                async def one(body: dict[str, Any]) -> Any:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                        return await r.json()

                outs = await asyncio.gather(*(one(b) for b in bodies))
        for body, out in zip(bodies, outs, strict=True):
            (part,) = media_parts(body)
            assert list(out["ec_transfer_params_seen"]) == [fake_mm_hash(part)]
        consumed = sorted(
            s.body["messages"][0]["content"][-1]["text"] for c in cs for s in c.seen if s.body
        )
        assert consumed == sorted(f"request {i}" for i in range(50))
        assert all(c.seen for c in cs)  # both consumers took a share
        # Affinity: every image was encoded on exactly one producer.
        for i in range(10):
            (part,) = media_parts(chat_request(image(i)))
            owners = {
                p.name
                for p in ps
                for s in p.seen
                if s.body and s.body["messages"][0]["content"] == [part]
            }
            assert len(owners) == 1, owners
        assert sample(router, "encoderpool_router_media_items_total", encoded="remote") == 50

    run(scenario())


def test_reuse_skips_producers_for_items_encoded_moments_ago() -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], reuse_encoded_s=60) as (router, url),
        ):
            status, out, _ = await post(url + "/v1/chat/completions", chat_request(image(1)))
            assert (status, len(out["ec_transfer_params_seen"])) == (200, 1)
            # Again, with a new image: only the new one goes to the producer.
            body = chat_request(image(1), image(2))
            status, out, _ = await post(url + "/v1/chat/completions", body)
            assert status == 200
            assert list(out["ec_transfer_params_seen"]) == [fake_mm_hash(media_parts(body)[1])]
            assert len(p.seen) == 2
            assert sample(router, "encoderpool_router_media_items_total", encoded="reused") == 1
            # A failed encode is not remembered: it is tried again next time.
            p.mode = "error"
            await post(url + "/v1/chat/completions", chat_request(image(3)))
            router.producers.backends[0].ejected_until = 0
            p.mode = "ok"
            status, out, _ = await post(url + "/v1/chat/completions", chat_request(image(3)))
            assert len(out["ec_transfer_params_seen"]) == 1
            assert len(p.seen) == 4

    run(scenario())


@pytest.mark.parametrize(
    ("settings", "images", "message"),
    [
        ({"max_items_per_request": 3}, 4, "4 media items in one request; at most 3"),
        ({"limit_mm_per_prompt": {"image": 2}}, 3, "3 image items in one request; this model"),
    ],
)
def test_too_many_items_is_a_400_before_any_producer_is_asked(
    settings: dict[str, Any], images: int, message: str
) -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], **settings) as (
                router,
                url,
            ),
        ):
            body = chat_request(*(image(i) for i in range(images)))
            status, out, _ = await post(url + "/v1/chat/completions", body)
            assert status == 400
            assert message in out["error"]["message"]
            assert sample(router, "encoderpool_router_errors_total", kind="too_many_items") == 1
            ok, _, _ = await post(url + "/v1/chat/completions", chat_request(image(0)))
            assert ok == 200  # the honest request still goes through
        assert len(p.seen) == 1
        assert len(c.seen) == 1

    run(scenario())


def test_a_repeated_item_is_encoded_once() -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (router, url):
            body = chat_request(image(1), image(1), image(1), image(2))
            status, out, _ = await post(url + "/v1/chat/completions", body)
            assert status == 200, out
            assert sample(router, "encoderpool_router_media_items_total", encoded="duplicate") == 2
        assert len(p.seen) == 2
        assert len(c.seen[0].body["ec_transfer_params"]) == 2  # type: ignore[index]

    run(scenario())


async def track_peak(router: Router, peaks: list[int]) -> None:
    """Record the first producer's in-flight count every 10 ms (until cancelled)."""
    while True:
        peaks.append(router.producers.backends[0].in_flight)
        await asyncio.sleep(0.01)


def test_fan_out_is_bounded_per_request_and_in_total() -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer", delay_s=0.4), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at(
                [purl],
                [curl],
                max_encodes_per_request=2,
                max_producer_requests=1,
                producer_load_bound=100,
                producer_timeout_s=1.0,
            ) as (router, url),
        ):
            peak: list[int] = []
            watcher = asyncio.create_task(track_peak(router, peak))
            # 3 clients x 4 items: 2 of each wait for the one slot (0.4 s per item); those
            # still waiting after producer_timeout_s go to the consumer instead.
            bodies = [chat_request(*(image(10 * k + i) for i in range(4))) for k in range(3)]
            answers = await asyncio.gather(*(post(url + "/v1/chat/completions", b) for b in bodies))
            watcher.cancel()
            assert [a[0] for a in answers] == [200, 200, 200]
            assert max(peak) == 1
            assert sample(router, "encoderpool_router_errors_total", kind="producer_saturated") > 0
            assert sample(router, "encoderpool_router_media_items_total", encoded="remote") >= 2
        assert len(p.seen) < 12  # not every item reached the producer

    async def one_request() -> None:
        p, c = FakeBackend("producer", delay_s=0.2), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], max_encodes_per_request=2, producer_load_bound=100) as (
                router,
                url,
            ),
        ):
            peak: list[int] = []
            watcher = asyncio.create_task(track_peak(router, peak))
            body = chat_request(*(image(i) for i in range(6)))
            status, _, _ = await post(url + "/v1/chat/completions", body)
            watcher.cancel()
            assert status == 200
            assert max(peak) == 2  # one request never has more than 2 items on producers
        assert len(p.seen) == 6  # all of them, two at a time

    run(one_request())

    run(scenario())


def url_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_with(*parts: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}],
    }


def test_media_urls_that_reach_inside_are_refused() -> None:
    """A client's image URL must not make the pool fetch from the cluster's inside: the
    test's own loopback services stand in for them."""

    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (router, url):
            for bad, why in [
                ("file:///etc/passwd", "scheme 'file' is refused"),
                ("gopher://example.com/x", "scheme 'gopher' is refused"),
                (purl + "/v1/models", "private, loopback or link-local"),  # a live service
                ("http://localhost:1/x.png", "private, loopback or link-local"),
                ("http://169.254.169.254/latest/meta-data", "private, loopback or link-local"),
                ("http://[::ffff:10.0.0.1]/x.png", "private, loopback or link-local"),
                ("http://10.96.0.1/x.png", "private, loopback or link-local"),
            ]:
                status, out, _ = await post(url + "/v1/chat/completions", chat_with(url_part(bad)))
                assert status == 400, bad
                assert why in out["error"]["message"], (bad, out)
            refused = sample(router, "encoderpool_router_errors_total", kind="media_url_refused")
            assert refused == 7
            # Inline data still works: nothing is fetched.
            ok, _, _ = await post(url + "/v1/chat/completions", chat_request(image(1)))
            assert ok == 200
        assert len(p.seen) == 1  # only the honest item reached a producer
        assert len(c.seen) == 1

    run(scenario())


def test_media_domains_allow_list_and_the_private_opt_in() -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at(
                [purl], [curl], allowed_media_domains=("127.0.0.1",), allow_private_media=True
            ) as (_router, url),
        ):
            status, out, _ = await post(
                url + "/v1/chat/completions", chat_with(url_part("https://example.com/x.png"))
            )
            assert status == 400
            assert "'example.com' is not among the allowed domains" in out["error"]["message"]
            status, _, _ = await post(
                url + "/v1/chat/completions", chat_with(url_part(purl + "/cat.png"))
            )
            assert status == 200  # an in-cluster media server, allowed on purpose
        assert len(p.seen) == 1

    run(scenario())


def test_a_client_s_media_uuid_never_reaches_vllm_unless_trusted() -> None:
    """vLLM keys an item by its uuid: a client reusing another's uuid with other bytes
    would otherwise be answered with the other client's embedding (or poison it)."""
    part = {**media_parts(chat_request(image(1)))[0], "uuid": "shared-id"}
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}]}

    async def scenario(trust: bool) -> tuple[list[Any], Any]:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], trust_client_media_ids=trust) as (_router, url),
        ):
            status, _, _ = await post(url + "/v1/chat/completions", body)
            assert status == 200
        return [s.body for s in p.seen], c.seen[0].body

    producer_bodies, consumer_body = run(scenario(trust=False))
    assert "shared-id" not in json.dumps(producer_bodies)
    assert "shared-id" not in json.dumps(consumer_body)
    producer_bodies, consumer_body = run(scenario(trust=True))
    assert "shared-id" in json.dumps(producer_bodies)
    assert "shared-id" in json.dumps(consumer_body)


def test_the_consumer_gets_the_clients_own_bytes_with_the_params_last() -> None:
    """No re-serialisation on the hot path: the client's spelling, spacing and key
    order reach the consumer byte for byte, the router's params appended."""
    body = chat_request(image(1), text='caf\u00e9 \u2028 "quoted"')
    raw = json.dumps(body, indent=1, ensure_ascii=True).encode() + b"\n"

    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl]) as (_, url),
            aiohttp.ClientSession() as s,
            s.post(
                url + "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}
            ) as r,
        ):
            assert r.status == 200, await r.text()
        (seen,) = c.seen
        assert seen.raw.startswith(raw.rstrip()[:-1])
        assert seen.body is not None
        assert list(seen.body) == [*body, "ec_transfer_params"]
        assert seen.body["ec_transfer_params"] == {
            fake_mm_hash(media_parts(body)[0]): {"by": "producer"}
        }

    run(scenario())


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [], "ec\\u005ftransfer_params": {"evil": {"addr": 1}}}',
        b'{"ec_transfer_params": {"evil": 1}, "messages": [], "ec_transfer_params": {"evil": 2}}',
    ],
)
def test_a_clients_ec_transfer_params_are_dropped_in_any_spelling(raw: bytes) -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with (
            fakes(c) as (curl,),
            router_at([], [curl]) as (_, url),
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/chat/completions", data=raw) as r,
        ):
            assert r.status == 200
            out = await r.json()
        assert out["ec_transfer_params_seen"] is None
        assert b"evil" not in c.seen[0].raw

    run(scenario())


def test_a_repeated_url_key_cannot_smuggle_a_private_address_past_the_check() -> None:
    """The router checks the URL json keeps (the last); the consumer must get that one
    alone, whatever its parser would do with repeated keys."""
    raw = (
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url",'
        b' "image_url": {"url": "http://169.254.169.254/latest", "url": "'
        + data_url(image(1)).encode()
        + b'"}}]}]}'
    )

    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with (
            fakes(c) as (curl,),
            router_at([], [curl]) as (_, url),
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/chat/completions", data=raw) as r,
        ):
            assert r.status == 200
        (seen,) = c.seen
        assert b"169.254" not in seen.raw

    run(scenario())


def test_a_body_over_the_limit_is_a_413_and_goes_nowhere() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with (
            fakes(c) as (curl,),
            router_at([], [curl], max_body_bytes=4096) as (router, url),
        ):
            big = {"messages": [], "pad": "x" * 5000}
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", json=big) as r:
                    assert r.status == 413

                async def chunks() -> Any:  # no Content-Length: the limit holds while reading
                    for _ in range(5):
                        yield b" " * 1024
                    yield b"{}"

                async with s.post(url + "/v1/chat/completions", data=chunks()) as r:
                    assert r.status == 413
            status, _, _ = await post(url + "/v1/chat/completions", {"messages": []})
            assert status == 200
            counted = {"endpoint": "/v1/chat/completions", "code": "413"}
            assert sample(router, "encoderpool_router_requests_total", **counted) == 2
        assert len(c.seen) == 1

    run(scenario())


def test_a_producer_refusing_an_item_is_not_ejected() -> None:
    """A 4xx is the item's fault (an undecodable image): the next client's items still
    go to that producer."""

    async def scenario() -> None:
        p, c = FakeBackend("producer", mode="bad_request"), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (router, url):
            status, out, _ = await post(url + "/v1/chat/completions", chat_request(image(1)))
            assert status == 200
            assert out["ec_transfer_params_seen"] is None
            assert router.producers.backends[0].ejected_until == 0.0
            # Counted as the item's, not as a producer failure (the alert reads that one).
            errors = "encoderpool_router_errors_total"
            assert sample(router, errors, kind="producer_refused_item") == 1
            assert sample(router, errors, kind="producer_error") == 0
            p.mode = "ok"
            status, out, _ = await post(url + "/v1/chat/completions", chat_request(image(2)))
            assert status == 200
            assert out["ec_transfer_params_seen"]
        assert len(p.seen) == 2

    run(scenario())

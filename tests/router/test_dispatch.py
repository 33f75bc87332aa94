"""Where the router has each media item encoded, and the encoder-demand signal it exports,
through a router over fake backends."""

from __future__ import annotations

import asyncio

import aiohttp

from e2e.media import chat_request, image
from encoderpool_contracts.signals import (
    DISPATCH_DECISIONS,
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
)
from tests.router.fixtures import FakeBackend, fakes, router_at, run


async def chat(url: str, *parts: bytes, status: int = 200) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=chat_request(*parts)) as r,
    ):
        assert r.status == status


def sample(router: object, name: str, **labels: str) -> float:
    value = router.metrics.registry.get_sample_value(name, labels)  # type: ignore[attr-defined]
    return float(value or 0.0)


def test_always_sends_every_item_to_a_producer_and_counts_its_time_in_flight() -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer", delay_s=0.2), FakeBackend("consumer")
        async with fakes(p, c) as (purl, curl), router_at([purl], [curl]) as (router, url):
            await chat(url, image(1))
            group = router.encoder.backlogs["image"].group
            assert len(p.seen) == 1
            assert (
                sample(router, DISPATCH_DECISIONS, group=group, to="producer", reason="always") == 1
            )
            # one item in flight for ~0.2 s: the integral counts it
            assert 0.15 <= sample(router, ENCODER_INFLIGHT_SECONDS, group=group) < 5

    run(scenario())


def test_when_faster_an_idle_consumer_encodes_a_lone_item_itself() -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer"), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], dispatch="when-faster") as (router, url),
        ):
            await chat(url, image(1))
            group = router.encoder.backlogs["image"].group
            assert p.seen == []  # no hop for image-light traffic
            assert (
                sample(
                    router, DISPATCH_DECISIONS, group=group, to="consumer", reason="consumer_idle"
                )
                == 1
            )
            # A second item of the same request finds the consumer loaded by the first.
            await chat(url, image(2), image(3))
            assert len(p.seen) == 1
            assert (
                sample(
                    router, DISPATCH_DECISIONS, group=group, to="producer", reason="consumer_busy"
                )
                == 1
            )

    run(scenario())


def test_when_faster_a_busy_consumer_sends_items_to_the_producers() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        p, c = FakeBackend("producer"), FakeBackend("consumer", gate=gate)
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], dispatch="when-faster") as (_router, url),
        ):
            # A streaming request holds the consumer (its stream waits on the gate).
            async with aiohttp.ClientSession() as s:
                body = {**chat_request(image(9)), "stream": True}
                async with s.post(url + "/v1/chat/completions", json=body) as held:
                    await held.content.readline()
                    await chat(url, image(1))
                    gate.set()
                    await held.read()
            assert len(p.seen) == 1

    run(scenario())


def test_no_producer_ready_is_unserved_demand_and_the_consumer_encodes() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at(["http://127.0.0.1:9"], [curl]) as (router, url):
            router.encoder.backlogs["image"].producers.replace([])  # the group at zero
            await chat(url, image(1))
            group = router.encoder.backlogs["image"].group
            assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 1
            assert (
                sample(router, DISPATCH_DECISIONS, group=group, to="consumer", reason="no_producer")
                == 1
            )

    run(scenario())


# --- the wake signal: only items of requests a consumer accepted, each once, per share ----


def test_bogus_requests_refused_by_the_consumer_add_no_unserved_items() -> None:
    """A burst from one client, every request refused (400) by the consumer: the items
    found no producer, but asked nothing of any encoder, so nothing wakes the group."""

    async def scenario() -> None:
        c = FakeBackend("consumer", mode="bad_request")
        async with fakes(c) as (curl,), router_at(["http://127.0.0.1:9"], [curl]) as (router, url):
            router.encoder.backlogs["image"].producers.replace([])  # the group at zero
            group = router.encoder.backlogs["image"].group
            # 300 requests of 8 items each, 8 at once (its share: 64 items at the producers)
            for burst in range(38):
                await asyncio.gather(
                    *(
                        chat(url, *(image(100 * burst + 10 * i + j) for j in range(8)), status=400)
                        for i in range(8)
                    )
                )
            assert len(c.seen) == 304
            assert (
                sample(router, DISPATCH_DECISIONS, group=group, to="consumer", reason="no_producer")
                == 304 * 8
            )
            assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 0

    run(scenario())


def test_the_same_image_sent_100_times_counts_once() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with fakes(c) as (curl,), router_at(["http://127.0.0.1:9"], [curl]) as (router, url):
            router.encoder.backlogs["image"].producers.replace([])
            group = router.encoder.backlogs["image"].group
            for _ in range(5):
                await asyncio.gather(*(chat(url, image(7)) for _ in range(20)))
            assert len(c.seen) == 100
            assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 1
            await chat(url, image(8), image(7))  # a new one counts; the old one still not
            assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 2

    run(scenario())


def test_accepted_requests_count_each_item_up_to_the_client_s_share() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with (
            fakes(c) as (curl,),
            router_at(
                ["http://127.0.0.1:9"], [curl], max_items_per_request=2, max_items_per_client=5
            ) as (router, url),
        ):
            router.encoder.backlogs["image"].producers.replace([])
            group = router.encoder.backlogs["image"].group
            await chat(url, image(1), image(2))
            await chat(url, image(3))
            assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 3
            for i in range(10):  # one client (one address) asks for many more
                await chat(url, image(10 + i))
            assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 5

    run(scenario())


def test_a_stream_counts_once_the_consumer_began_it() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        c = FakeBackend("consumer", gate=gate)
        async with fakes(c) as (curl,), router_at(["http://127.0.0.1:9"], [curl]) as (router, url):
            router.encoder.backlogs["image"].producers.replace([])
            group = router.encoder.backlogs["image"].group
            async with aiohttp.ClientSession() as s:
                body = {**chat_request(image(1)), "stream": True}
                async with s.post(url + "/v1/chat/completions", json=body) as held:
                    await held.content.readline()
                    # Its 200 is in, the rest still generating: the item already counts.
                    assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 1
                    gate.set()
                    await held.read()
            assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 1

    run(scenario())


def test_a_request_retried_past_a_failing_consumer_counts_once() -> None:
    async def scenario() -> None:
        bad, good = FakeBackend("consumer-a", mode="error"), FakeBackend("consumer-b")
        async with (
            fakes(bad, good) as (burl, gurl),
            router_at(["http://127.0.0.1:9"], [burl, gurl], eject_s=0) as (router, url),
        ):
            router.encoder.backlogs["image"].producers.replace([])
            group = router.encoder.backlogs["image"].group
            for i in range(20):  # each picks one of the two at random first
                await chat(url, image(i))
            assert bad.seen  # some went to the failing one first
            assert sample(router, ENCODER_UNSERVED_ITEMS, group=group) == 20

    run(scenario())

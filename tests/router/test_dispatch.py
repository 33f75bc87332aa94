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


async def chat(url: str, *parts: bytes) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=chat_request(*parts)) as r,
    ):
        assert r.status == 200


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

"""Where the router has each media item encoded, and the encoder-demand signal it exports,
through a router over fake backends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from e2e.media import chat_request, image
from encoderpool_contracts.signals import (
    DISPATCH_DECISIONS,
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    PRODUCER_ITEM_SECONDS,
)
from encoderpool_router.demand import (
    FADE_HALF_LIFE_S,
    HOP_PRIOR_S,
    ITEM_WEIGHT,
    UNKNOWN_ENCODE_S,
    Dispatch,
    ProducerTimes,
    decide,
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


def decisions(router: object, group: str) -> dict[str, int]:
    """Decisions so far by reason (those made at least once)."""
    out = {}
    for reason, to in (
        ("consumer_busy", "producer"),
        ("consumer_idle", "consumer"),
        ("producers_busy", "consumer"),
    ):
        if n := sample(router, DISPATCH_DECISIONS, group=group, to=to, reason=reason):
            out[reason] = int(n)
    return out


@asynccontextmanager
async def consumer_held(url: str, gate: asyncio.Event) -> AsyncIterator[None]:
    """One text-only streaming request in flight on the consumer (built with ``gate``:
    its stream waits on it) for the duration of the block: the consumer's load is 1."""
    gate.clear()
    async with aiohttp.ClientSession() as s:
        body = {**chat_request(text="hold"), "stream": True}
        async with s.post(url + "/v1/chat/completions", json=body) as held:
            await held.content.readline()
            yield
            gate.set()
            await held.read()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the decision, in seconds ------------------------------------------------------------


@pytest.mark.parametrize(
    ("ready", "backlog", "load", "producer_s", "encode_s", "expected"),
    [
        # A slow producer loses to a consumer that a queue count would have called busy:
        # 1 s there against 4 x 0.1 s of delay here.
        (1, 0, 3, 1.0, 0.1, Dispatch("consumer", "producers_busy")),
        # ... and wins once the consumer is busy enough: 1 s against 12 x 0.1 s.
        (1, 0, 11, 1.0, 0.1, Dispatch("producer", "consumer_busy")),
        # A busy consumer sends to a fast producer even behind a longer queue than its own
        # load (queue 2 per replica, load 2: a count keeps it local): 3 x 0.05 < 3 x 0.1.
        (2, 4, 2, 0.05, 0.1, Dispatch("producer", "consumer_busy")),
        # An idle consumer delays nobody: the hop is never worth it at equal encode times.
        (4, 0, 0, 0.1, 0.1, Dispatch("consumer", "consumer_idle")),
        # Equal times: the queue comparison (a tie stays local, no hop for nothing).
        (1, 2, 2, 0.1, 0.1, Dispatch("consumer", "producers_busy")),
        (1, 1, 2, 0.1, 0.1, Dispatch("producer", "consumer_busy")),
        # Nobody there: the consumer, whatever the times.
        (0, 0, 50, 0.001, 1.0, Dispatch("consumer", "no_producer")),
    ],
)
def test_when_faster_decides_by_time(
    ready: int, backlog: int, load: int, producer_s: float, encode_s: float, expected: Dispatch
) -> None:
    assert decide("when-faster", ready, backlog, load, producer_s, encode_s) == expected
    if ready:  # always ignores every time
        assert decide("always", ready, backlog, load, producer_s, encode_s).to == "producer"


def test_the_prior_is_the_width_job_s_encode_plus_a_hop_before_any_answer() -> None:
    times = ProducerTimes({"image": 0.08})
    assert times.producer_s("g", "image") == pytest.approx(0.08 + HOP_PRIOR_S)
    assert times.encode_s("g", "image") == pytest.approx(0.08)
    # A modality the width Job did not time: both sides the same number, which cancels.
    assert times.producer_s("g", "video") == pytest.approx(UNKNOWN_ENCODE_S + HOP_PRIOR_S)
    assert times.encode_s("g", "video") == times.producer_s("g", "video")


def test_the_mean_learns_from_round_trips_per_item_in_flight_and_fades_back() -> None:
    clock = Clock()
    times = ProducerTimes({"image": 0.08}, clock=clock)
    prior = 0.08 + HOP_PRIOR_S
    # Round trips of 1.2 s with 4 items in flight on the producer: 0.3 s per item.
    expected = prior
    for _ in range(3):
        times.observe("g", "image", 1.2, 4)
        expected += ITEM_WEIGHT * (0.3 - expected)
        assert times.producer_s("g", "image") == pytest.approx(expected)
    for _ in range(60):
        times.observe("g", "image", 1.2, 4)
    assert times.producer_s("g", "image") == pytest.approx(0.3, rel=1e-4)
    # Slower than the width Job's time: the consumer's encode stays the width Job's.
    assert times.encode_s("g", "image") == pytest.approx(0.08)
    # Another group, or another modality of the group, has its own mean.
    assert times.producer_s("h", "image") == pytest.approx(prior)
    assert times.producer_s("g", "video") == pytest.approx(UNKNOWN_ENCODE_S + HOP_PRIOR_S)
    # Unrefreshed, it fades halfway back to the prior every half-life.
    clock.now += FADE_HALF_LIFE_S
    assert times.producer_s("g", "image") == pytest.approx((0.3 + prior) / 2, rel=1e-4)
    clock.now += 20 * FADE_HALF_LIFE_S
    assert times.producer_s("g", "image") == pytest.approx(prior, rel=1e-4)
    ((group, modality, mean),) = times.means()
    assert (group, modality) == ("g", "image")
    assert mean == pytest.approx(prior, rel=1e-4)


def test_items_faster_than_the_width_job_s_largest_lower_the_consumer_s_encode_too() -> None:
    """The width Job times the largest item the model admits; a producer answering this
    traffic's items in 30 ms (hop included) bounds the same encoder's time lower."""
    times = ProducerTimes({"image": 0.5}, clock=Clock())
    for _ in range(100):
        times.observe("g", "image", 0.03, 1)
    assert times.producer_s("g", "image") == pytest.approx(0.03, rel=1e-3)
    assert times.encode_s("g", "image") == times.producer_s("g", "image")
    # So an idle consumer still encodes it itself, and a busy one compares queues.
    p, e = times.producer_s("g", "image"), times.encode_s("g", "image")
    assert decide("when-faster", 1, 0, 0, p, e).reason == "consumer_idle"
    assert decide("when-faster", 1, 0, 1, p, e).reason == "consumer_busy"


# --- through a router over fake backends ---------------------------------------------------


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


def test_the_router_learns_the_producers_time_per_item_from_their_round_trips() -> None:
    async def scenario() -> None:
        p, c = FakeBackend("producer", delay_s=0.3), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], encode_seconds={"image": 0.05}) as (router, url),
        ):
            group = router.encoder.backlogs["image"].group
            assert router.encoder.demand.costs(group, "image") == pytest.approx(
                (0.05 + HOP_PRIOR_S, 0.05)
            )
            # Nothing measured yet: no series (a prior is no observation).
            assert sample(router, PRODUCER_ITEM_SECONDS, group=group, modality="image") == 0
            expected = 0.05 + HOP_PRIOR_S
            for i in range(4):  # one at a time: each round trip is one item's time
                await chat(url, image(i))
                expected += ITEM_WEIGHT * (0.3 - expected)
            got = sample(router, PRODUCER_ITEM_SECONDS, group=group, modality="image")
            # the round trips are the 0.3 s delay plus the hop on loopback
            assert expected <= got < expected + 0.05, (got, expected)
            assert router.encoder.demand.costs(group, "image")[0] == pytest.approx(got, rel=0.01)

    run(scenario())


def test_when_faster_a_slow_producer_loses_to_a_consumer_busy_by_count() -> None:
    """The consumer has a request in flight and the producer nothing: by queue counts the
    item goes to the producer. Measured at 0.3 s per item against a 50 ms encode, the
    producer is slower than the delay the consumer's encode causes (2 x 50 ms)."""

    async def scenario() -> None:
        gate = asyncio.Event()
        p, c = FakeBackend("producer", delay_s=0.3), FakeBackend("consumer", gate=gate)
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], dispatch="when-faster", encode_seconds={"image": 0.05}) as (
                router,
                url,
            ),
        ):
            group = router.encoder.backlogs["image"].group
            # Before any answer the prior (50 ms + the hop) makes the producer the faster.
            async with consumer_held(url, gate):
                await chat(url, image(1))
            assert len(p.seen) == 1
            assert decisions(router, group) == {"consumer_busy": 1}
            for _ in range(20):  # the producer's measured time moves to 0.3 s
                router.encoder.demand.observe(group, "image", 0.3, 1)
            async with consumer_held(url, gate):
                await chat(url, image(2))
            assert len(p.seen) == 1  # the consumer encoded it
            assert decisions(router, group) == {"consumer_busy": 1, "producers_busy": 1}

    run(scenario())


def test_when_faster_a_busy_consumer_sends_to_a_fast_producer_and_the_hop_counts() -> None:
    """The same load of one request on the consumer, the producers unmeasured: with a
    50 ms encode the hop (20 ms) is worth it, with a 10 ms encode it is not."""

    async def scenario(encode_s: float) -> dict[str, int]:
        gate = asyncio.Event()
        p, c = FakeBackend("producer"), FakeBackend("consumer", gate=gate)
        async with (
            fakes(p, c) as (purl, curl),
            router_at(
                [purl], [curl], dispatch="when-faster", encode_seconds={"image": encode_s}
            ) as (router, url),
        ):
            async with consumer_held(url, gate):
                await chat(url, image(1))
            return decisions(router, router.encoder.backlogs["image"].group)

    assert run(scenario(0.05)) == {"consumer_busy": 1}  # 1 x 70 ms < 2 x 50 ms
    assert run(scenario(0.01)) == {"producers_busy": 1}  # 1 x 30 ms > 2 x 10 ms


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

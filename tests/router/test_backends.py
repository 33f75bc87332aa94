"""The bookkeeping of calls to backends (in flight, latency, ejection), and the encode
step's seam: the per-item decision and the producer backlog it sees."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram

from e2e.media import chat_request, image
from encoderpool_router.backends import Backend, Calls, usable
from encoderpool_router.encode import Backlog
from encoderpool_router.relay import ClientGone
from encoderpool_router.upstream import UpstreamError
from tests.router.fixtures import FakeBackend, fakes, router_at, run
from tests.waiting import async_wait_until


class Bookkeeping:
    """A ``Calls`` over metrics of its own, and what it counted."""

    def __init__(self, eject_s: float = 5.0) -> None:
        reg = CollectorRegistry()
        self.gauge = Gauge("in_flight", "", registry=reg)
        self.latency = Histogram("latency", "", registry=reg)
        self.reg = reg
        self.kinds: list[str] = []  # the error kinds counted
        self.calls = Calls(eject_s, self.gauge, self.latency, self.kinds.append)

    def value(self, name: str) -> float:
        got = self.reg.get_sample_value(name)
        return 0.0 if got is None else got


def test_a_call_is_in_flight_on_its_backend_and_the_gauge_while_it_runs() -> None:
    book, b = Bookkeeping(), Backend("http://p0")
    with book.calls.track(b):
        assert b.in_flight == 1
        assert book.value("in_flight") == 1
        with book.calls.track(b):
            assert (b.in_flight, book.value("in_flight")) == (2, 2)
    assert (b.in_flight, book.value("in_flight")) == (0, 0)
    assert book.value("latency_count") == 2
    assert b.ejected_until == 0.0
    assert book.kinds == []


def test_a_failure_that_says_the_backend_is_down_ejects_it_for_a_while() -> None:
    book = Bookkeeping(eject_s=5.0)
    down, fine = Backend("http://p0"), Backend("http://p1")
    before = time.monotonic()
    with pytest.raises(UpstreamError), book.calls.track(down):
        raise UpstreamError("producer_timeout", "no answer", eject=True)
    assert (down.in_flight, book.value("in_flight")) == (0, 0)
    assert book.kinds == ["producer_timeout"]
    assert before + 5.0 <= down.ejected_until <= time.monotonic() + 5.0
    assert book.value("latency_count") == 1  # failed calls are timed too
    # Passed over until then, and back after; never all passed over.
    assert usable([down, fine]) == [fine]
    assert usable([down, fine], now=down.ejected_until) == [down, fine]
    assert usable([down]) == [down]


def test_a_failure_that_may_be_the_request_s_own_ejects_nothing() -> None:
    book, b = Bookkeeping(), Backend("http://c0")
    with pytest.raises(UpstreamError), book.calls.track(b):
        raise UpstreamError("consumer_error", "HTTP 500")
    assert book.kinds == ["consumer_error"]
    assert b.ejected_until == 0.0


@pytest.mark.parametrize(
    "raised",
    [ClientGone(web.StreamResponse()), asyncio.CancelledError(), RuntimeError("a bug")],
    ids=["client_gone", "cancelled", "bug"],
)
def test_a_call_ended_by_the_client_or_a_bug_is_neither_counted_nor_ejects(
    raised: BaseException,
) -> None:
    book, b = Bookkeeping(), Backend("http://c0")
    with pytest.raises(type(raised)), book.calls.track(b):
        raise raised
    assert (b.in_flight, book.value("in_flight"), book.kinds) == (0, 0, [])
    assert b.ejected_until == 0.0


def test_decide_leaves_items_without_a_group_to_the_consumer_and_reuses_recent_ones() -> None:
    async def scenario() -> None:
        async with router_at(
            producers_by_modality={"image": ("http://127.0.0.1:9",)},
            consumers=["http://127.0.0.1:9"],
            reuse_encoded_s=60,
        ) as (router, _):
            encoder = router.encoder
            images = encoder.backlogs["image"]
            assert "video" not in encoder.backlogs
            assert encoder.decide(b"k", None, "video") == "local"
            assert encoder.decide(b"k", images, "image") == "producer"
            assert encoder.recent is not None
            encoder.recent.add(b"k")
            assert encoder.decide(b"k", images, "image") == "reused"

    run(scenario())


def test_modalities_sharing_a_group_share_its_backlog() -> None:
    async def scenario() -> None:
        urls = ("http://127.0.0.1:9",)
        async with router_at(
            producers_by_modality={"image": urls, "video": urls, "audio": ("http://127.0.0.1:8",)},
            consumers=["http://127.0.0.1:9"],
        ) as (router, _):
            backlogs = router.encoder.backlogs
            assert backlogs["image"] is backlogs["video"]
            assert backlogs["audio"] is not backlogs["image"]
            assert (backlogs["image"].ready, backlogs["image"].waiting) == (1, 0)

    run(scenario())


def test_the_backlog_shows_items_waiting_for_a_slot_and_in_flight_per_producer() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        p, c = FakeBackend("producer", delay_s=0.3), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], max_producer_requests=1) as (router, url),
        ):
            backlog: Backlog = router.encoder.backlogs["image"]
            seen: list[tuple[int, dict[str, int]]] = []

            async def watch() -> None:
                while not gate.is_set():
                    seen.append((backlog.waiting, backlog.in_flight()))
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            async with aiohttp.ClientSession() as s:
                body = chat_request(image(1), image(2))
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
            gate.set()
            await watcher
            # One slot: one item on the producer while the other waits for it.
            assert (1, {purl: 1}) in seen
            await async_wait_until("drained", lambda: backlog.in_flight() == {purl: 0})
            assert backlog.waiting == 0

    run(scenario())

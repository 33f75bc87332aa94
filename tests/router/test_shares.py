"""Each client's share: one client's flood of slow items leaves others their slots.

Against in-process fake backends: a producer that takes seconds per item stands
for a busy encoder. What is asserted is order, not time: the other client's item
reaches a producer while the flood's items are still being encoded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.media import chat_request, image
from encoderpool_router.shares import Shares
from tests.router.fixtures import FakeBackend, fakes, router_at, run
from tests.waiting import async_wait_until

CHAT = "/v1/chat/completions"


def test_shares_count_per_client_and_forget_idle_clients() -> None:
    shares = Shares(max_requests=2, max_items=3)
    assert shares.admit("a")
    assert shares.admit("a")
    assert not shares.admit("a")
    assert shares.admit("b")
    assert shares.reserve_items("a", 3)
    assert not shares.reserve_items("a", 1)  # all or none
    assert shares.reserve_items("b", 2)
    assert shares.clients() == 2
    for _ in range(2):
        shares.leave("a")
    shares.release_items("a", 3)
    shares.leave("b")
    shares.release_items("b", 2)
    assert shares.clients() == 0


def _tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("token-a\ntoken-b\n")
    return path


async def _post(s: aiohttp.ClientSession, url: str, body: Any, token: str) -> int:
    headers = {"Authorization": f"Bearer {token}", "x-request-id": token + str(id(body))}
    async with s.post(url + CHAT, json=body, headers=headers) as r:
        await r.read()
        if r.status == 429:
            assert r.headers["Retry-After"] == "1"
        return r.status


def _flood() -> list[dict[str, Any]]:
    """Twenty requests of 32 distinct images each: 640 items."""
    return [chat_request(*(image(1000 + 32 * r + i) for i in range(32))) for r in range(20)]


@pytest.mark.parametrize("shared", [True, False], ids=["with-shares", "without"])
def test_a_flood_of_slow_items_leaves_another_client_its_producer_slot(
    tmp_path: Path, shared: bool
) -> None:
    """Client A sends 640 items to a producer that takes 5 s each; client B then sends
    one. With shares, A holds at most 64 producer slots (the rest is 429 at once) and B's
    item reaches the producer before any of A's is done. Without them (one share as
    large as all 64 slots), B's item queues behind all of A's: still waiting when A's
    first 64 are done."""
    limits: dict[str, Any] = (
        {"max_items_per_client": 64, "max_producer_requests": 256}
        if shared
        else {"max_items_per_client": 100000, "max_producer_requests": 64}
    ) | {"max_encodes_per_request": 32}
    flood = _flood()
    b_body = chat_request(image(7))

    async def scenario() -> None:
        p, c = FakeBackend("producer", delay_s=5.0), FakeBackend("consumer")
        async with (
            fakes(p, c) as (purl, curl),
            router_at([purl], [curl], auth_token_file=_tokens(tmp_path), **limits) as (
                router,
                url,
            ),
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s,
        ):
            a = [asyncio.create_task(_post(s, url, body, "token-a")) for body in flood]
            await async_wait_until("A's items at the producer", lambda: len(p.seen) >= 64)
            b = asyncio.create_task(_post(s, url, b_body, "token-b"))
            b_item = image_url_of(b_body)

            def b_at_producer() -> bool:
                return any(image_url_of(seen.body) == b_item for seen in p.seen)

            def done() -> float:  # producer answers the router has had
                count = router.metrics.registry.get_sample_value(
                    "encoderpool_router_producer_latency_seconds_count"
                )
                return count or 0.0

            if shared:
                await async_wait_until("B's item at the producer", b_at_producer)
                assert done() == 0  # B did not wait for any of A's items
                assert await b == 200
                statuses = await asyncio.gather(*a)
                assert statuses.count(200) == 2
                assert statuses.count(429) == 18
            else:
                # The slots are first come, first served: B's item queues behind all of A's.
                await async_wait_until("A's first 64 done", lambda: done() >= 64, timeout=30)
                assert not b_at_producer()
                for t in (*a, b):
                    t.cancel()
                await asyncio.gather(*a, b, return_exceptions=True)

    run(scenario(), timeout=120)


def image_url_of(body: dict[str, Any] | None) -> str:
    assert body is not None
    return str(body["messages"][0]["content"][0]["image_url"]["url"])


def test_a_client_past_its_requests_in_flight_gets_429_and_others_are_served(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer", delay_s=2.0)
        async with (
            fakes(c) as (curl,),
            router_at([], [curl], auth_token_file=_tokens(tmp_path), max_requests_per_client=3)
            as (_router, url),
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s,
        ):  # fmt: skip
            text = {"messages": [{"role": "user", "content": "hi"}]}
            a = [asyncio.create_task(_post(s, url, dict(text), "token-a")) for _ in range(8)]
            await async_wait_until("A's three at the consumer", lambda: len(c.seen) >= 3)
            assert await _post(s, url, dict(text), "token-b") == 200
            statuses = await asyncio.gather(*a)
            assert sorted(statuses) == [200] * 3 + [429] * 5

    run(scenario())


def test_a_body_that_never_finishes_arriving_is_a_408() -> None:
    async def scenario() -> None:
        c = FakeBackend("consumer")
        async with (
            fakes(c) as (curl,),
            router_at([], [curl], body_read_timeout_s=0.5) as (
                router,
                url,
            ),
        ):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mess'
            )
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 10)
            assert status_line.startswith(b"HTTP/1.1 408")
            writer.close()
            timeouts = router.metrics.registry.get_sample_value(
                "encoderpool_router_errors_total", {"kind": "body_timeout"}
            )
            assert timeouts == 1
        assert c.seen == []

    run(scenario())

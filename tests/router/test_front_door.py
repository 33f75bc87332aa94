"""The front door's bounds, in process: connections per address and in all, the deadline
for a request head, header limits, the probe port apart, and the body memory budget.

The same attacks against the router as a process, under a memory limit, are
``test_front_door_process.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from encoderpool_router.app import Router, build_app, build_probe_app
from encoderpool_router.body import parse, parse_cost
from encoderpool_router.budget import MIB, BodyBudget, plan
from encoderpool_router.config import RouterSettings
from encoderpool_router.listener import ConnectionLimits, start
from encoderpool_router.protocol import Refused
from tests.router.fixtures import FakeBackend, fakes, run
from tests.waiting import async_wait_until

LIVEZ = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"


@contextlib.asynccontextmanager
async def listening(
    app: web.Application, limits: ConnectionLimits
) -> AsyncIterator[tuple[web.AppRunner, int]]:
    runner, server = await start(app, "127.0.0.1", 0, limits)
    try:
        yield runner, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await runner.cleanup()


async def connect(port: int, source: str = "127.0.0.1") -> tuple[Any, Any]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def status_of(reader: asyncio.StreamReader) -> bytes:
    return (await asyncio.wait_for(reader.readline(), 60)).split(b" ")[1]


def limits(**given: Any) -> ConnectionLimits:
    base = {"max_connections": 4, "max_per_address": 2, "head_timeout_s": 5.0, "max_headers": 8}
    return ConnectionLimits(**{**base, **given})


def test_one_address_cannot_take_every_connection() -> None:
    async def scenario() -> None:
        async with fakes(FakeBackend("consumer")) as (curl,):
            router = Router(RouterSettings(consumers=(curl,)))
            async with listening(build_app(router), limits()) as (runner, port):
                held = [await connect(port) for _ in range(2)]
                refused, _ = await connect(port)
                answer = await asyncio.wait_for(refused.read(), 60)  # to EOF: closed
                assert answer.startswith(b"HTTP/1.1 503 ")
                assert b"too many connections" in answer
                # Another address still gets in, and is served.
                r, w = await connect(port, "127.0.0.2")
                w.write(LIVEZ)
                assert await status_of(r) == b"200"
                # Two addresses fill the global cap of four: then nobody else.
                fourth = await connect(port, "127.0.0.2")  # held: a dropped writer closes
                third, _ = await connect(port, "127.0.0.3")
                assert (await asyncio.wait_for(third.read(), 60)).startswith(b"HTTP/1.1 503")
                # A held connection closing frees its address's slot.
                held[0][1].close()
                server = runner.server
                assert server is not None
                await async_wait_until(
                    "three open", lambda: len(server.connections) == 3, timeout=60
                )
                r, w = await connect(port)
                w.write(LIVEZ)
                assert await status_of(r) == b"200"
                fourth[1].close()

    run(scenario(), timeout=180)


@pytest.mark.parametrize(
    "sent",
    [b"", b"GET /livez HTTP/1.1\r\nHost: x\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nX-a: "],
    ids=["silent", "half-head", "mid-field"],
)
def test_a_connection_without_a_complete_head_is_closed_at_the_deadline(sent: bytes) -> None:
    async def scenario() -> None:
        async with fakes(FakeBackend("consumer")) as (curl,):
            router = Router(RouterSettings(consumers=(curl,)))
            async with listening(build_app(router), limits(head_timeout_s=1.0)) as (_, port):
                r, w = await connect(port)
                w.write(sent)
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                assert await asyncio.wait_for(r.read(), 60) == b""  # closed, nothing answered
                assert 0.5 < loop.time() - t0 < 30  # at the deadline, not at our read timeout

    run(scenario(), timeout=180)


def test_an_idle_kept_alive_connection_is_closed_and_a_busy_one_is_not() -> None:
    async def scenario() -> None:
        consumer = FakeBackend("consumer", delay_s=1.5)  # answers after the head deadline
        async with fakes(consumer) as (curl,):
            router = Router(RouterSettings(consumers=(curl,)))
            async with listening(build_app(router), limits(head_timeout_s=0.5)) as (_, port):
                r, w = await connect(port)
                body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
                w.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                assert await status_of(r) == b"200"  # a request in flight outlives the deadline
                await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 60)
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                rest = await asyncio.wait_for(r.read(), 60)  # the body, then closed when idle
                assert rest.endswith(b"}")
                assert loop.time() - t0 < 30

    run(scenario(), timeout=180)


def test_too_many_or_too_long_header_fields_are_refused_before_any_handler() -> None:
    async def scenario() -> None:
        async with fakes(FakeBackend("consumer")) as (curl,):
            router = Router(RouterSettings(consumers=(curl,)))
            async with listening(build_app(router), limits(max_headers=8)) as (_, port):
                many = b"".join(b"X-%d: v\r\n" % i for i in range(9))
                long = b"X-long: " + b"v" * 9000 + b"\r\n"
                for extra in (many, long):
                    r, w = await connect(port)
                    w.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
                    assert await status_of(r) == b"400"
                    w.close()
                r, w = await connect(port)
                w.write(
                    b"GET /livez HTTP/1.1\r\nHost: x\r\n" + many[: many.index(b"X-7")] + b"\r\n"
                )
                assert await status_of(r) == b"200"

    run(scenario(), timeout=180)


def test_the_probe_port_answers_while_clients_hold_the_api_port() -> None:
    async def scenario() -> None:
        async with fakes(FakeBackend("consumer")) as (curl,):
            router = Router(RouterSettings(consumers=(curl,)))
            api = build_app(router)
            async with (
                listening(api, limits(max_connections=2)) as (_, api_port),
                listening(build_probe_app(router), limits()) as (_, probe_port),
            ):
                held = [await connect(api_port, f"127.0.0.{i}") for i in (2, 3)]
                refused, _ = await connect(api_port, "127.0.0.4")
                assert (await asyncio.wait_for(refused.read(), 60)).startswith(b"HTTP/1.1 503")
                for path in (b"/livez", b"/health"):
                    r, w = await connect(probe_port)
                    w.write(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
                    assert await status_of(r) == b"200"
                    w.close()
                # The probe port serves the probes only.
                r, w = await connect(probe_port)
                w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                assert await status_of(r) == b"404"
                for _, writer in held:
                    writer.close()

    run(scenario(), timeout=180)


# --- the body memory budget ---------------------------------------------------------


def test_the_budget_refuses_past_a_clients_share_and_past_the_total() -> None:
    budget = BodyBudget(total=10 * MIB, per_client=4 * MIB)
    with budget.lease("a") as a1, budget.lease("a") as a2, budget.lease("b") as b1:
        a1.grow_to(3 * MIB)
        with pytest.raises(Refused) as share:
            a2.grow_to(2 * MIB)  # a holds 3 of its 4
        assert share.value.status == 429
        assert share.value.retry_after
        with pytest.raises(Refused) as never:
            a2.grow_to(5 * MIB)  # more than any share: retrying cannot help
        assert never.value.status == 413
        b1.grow_to(4 * MIB)
        with budget.lease("c") as c1, budget.lease("d") as d1:
            c1.grow_to(3 * MIB)
            with pytest.raises(Refused) as full:
                d1.grow_to(1 * MIB)  # 3 + 4 + 3 = 10 held
            assert full.value.status == 503
            assert full.value.retry_after
        assert budget.held == 7 * MIB
    assert budget.held == 0
    assert not budget._clients


def test_a_parse_reserves_its_cost_before_spending_it() -> None:
    asked: list[int] = []

    def reserve(n: int) -> None:
        asked.append(n)
        if n > 1 * MIB:
            raise Refused(503, "full", "service_unavailable", "body_memory_full")

    image = {"messages": [{"role": "user", "content": [{"image_url": "x" * 300_000}]}]}
    parse(json.dumps(image).encode(), reserve)
    assert 600_000 <= asked[-1] < 700_000  # the bytes and the string, not 4 x the bytes
    # Small nested values cost far more parsed than their text: refused before parsing.
    nested = json.dumps({"prompt": [[]] * 20_000}).encode()
    assert parse_cost(len(nested), nested) > 1 * MIB > 10 * len(nested)
    with pytest.raises(Refused):
        parse(nested, reserve)


def test_the_plan_fits_the_limit_and_follows_it() -> None:
    small = plan(1 << 30, 32, 64 * MIB // 4)
    default = plan(2 << 30, 32, 64 * MIB)
    large = plan(8 << 30, 32, 64 * MIB)
    assert small.max_connections < default.max_connections < large.max_connections
    assert small.body_bytes < default.body_bytes < large.body_bytes
    assert default.max_connections >= 256
    assert default.body_per_client_bytes >= 128 * MIB
    given = plan(2 << 30, 32, 64 * MIB, max_connections=100)
    assert given.max_connections == 100
    assert given.body_bytes > default.body_bytes


def test_bodies_past_the_budget_are_refused_before_they_are_read() -> None:
    async def scenario() -> None:
        consumer = FakeBackend("consumer", delay_s=2.0)
        async with fakes(consumer) as (curl,):
            router = Router(
                RouterSettings(
                    consumers=(curl,),
                    max_body_bytes=2 * MIB,
                    body_memory_bytes=9 * MIB,
                    body_memory_per_client_bytes=5 * MIB,
                )
            )
            async with listening(build_app(router), limits(max_per_address=8)) as (_, port):
                text = json.dumps({"model": "m", "prompt": "x" * (2 * MIB - 100)}).encode()
                head = (
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n" % len(text)
                )
                # One whole body at the slow consumer holds 2 x 2 MiB of the client's 5.
                r1, w1 = await connect(port)
                w1.write(head + text)
                await async_wait_until("held", lambda: router.budget.held >= 3 * MIB, timeout=60)
                # The same client again: its share is held; refused before a byte is read.
                r2, w2 = await connect(port)
                w2.write(head)  # the body never comes
                assert await status_of(r2) == b"429"
                # Another client fits the share, not the total once a third holds it.
                _, w3 = await connect(port, "127.0.0.2")
                w3.write(head)
                await async_wait_until(
                    "two held", lambda: router.budget.held >= 7 * MIB, timeout=60
                )
                r4, w4 = await connect(port, "127.0.0.3")
                w4.write(head)
                assert await status_of(r4) == b"503"
                assert await status_of(r1) == b"200"
                w3.close()  # its unfinished body's reservation is given back
                await async_wait_until("given back", lambda: router.budget.held == 0, timeout=60)
                sample = router.metrics.registry.get_sample_value
                for kind in ("client_body_memory", "body_memory_full"):
                    assert sample("encoderpool_router_errors_total", {"kind": kind}) == 1
                for w in (w1, w2, w4):
                    w.close()

    run(scenario(), timeout=180)


def test_a_compressed_body_is_reserved_as_it_decompresses() -> None:
    """A gzip body declares its compressed length; the router holds what it inflates to."""
    import gzip

    async def scenario() -> None:
        consumer = FakeBackend("consumer")
        async with fakes(consumer) as (curl,):
            router = Router(
                RouterSettings(
                    consumers=(curl,),
                    max_body_bytes=8 * MIB,
                    body_memory_bytes=20 * MIB,
                    body_memory_per_client_bytes=16 * MIB,
                )
            )
            seen: list[int] = []
            grow = router.budget.take

            def take(lease: Any, n: int) -> None:
                grow(lease, n)
                seen.append(lease.held + n)

            router.budget.take = take  # type: ignore[method-assign]
            async with listening(build_app(router), limits()) as (_, port):
                text = json.dumps({"model": "m", "prompt": "x" * (6 * MIB)}).encode()
                packed = gzip.compress(text)
                assert len(packed) < MIB // 10
                r, w = await connect(port)
                w.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(packed), packed)
                )
                assert await status_of(r) == b"200"
                w.close()
            # Reserved as it inflated, before the parse's own reservation (the last one).
            assert seen[0] == 2 * len(packed)
            assert len(seen) >= 3
            assert seen[-2] >= 2 * (len(text) - MIB)

    run(scenario(), timeout=180)

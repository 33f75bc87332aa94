"""Upstream bodies sent as their parts: the bytes on the wire are the joined parts."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from encoderpool_router import parts as parts_mod
from encoderpool_router.body import parse
from encoderpool_router.parts import PartsPayload, payload
from encoderpool_router.producer_request import encoder_request_bytes, encoder_request_parts

from .test_body import PARAMS, chat, long_url


async def _send(data: object) -> tuple[bytes, dict[str, str]]:
    """What a server receives for ``data``: the body and the request's headers."""
    seen: dict[str, object] = {}

    async def handler(request: web.Request) -> web.Response:
        seen["headers"] = dict(request.headers)
        seen["body"] = await request.read()
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/", handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        headers = {"Content-Type": "application/json"}
        async with session.post(server.make_url("/"), data=data, headers=headers) as resp:
            assert resp.status == 200
    return seen["body"], seen["headers"]  # type: ignore[return-value]


def test_a_large_spliced_body_arrives_as_the_joined_parts_with_its_length() -> None:
    url = long_url(3 * parts_mod.PIECE + 123)
    b = parse(json.dumps(chat(url)).encode())
    pieces = b.upstream_parts(PARAMS)
    assert len(pieces) == 2
    assert isinstance(pieces[0], memoryview)
    assert pieces[0].obj is b.raw  # the client's bytes, not a copy
    got, headers = asyncio.run(_send(payload(pieces, "application/json")))
    assert got == b.upstream(PARAMS)
    assert headers["Content-Length"] == str(len(got))
    assert "Transfer-Encoding" not in headers
    assert json.loads(got)["ec_transfer_params"] == PARAMS


def test_a_producer_request_arrives_as_the_joined_parts() -> None:
    url = long_url(parts_mod.PIECE + 7)
    b = parse(json.dumps(chat(url)).encode())
    part = b.data["messages"][1]["content"][1]
    pieces = encoder_request_parts(b.data, part, b.literal)
    assert len(pieces) == 3
    assert isinstance(pieces[1], memoryview)
    assert pieces[1].obj is b.raw
    got, _ = asyncio.run(_send(payload(pieces, "application/json")))
    assert got == encoder_request_bytes(b.data, part, b.literal)
    assert json.loads(got)["messages"][0]["content"][0]["image_url"]["url"] == url


def test_small_bodies_stay_plain_bytes_and_views_of_any_shape_are_sent_whole() -> None:
    assert payload((b'{"a": 1}',), "application/json") == b'{"a": 1}'
    grid = memoryview(bytes(range(256)) * 4).cast("B", (32, 32))  # 2-D: cast to bytes
    p = PartsPayload((b"<", grid, b">"), "application/json")
    assert p.size == 1024 + 2
    got, _ = asyncio.run(_send(p))
    assert got == b"<" + bytes(range(256)) * 4 + b">"


def test_a_length_limit_clips_the_parts() -> None:
    class Sink:
        def __init__(self) -> None:
            self.chunks: list[bytes] = []

        async def write(self, chunk: memoryview) -> None:
            assert chunk.nbytes <= parts_mod.PIECE
            self.chunks.append(bytes(chunk))

    data = bytes(range(256)) * 3000  # 768,000 bytes: three pieces
    p = PartsPayload((data[:1000], memoryview(data)[1000:]), "application/json")
    for limit in (None, 10, 1000, 1001, parts_mod.PIECE + 5, len(data), len(data) + 9):
        sink = Sink()
        asyncio.run(p.write_with_length(sink, limit))  # type: ignore[arg-type]
        assert b"".join(sink.chunks) == data[:limit]

"""Whatever a client sends, the router answers below 500 and logs no traceback.

Seeded random chat bodies (content parts mutated, URLs made of the fragments URL
parsers trip on), raw bytes and odd headers go through the real request path: the
app in process, over fake producers and consumers. A 5xx or a logged traceback names
the seed's body that caused it, so a failure reproduces by running the test again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import random
import socket
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from e2e.media import data_url, image
from encoderpool_router import media, url_guard
from encoderpool_router.app import Router, build_app
from encoderpool_router.config import RouterSettings
from encoderpool_router.content import PartRefused, read_media
from encoderpool_router.protocol import TOO_DEEP
from tests.router.fixtures import FakeBackend, fakes, run, serve

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Loggers whose ERROR records or tracebacks mean the router failed on a request.
WATCHED = ("aiohttp", "encoderpool_router", "asyncio")

# --- what bodies are made of ------------------------------------------------------------

SCHEMES = (
    "http://", "https://", "HTTP://", "data:", "data:image/png;base64,", "ftp://",
    "file:///", "", " http://", "\x00http://", "javascript:", "//", "http:", "http:\\\\",
)  # fmt: skip
HOSTS = (
    "example.com", "EXAMPLE.com.", "[::1]", "[::1", "::1]", "[fe80::1%25eth0]",
    "[::ffff:10.0.0.1]", "127.0.0.1", "0x7f.1", "2130706433", "10.0.0.1", "169.254.169.254",
    "a\uff03b@example.com", "\u00e9.example", "\u4f8b\u3048.\u30c6\u30b9\u30c8", "a..b",
    "x" * 70, "\u00e9" * 70, "user:pw@example.com", "@", "#", "%", "%00", "[v1.x]", "[", "]",
    ":", "localhost", "xn--", "\uff25\uff38\uff21\uff2d\uff30\uff2c\uff25.com", "\ud800",
    "\udfff", "\x00", "ex\x00ample.com", "",
)  # fmt: skip
PATHS = ("/a.png", "/", "?q=1", "#frag", "\\", "/%2e%2e/", "", ":99999/x", ":80/x", "/\ud800")
ODD = (
    "[", "]", "::1", "%", "@", "#", "\uff03", "\ud800", "\udfff", "\ud83d\ude00", "\x00",
    "\\", '"', "\u00e9", "\u2028", "\ufeff", " ", "\t", "\r\n", "data:", "%ff", "\udcff",
)  # fmt: skip
KEYS = (
    "type", "url", "uuid", "image_url", "input_image", "video_url", "audio_url",
    "input_audio", "data", "format", "detail", "text", "image_embeds", "image_pil",
    "tool_reference", "role", "content", "messages", "ec_transfer_params",
)  # fmt: skip
TYPES = (
    "image_url", "input_image", "video_url", "audio_url", "input_audio", "text",
    "input_text", "refusal", "image_embeds", "image_pil", "tool_reference", "thinking",
)  # fmt: skip
PNG = data_url(image(1))
# Past body.LONG_VALUE: such values are cut out of the bytes and put back.
LONG = 70_000


class Bodies:
    """Request bodies from one seed: the same seed, the same bodies."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)  # noqa: S311 - test data, not secrets

    def char(self) -> str:
        low, high = self.r.choice(
            ((0x20, 0x7E), (0, 0x1F), (0x80, 0x2FF), (0x300, 0xFFFF), (0xD800, 0xDFFF),
             (0x10000, 0x10FFFF))
        )  # fmt: skip
        return chr(self.r.randint(low, high))

    def text(self) -> str:
        r = self.r.random()
        if r < 0.3:
            return self.r.choice(("", "m", "user", "a b", "image_url", "data:", "https://x/"))
        if r < 0.6:
            return "".join(self.r.choice(ODD) for _ in range(self.r.randint(1, 4)))
        if r < 0.98:
            return "".join(self.char() for _ in range(self.r.randint(1, 12)))
        return self.r.choice(ODD) * self.r.choice((5000, LONG))

    def url(self) -> str:
        r = self.r.random()
        if r < 0.03:
            return self.r.choice((PNG, "data:image/png;base64," + "A" * LONG))
        if r < 0.06:
            return "https://example.com/" + self.r.choice(("a", "\u00e9", "%")) * LONG
        if r < 0.7:
            pieces = [self.r.choice(SCHEMES), self.r.choice(HOSTS), self.r.choice(PATHS)]
            if self.r.random() < 0.5:
                k = self.r.randrange(3)
                at = self.r.randint(0, len(pieces[k]))
                pieces[k] = pieces[k][:at] + self.r.choice(ODD) + pieces[k][at:]
            return "".join(pieces)
        pools = (SCHEMES, HOSTS, PATHS, ODD)
        return "".join(self.r.choice(self.r.choice(pools)) for _ in range(self.r.randint(1, 6)))

    def value(self, depth: int = 3) -> Any:
        """An arbitrary JSON value."""
        r = self.r.random()
        if depth <= 0 or r < 0.45:
            return self.r.choice(
                (
                    None, True, False, 0, -1, 10**30, 2**63, 1.5, -0.0, 1e308,
                    float("nan"), float("inf"), self.text(), self.url(),
                )
            )  # fmt: skip
        if r < 0.7:
            return [self.value(depth - 1) for _ in range(self.r.randint(0, 4))]
        return {self.key(): self.value(depth - 1) for _ in range(self.r.randint(0, 4))}

    def key(self) -> str:
        return self.r.choice(KEYS) if self.r.random() < 0.7 else self.text()

    def part(self) -> Any:
        """A content part: a well-formed one of some kind, then perhaps mutated."""
        url, r = self.url(), self.r.random()
        kind = self.r.choice(("image_url", "video_url", "audio_url"))
        part: Any
        if r < 0.35:
            part = {"type": kind, kind: {"url": url}}
        elif r < 0.45:
            part = {"type": "input_image", "image_url": url}
        elif r < 0.55:
            part = {kind: self.r.choice((url, {"url": url})), "uuid": self.text()}
        elif r < 0.62:
            data = self.r.choice(("UklGRg==", self.text()))
            part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        elif r < 0.75:
            part = {"type": "text", "text": self.text()}
        elif r < 0.8:
            return self.text()
        else:
            return self.value()
        for _ in range(self.r.choice((0, 0, 1, 2))):
            self.mutate(part)
        return part

    def mutate(self, part: dict[str, Any]) -> None:
        r = self.r.random()
        if r < 0.25:
            part["uuid"] = self.r.choice((self.text(), self.value(1)))
        elif r < 0.45:
            part["type"] = self.r.choice((self.r.choice(TYPES), self.value(1)))
        elif r < 0.6 and part:
            del part[self.r.choice(sorted(part))]
        elif r < 0.8:
            part[self.key()] = self.r.choice((self.url(), self.value(2)))
        else:
            inner = next((v for v in part.values() if isinstance(v, dict)), None)
            if inner is not None:
                inner[self.key()] = self.r.choice((self.url(), self.value(1)))

    def good_part(self) -> Any:
        """A part the router takes: text, or an item it sends to a producer."""
        url = self.r.choice(
            (
                PNG, f"https://example.com/{self.r.randrange(50)}.png",
                "https://xn--9ca.example/a", "http://127.0.0.1/a.png",
                "https://93.184.216.34/a.png", "data:image/png;base64,iVBO",
            )
        )  # fmt: skip
        kind = self.r.choice(("image_url", "image_url", "video_url", "audio_url"))
        return self.r.choice(
            (
                {"type": kind, kind: {"url": url}},
                {"type": "input_image", "image_url": url},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                {"type": "text", "text": "what is this?"},
                "and this?",
            )
        )

    def good_body(self) -> dict[str, Any]:
        """A request the router would serve, with at most one thing spoilt in a part."""
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": [self.good_part() for _ in range(self.r.randint(1, 3))]}
        ]
        if self.r.random() < 0.2:
            messages.insert(0, {"role": "system", "content": "be brief"})
        content = messages[-1]["content"]
        at = self.r.randrange(len(content))
        r = self.r.random()
        if r < 0.3 and isinstance(content[at], dict):
            self.mutate(content[at])
        elif r < 0.5 and isinstance(content[at], dict):
            inner = next((v for v in content[at].values() if isinstance(v, dict)), None)
            if inner is not None and "url" in inner:
                inner["url"] = self.url()
        elif r < 0.6:
            content[at] = self.part()
        body: dict[str, Any] = {"model": "m", "messages": messages}
        if self.r.random() < 0.2:
            body["stream"] = True
        return body

    def message(self) -> Any:
        if self.r.random() < 0.05:
            return self.value(2)
        content: Any
        r = self.r.random()
        if r < 0.75:
            content = [self.part() for _ in range(self.r.randint(0, 4))]
        elif r < 0.9:
            content = self.text()
        else:
            content = self.value(2)
        role = self.r.choice(("user", "user", "assistant", "system", "tool", self.text()))
        return {"role": role, "content": content}

    def body(self) -> Any:
        """A chat request body, or now and then something else entirely."""
        r = self.r.random()
        if r < 0.03:
            return self.value(3)
        if r < 0.5:
            return self.good_body()
        body: dict[str, Any] = {
            "model": self.r.choice(("m", "m", self.text(), self.value(2))),
            "messages": [self.message() for _ in range(self.r.randint(0, 3))],
        }
        if self.r.random() < 0.05:
            body["messages"] = self.value(2)
        for name in (
            "stream", "max_tokens", "mm_processor_kwargs", "media_io_kwargs",
            "ec_transfer_params", "prompt",
        ):  # fmt: skip
            if self.r.random() < 0.08:
                body[name] = self.value(2)
        return body

    def encode(self, body: Any) -> bytes:
        """The body's bytes: mostly plain UTF-8 JSON, else another encoding or spoilt."""
        r = self.r.random()
        if r < 0.6:
            return json.dumps(body).encode()
        text = json.dumps(body, ensure_ascii=False)
        if r < 0.8:  # a lone surrogate becomes bytes that are not UTF-8
            return text.encode("utf-8", "surrogatepass")
        if r < 0.9:
            codec = self.r.choice(("utf-16", "utf-16-le", "utf-32", "utf-8-sig"))
            return text.encode(codec, "surrogatepass")
        raw = bytearray(text.encode("utf-8", "surrogatepass"))
        for _ in range(self.r.randint(1, 3)):
            at = self.r.randrange(len(raw) + 1)
            choice = self.r.random()
            if choice < 0.3:
                del raw[at:]
            elif choice < 0.6:
                raw[at:at] = self.r.choice((b"\xff", b"\xed\xa0\x80", b"\x00", b"\\", b'"'))
            elif raw:
                raw[min(at, len(raw) - 1)] = self.r.randrange(256)
        return bytes(raw)


# Bodies no generator makes by chance: each parser's edge, once.
_PART = '{"type": "image_url", "image_url": {"url": %s}}'


def _chat_with(part: str, extra: str = "") -> bytes:
    head = '{"model": "m", %s"messages": [{"role": "user", "content": [%s]}]}'
    return (head % (extra, part)).encode()


RAW: tuple[bytes, ...] = (
    b"", b" ", b"null", b"[]", b'"x"', b"1", b"{", b"{}", b"}", b"\x00", b"\xef\xbb\xbf{}",
    b"\xef\xbb\xbf" + _chat_with(_PART % json.dumps(PNG)),
    "\ufeff{}".encode("utf-16-le"), "{}".encode("utf-16"), "{}".encode("utf-32"),
    b'{"model": "\xff"}', b'{"model": "\xed\xa0\x80"}', b'{"model": "\\ud800"}',
    b'{"a": 1e999999}', b'{"a": NaN, "b": -Infinity}', b'{"a": ' + b"1" * 5000 + b"}",
    b"[" * 100_000, b'{"a":' * 100_000, b'{"model": ' + b"[" * 900 + b"]" * 900 + b"}",
    _chat_with(_PART % json.dumps(PNG), '"model": ' + "[" * 950 + "]" * 950 + ", "),
    _chat_with(_PART % json.dumps(PNG), '"mm_processor_kwargs": ' + "[" * 950 + "]" * 950
               + ", "),
    _chat_with(_PART % '"http://[::1/a.png"'), _chat_with(_PART % '"\\ud800"'),
    _chat_with(_PART % '"data:\\udfff"'), _chat_with(_PART % '"https://\\ud83d\\ude00.com/"'),
    _chat_with('{"image_url": "https://example.com/a.png", "uuid": "\\udc00"}'),
    _chat_with(_PART % json.dumps("data:image/png;base64," + "A" * LONG)),
    _chat_with(_PART % ('"data:image/png;base64,' + "A" * LONG + '\\u00e9"')),
    _chat_with(_PART % json.dumps(PNG),
               '"ec_transfer_params": {}, "ec_transfer_param\\u0073": 1, '),
    _chat_with(_PART % json.dumps(PNG), '"messages": 1, '),
    _chat_with(_PART % json.dumps(PNG)).replace(b"image_url", b"image_ur\\u006c"),
    _chat_with(_PART % json.dumps(PNG)) + b"\x00",
    _chat_with(_PART % json.dumps(PNG)) + b" {}",
)  # fmt: skip


# --- the router over fakes ------------------------------------------------------------


def _resolve_offline(host: str) -> list[str]:
    """``url_guard._resolve`` without DNS: the real ``getaddrinfo`` takes the name apart (so
    it raises as it does for a lookup), numeric hosts resolve, every name is public."""
    try:
        return [
            str(info[4][0])
            for info in socket.getaddrinfo(host, None, 0, 0, 0, socket.AI_NUMERICHOST)
        ]
    except socket.gaierror:
        return ["93.184.216.34"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(url_guard, "_resolve", _resolve_offline)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    for name in WATCHED:
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def failures(records: Sequence[logging.LogRecord]) -> list[str]:
    """The records that mean the router failed: errors, and anything with a traceback."""
    return [
        f"{r.name} {r.levelname}: {r.getMessage()} {r.exc_info!r}"
        for r in records
        if r.name.split(".")[0] in WATCHED and (r.levelno >= logging.ERROR or r.exc_info)
    ]


SETTINGS: tuple[dict[str, Any], ...] = (
    {},
    {
        "trust_client_media_ids": True,
        "trust_request_mm_kwargs": True,
        "consumer_policy": "media-affinity",
        "reuse_encoded_s": 60.0,
        "allowed_media_domains": ("example.com", "127.0.0.1", "xn--9ca.example"),
    },
    {
        "allow_private_media": True,
        "max_items_per_request": 3,
        "limit_mm_per_prompt": {"image": 2, "audio": 1},
        "dispatch": "when-faster",
        "max_body_bytes": 1 << 20,
    },
)


class Backend(FakeBackend):
    """A fake producer or consumer that refuses a body json cannot read with a 400, as
    vLLM does. The router sends some on by design (``body``: raw control characters in
    a long string value are left for the consumer to find), and the plain fake would
    fail on them with a 500 that is not the router's."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            json.loads(await request.read())
        except ValueError as e:
            return web.json_response({"error": {"message": f"not JSON: {e}"}}, status=400)
        return await super()._chat(request)


@contextlib.asynccontextmanager
async def pool(**settings: Any) -> AsyncIterator[tuple[str, list[FakeBackend]]]:
    """A router over one fake producer and two fake consumers; yields its base URL."""
    backends: list[FakeBackend] = [
        Backend("producer"),
        Backend("consumer-a"),
        Backend("consumer-b"),
    ]
    async with fakes(*backends) as (purl, *curls):
        router = Router(RouterSettings(producers=(purl,), consumers=tuple(curls), **settings))
        async with serve(build_app(router)) as url:
            yield url, backends


def shown(raw: bytes, limit: int = 2000) -> str:
    text = repr(raw)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(raw)} bytes)"


async def check_all(
    url: str,
    backends: list[FakeBackend],
    cases: Sequence[tuple[str, bytes, dict[str, str]]],
    logs: pytest.LogCaptureFixture,
    context: str,
) -> None:
    """Send each (path, body, headers) in turn; fail on the first 5xx or failure logged."""
    async with aiohttp.ClientSession() as session:
        for n, (path, raw, headers) in enumerate(cases):
            before = len(logs.records)
            async with session.post(url + path, data=raw, headers=headers) as r:
                status, answer = r.status, await r.read()
            for b in backends:
                b.seen.clear()  # a long run would keep every body
            bad = failures(logs.records[before:])
            ok = status < 500 and not bad
            assert ok, (
                f"{context}, case {n}: {path} answered {status} {answer[:300]!r}; "
                f"logged {bad}; headers {headers}; body {shown(raw)}"
            )
            if status == 400 and r.content_type == "application/json":
                assert isinstance(json.loads(answer)["error"]["message"], str)


JSON_HEADERS = {"Content-Type": "application/json"}
COUNT = 4000  # bodies per settings: about 2 s each on two cores


@pytest.mark.parametrize("which", range(len(SETTINGS)))
def test_random_bodies_never_fail_the_router(which: int, logs: pytest.LogCaptureFixture) -> None:
    seed = 1000 + which
    gen = Bodies(seed)
    cases = []
    for _ in range(COUNT):
        path = CHAT if gen.r.random() < 0.9 else COMPLETIONS
        cases.append((path, gen.encode(gen.body()), JSON_HEADERS))

    async def scenario() -> None:
        async with pool(**SETTINGS[which]) as (url, backends):
            await check_all(url, backends, cases, logs, f"seed {seed}")

    run(scenario(), timeout=120)


def test_raw_bodies_never_fail_the_router(logs: pytest.LogCaptureFixture) -> None:
    cases = [(path, raw, JSON_HEADERS) for raw in RAW for path in (CHAT, COMPLETIONS)]

    async def scenario() -> None:
        for settings in SETTINGS:
            async with pool(**settings) as (url, backends):
                await check_all(url, backends, cases, logs, f"settings {settings}")

    run(scenario(), timeout=120)


ODD_HEADERS: tuple[dict[str, str], ...] = (
    {},
    {"Content-Type": "text/plain"},
    {"Content-Type": "application/json; charset=latin-1"},
    {"Content-Type": "application/json; charset=utf-16"},
    {"Content-Type": "multipart/form-data; boundary=x"},
    {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "\u00e9/\u00e9"},
    {"x-request-id": ""},
    {"x-request-id": "r" * 4000},
    {"x-request-id": "\u00e9\u00e8"},
    {"x-request-id": "a b\tc"},
    {"Authorization": "Bearer \u00e9"},
    {"Authorization": "Basic"},
    {"Expect": "100-continue"},
    {"Accept-Encoding": "br, gzip, x-unknown"},
    {"Connection": "close"},
)


def test_odd_headers_never_fail_the_router(logs: pytest.LogCaptureFixture) -> None:
    bodies = [b"{}", _chat_with(_PART % json.dumps(PNG)), b"\xff"]
    cases = [
        (CHAT, body, {**JSON_HEADERS, **headers}) for headers in ODD_HEADERS for body in bodies
    ]

    async def scenario() -> None:
        async with pool() as (url, backends):
            await check_all(url, backends, cases, logs, "odd headers")

    run(scenario())


async def send_raw(url: str, request: bytes) -> bytes:
    """``request``, bytes as they are, on a connection of its own; the status line."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()


def request_bytes(fields: Mapping[bytes, bytes | None], body: bytes) -> bytes:
    """A chat POST with the usual fields, ``fields`` put over them (None: left out)."""
    usual: dict[bytes, bytes | None] = {
        b"Host": b"x",
        b"Connection": b"close",
        b"Content-Type": b"application/json",
        b"Content-Length": str(len(body)).encode(),
    }
    head = b"".join(
        k + b": " + v + b"\r\n" for k, v in {**usual, **fields}.items() if v is not None
    )
    return b"POST " + CHAT.encode() + b" HTTP/1.1\r\n" + head + b"\r\n" + body


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


CHUNKED: dict[bytes, bytes | None] = {b"Transfer-Encoding": b"chunked", b"Content-Length": None}
# Well-formed requests aiohttp's client would not send: header bytes that are not UTF-8,
# a body shorter than its Content-Length (the router waits out body_read_timeout_s), a
# body that is not in its Content-Encoding.
RAW_HEADS: tuple[tuple[dict[bytes, bytes | None], bytes], ...] = (
    ({b"x-request-id": b"\xff\xfe"}, _chat_with(_PART % json.dumps(PNG))),
    ({b"x-request-id": b"\xed\xa0\x80"}, _chat_with(_PART % json.dumps(PNG))),
    ({b"x-request-id": b"\xc3\xa9"}, _chat_with(_PART % json.dumps(PNG))),
    ({b"x-request-id": b"r" * 8000}, _chat_with(_PART % json.dumps(PNG))),
    ({b"Authorization": b"Bearer \xff"}, b"{}"),
    ({b"Content-Type": b"application/json; charset=\xff"}, b"{}"),
    ({b"Content-Type": None}, b"{}"),
    ({b"X-Other": b"\x80\xa0"}, b"{}"),
    ({b"Content-Length": b"100"}, b"{}"),
    ({b"Content-Encoding": b"gzip"}, gzip.compress(_chat_with(_PART % json.dumps(PNG)))),
    ({b"Content-Encoding": b"deflate"}, zlib.compress(b"{}")),
    ({b"Content-Encoding": b"x-unknown"}, b"{}"),
    (CHUNKED, _chunked(b"{}")),
    (CHUNKED, _chunked(_chat_with(_PART % json.dumps(PNG)))),
)
# Requests that are not HTTP as it must be written: aiohttp's parser answers them.
MALFORMED: tuple[tuple[dict[bytes, bytes | None], bytes], ...] = (
    ({b"Transfer-Encoding": b"chunked"}, b"{}"),
    ({b"Content-Type\r\nContent-Type": b"application/json"}, b"{}"),
    (CHUNKED, b"zz\r\n{}\r\n0\r\n\r\n"),
    ({b"Content-Length": b"-1"}, b"{}"),
    ({b"No Colon": b"x"}, b"{}"),
    ({b"x-long": b"r" * 9000}, b"{}"),
    ({b"X-Other": b"\x7f"}, b"{}"),
    ({b"Content-Encoding": b"deflate"}, b"{}"),  # not deflate: aiohttp's parser says so
    ({b"Content-Encoding": b"br"}, b"{}"),
)


async def status_of(
    url: str, fields: Mapping[bytes, bytes | None], body: bytes, logs: pytest.LogCaptureFixture
) -> tuple[int, bytes, list[str]]:
    """The status of one raw request, its status line, and the failures logged meanwhile."""
    before = len(logs.records)
    line = await send_raw(url, request_bytes(fields, body))
    await asyncio.sleep(0.05)  # a failure would be logged after the answer
    status = int(line.split()[1]) if line.startswith(b"HTTP/1.") else 0
    return status, line, failures(logs.records[before:])


def test_odd_header_bytes_never_fail_the_router(logs: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with pool(body_read_timeout_s=0.3) as (url, _):
            for fields, body in RAW_HEADS:
                status, line, bad = await status_of(url, fields, body, logs)
                ok = 0 < status < 500 and not bad
                assert ok, f"{fields!r} {body[:100]!r}: {line!r}; logged {bad}"

    run(scenario())


def test_malformed_http_is_a_400() -> None:
    async def scenario() -> None:
        async with pool() as (url, _):
            for fields, body in MALFORMED:
                line = await send_raw(url, request_bytes(fields, body))
                assert line.startswith(b"HTTP/1.0 400 "), f"{fields!r}: {line!r}"

    run(scenario())


def test_malformed_http_logs_no_traceback(logs: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with pool() as (url, _):
            for fields, body in MALFORMED:
                _, line, bad = await status_of(url, fields, body, logs)
                assert not bad, f"{fields!r}: {line!r}; logged {bad}"

    run(scenario())


def test_a_body_not_in_its_gzip_encoding_is_a_400(logs: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with pool() as (url, _):
            status, line, bad = await status_of(url, {b"Content-Encoding": b"gzip"}, b"{}", logs)
            assert status == 400, line
            assert not bad

    run(scenario())


def test_a_token_that_is_not_utf8_is_a_401(logs: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("a-token\n")

    async def scenario() -> None:
        async with pool(auth_token_file=tokens) as (url, _):
            for token in (b"\xff", b"\xed\xa0\x80", b"a-token\xff"):
                fields = {b"Authorization": b"Bearer " + token}
                status, line, bad = await status_of(url, fields, b"{}", logs)
                assert status == 401, line
                assert not bad

    run(scenario())


def _nested(field: str, depth: int) -> bytes:
    return _chat_with(_PART % json.dumps(PNG), f'"{field}": {{"a": {"[" * depth}{"]" * depth}}}, ')


async def parse_limit(url: str, field: str) -> int:
    """The least depth of ``field`` the router refuses as too deep to parse at all."""
    low, high = 1, 1 << 16  # parsed, refused
    async with aiohttp.ClientSession() as session:
        while high - low > 1:
            mid = (low + high) // 2
            async with session.post(url + CHAT, data=_nested(field, mid)) as r:
                answer = await r.read()
            refused = r.status == 400 and json.loads(answer)["error"]["message"] == TOO_DEEP
            low, high = (low, mid) if refused else (mid, high)
    return high


@pytest.mark.parametrize(
    "field",
    [
        "model",
        "mm_processor_kwargs",
        "media_io_kwargs",
    ],
)
def test_nesting_just_short_of_the_parse_limit_is_never_a_500(
    field: str, logs: pytest.LogCaptureFixture
) -> None:
    """A field each producer request copies, nested at each depth just short of where
    json's parser gives up: the body parses, and every later step that writes the field
    again, deeper in the stack, must still not fail."""

    async def scenario() -> None:
        async with pool(trust_request_mm_kwargs=True) as (url, backends):
            limit = await parse_limit(url, field)
            cases = [(CHAT, _nested(field, d), JSON_HEADERS) for d in range(limit - 200, limit)]
            await check_all(url, backends, cases, logs, field)

    run(scenario())


# --- the known cases, one by one ----------------------------------------------------


def _image_at_2(url: str, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    content = [{"type": "text", "text": "look"}, {"type": "text", "text": "here"}, part]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            _image_at_2("http://[::1/a.png"),
            "messages[0].content[2]: the media URL cannot be parsed: Invalid IPv6 URL",
        ),
        (
            _image_at_2("https://a\uff03b@example.com/x.png"),
            "messages[0].content[2]: the media URL cannot be parsed: netloc "
            "'a\uff03b@example.com' contains invalid characters under NFKC normalization",
        ),
        (
            _image_at_2("data:image/png;base64,\ud800"),
            "messages[0].content[2]: the media URL holds a lone surrogate (an unpaired "
            "\\ud800-\\udfff escape), which is not text",
        ),
        (
            _image_at_2("https://\ud800.example/x.png"),
            "messages[0].content[2]: the media URL holds a lone surrogate (an unpaired "
            "\\ud800-\\udfff escape), which is not text",
        ),
        (
            _image_at_2(PNG, uuid="id-\udfff"),
            "messages[0].content[2]: 'uuid' holds a lone surrogate (an unpaired "
            "\\ud800-\\udfff escape), which is not text",
        ),
    ],
    ids=["ipv6", "nfkc", "data-surrogate", "host-surrogate", "uuid-surrogate"],
)
@pytest.mark.parametrize("trust_ids", [False, True])
def test_an_unreadable_url_or_uuid_is_a_400_naming_the_part(
    body: dict[str, Any], message: str, trust_ids: bool, logs: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with (
            pool(trust_client_media_ids=trust_ids) as (url, backends),
            aiohttp.ClientSession() as session,
            session.post(url + CHAT, data=json.dumps(body), headers=JSON_HEADERS) as r,
        ):
            assert r.status == 400
            assert (await r.json())["error"]["message"] == message
            assert [b.seen for b in backends] == [[], [], []]  # nothing went upstream

    run(scenario())
    assert failures(logs.records) == []


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1/a.png",
        "https://a\uff03b@example.com/x.png",
        "data:\ud800",
        "http://\ud800/x",
        "data://[x",
        "http://a..b/x.png",
        "http://" + "\u00e9" * 70 + "/x.png",
    ],
)
def test_the_url_guard_refuses_what_it_cannot_read_and_never_raises(url: str) -> None:
    problem = url_guard.url_problem(url, (), allow_private=False)
    assert problem is not None


def test_the_url_guard_still_passes_good_urls() -> None:
    assert url_guard.url_problem("https://example.com/a.png", (), allow_private=False) is None
    assert url_guard.url_problem(PNG, (), allow_private=False) is None
    assert url_guard.url_problem("https://\u00e9.example/a.png", (), allow_private=False) is None


def test_media_keys_are_total_and_tell_strings_apart() -> None:
    keys = {
        media.media_key({"uuid": "\ud800"}),
        media.media_key({"uuid": "\udfff"}),
        media.media_key({"uuid": "x"}),
        media.media_key({"type": "image_url", "image_url": {"url": "data:\ud800"}}),
        media.media_key({"type": "image_url", "image_url": {"url": "data:\udfff"}}),
    }
    assert len(keys) == 5
    # A valid string's key is its UTF-8's, as before.
    assert media.media_key({"uuid": "\u00e9"}) == media.media_key({"uuid": "\u00e9"})


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": {"data": "UklG\ud800", "format": "wav"}},
        {"type": "input_audio", "input_audio": {"data": "UklG", "format": "w\udc00"}},
    ],
)
def test_inline_audio_with_a_lone_surrogate_is_refused(part: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": [part]}]}
    with pytest.raises(PartRefused, match=r"^messages\[0\]\.content\[0\]: 'input_audio' holds"):
        read_media(body, trust_ids=False)

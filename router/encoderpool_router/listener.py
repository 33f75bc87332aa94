"""The router's listeners: each connection admitted, bounded and timed before aiohttp
parses a byte of it.

What a connection can cost before any handler runs is what its request head costs:
aiohttp keeps an unfinished head (request line, header fields) in memory, and, left
to its defaults, keeps a connection that never finishes one for an hour. So every
listener here:

- caps connections open at once, in all and per peer address, so that one address
  cannot hold the slots everyone else needs (a connection past either cap gets a bare
  503 and is closed before anything of it is read);
- gives each connection ``head_timeout_s`` from its opening, or from its previous
  answer, to deliver a complete request head (aiohttp's keep-alive deadline, which
  data arriving does not extend): a silent, idle or half-sent connection is closed;
- bounds the head: ``MAX_LINE_BYTES`` for the request line, ``MAX_FIELD_BYTES`` for one
  header field (name and value together), ``max_headers`` fields. The worst head a
  connection can hold is therefore known (``worst_head_bytes``), and the connection
  cap times it is part of the router's memory budget (``budget``).

The API port and the probe port are two listeners with caps of their own: clients
can fill the first, never the second, which the kubelet alone calls.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger as server_log
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

# aiohttp's (and nginx's) 8 KiB: a request line or one header field (name and value)
# longer than this is a 400 (431-like) before any handler runs.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190

_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 34\r\n\r\n"
    b"too many connections; retry later\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one listener admits: connections in all and per peer address, the deadline
    for a complete request head, and how many header fields a head may have."""

    max_connections: int
    max_per_address: int
    head_timeout_s: float
    max_headers: int

    def handler_args(self) -> dict[str, Any]:
        """aiohttp's request handler settings for these limits."""
        return {
            # Armed at the connection's opening and after each answer, and not pushed back
            # by data: a complete head must arrive before it, else the connection closes.
            "keepalive_timeout": self.head_timeout_s,
            "max_line_size": MAX_LINE_BYTES,
            "max_field_size": MAX_FIELD_BYTES,
            "max_headers": self.max_headers,
        }


# The probe and metrics ports: the kubelet and a scraper, a few connections each.
INTERNAL_LIMITS = ConnectionLimits(
    max_connections=16, max_per_address=8, head_timeout_s=10.0, max_headers=16
)


def worst_head_bytes(max_headers: int) -> int:
    """The most request-head bytes one connection can make the router hold."""
    return MAX_LINE_BYTES + max_headers * MAX_FIELD_BYTES


class _BadRequests(logging.Filter):
    """aiohttp answers a malformed request (a bad header, a bad length, a body not in
    its encoding) with a 400 itself, and logs it at ERROR with a traceback: noise in the
    router's log, and any client can make it. One line at INFO instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        # A body that fails to decode is also met after the answer, when aiohttp drains
        # what the handler did not read: a RequestPayloadError then.
        client_fault = isinstance(exc, RequestPayloadError) or (
            isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500
        )
        if client_fault:
            record.msg, record.args = "bad HTTP request: %s", (str(exc).replace("\n", " "),)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_BAD_REQUESTS = _BadRequests()


def quiet_bad_requests() -> None:
    """Log malformed requests as one line (``_BadRequests``); idempotent."""
    server_log.addFilter(_BAD_REQUESTS)


class _Refuse(asyncio.Protocol):
    """A connection past a cap: told so, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        transport.write(_REFUSAL)
        transport.close()


class _Gate(asyncio.Protocol):
    """One admitted connection: aiohttp's handler behind a count per peer address.

    The peer's address is known only once the connection is made, so the per-address
    cap is checked there; a refused connection never reaches aiohttp.
    """

    __slots__ = ("_handler", "_listener", "_peer")

    def __init__(self, listener: _Listener) -> None:
        self._listener = listener
        self._handler: RequestHandler | None = None
        self._peer = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        if not self._listener.admit(self._peer):
            self._peer = ""
            _Refuse().connection_made(transport)
            return
        self._handler = self._listener.server()
        self._handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer:
            self._listener.leave(self._peer)
            self._peer = ""
        if self._handler is not None:
            self._handler.connection_lost(exc)
            self._handler = None

    def data_received(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        if self._handler is not None:
            self._handler.eof_received()
        return None

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()


class _Listener:
    """Connections open per peer address, for one listener; an address with none open
    is forgotten, so the table never outgrows the connections."""

    def __init__(self, server: web.Server, limits: ConnectionLimits) -> None:
        self.server = server
        self.limits = limits
        self.open = 0
        self.by_address: dict[str, int] = {}

    def admit(self, address: str) -> bool:
        n = self.by_address.get(address, 0)
        if self.open >= self.limits.max_connections or n >= self.limits.max_per_address:
            return False
        self.by_address[address] = n + 1
        self.open += 1
        return True

    def leave(self, address: str) -> None:
        self.open -= 1
        n = self.by_address[address] - 1
        if n:
            self.by_address[address] = n
        else:
            del self.by_address[address]


async def listen(
    runner: web.BaseRunner, host: str, port: int, limits: ConnectionLimits
) -> asyncio.Server:
    """Serve ``runner``'s application on ``host:port`` within ``limits`` (the runner
    set up with ``limits.handler_args()``). Returns the listening server (close it to
    stop)."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    listener = _Listener(server, limits)
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Gate(listener), host, port, reuse_address=True)


async def start(
    app: web.Application, host: str, port: int, limits: ConnectionLimits
) -> tuple[web.AppRunner, asyncio.Server]:
    """``app`` set up and listening within ``limits``; handlers are cancelled when their
    client leaves (so their upstream requests end)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **limits.handler_args())
    await runner.setup()
    return runner, await listen(runner, host, port, limits)


async def serve(apps: list[tuple[web.Application, int, ConnectionLimits]], host: str) -> None:
    """Run each ``(app, port, limits)`` until SIGTERM or SIGINT, then close the listeners
    and let requests in flight finish (aiohttp's shutdown), as ``web.run_app`` would.
    The first app's cleanup contexts run last, so the others can depend on it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running: list[tuple[web.AppRunner, asyncio.Server]] = []
    try:
        for app, port, limits in apps:
            running.append(await start(app, host, port, limits))
        await stop.wait()
    finally:
        for _, listener in running:
            listener.close()
        for runner, _ in reversed(running):
            await runner.cleanup()

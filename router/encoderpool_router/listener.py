"""The API's listener, with a cap on open connections.

aiohttp bounds what a connection may send (line and header sizes, the body limit)
and the router bounds what it may hold (``shares``), but not how many connections
there are: each holds buffers and a handler whether or not it ever sends a request.
So the router listens itself and answers a connection past ``max_connections`` with
a bare 503 and closes it, before any of its bytes are read.
"""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 34\r\n\r\n"
    b"too many connections; retry later\n"
)


class _Refuse(asyncio.Protocol):
    """A connection past the cap: told so, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_REFUSAL)
        transport.close()


async def listen(
    runner: web.AppRunner, host: str, port: int, max_connections: int
) -> asyncio.Server:
    """Serve ``runner``'s application on ``host:port``, at most ``max_connections`` at once
    (``runner.setup()`` done first). Returns the listening server (close it to stop)."""
    server = runner.server
    assert server is not None, "runner.setup() first"

    def protocol() -> asyncio.BaseProtocol:
        if len(server.connections) >= max_connections:
            return _Refuse()
        return server()

    loop = asyncio.get_running_loop()
    return await loop.create_server(protocol, host, port, reuse_address=True)


async def serve(app: web.Application, host: str, port: int, max_connections: int) -> None:
    """Run ``app`` until SIGTERM or SIGINT, then close the listener and let requests in
    flight finish (aiohttp's shutdown), as ``web.run_app`` would."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    listener = await listen(runner, host, port, max_connections)
    try:
        await stop.wait()
    finally:
        listener.close()
        await runner.cleanup()

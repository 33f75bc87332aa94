"""Sending a request to a consumer, and its answer back to the client.

The consumer is chosen by ``--consumer-policy`` (``policy``). One that fails before
answering (unreachable, timed out, a 5xx) is retried on another, up to
``--consumer-retries`` times, without ``ec_transfer_params``: what the first could not
obtain must not fail the retry (the next one loads what it finds, or encodes). The
answer goes back as it comes: JSON whole when small and passed through when large
(``ANSWER_BUFFER``), SSE chunk by chunk. Once a stream's
headers are sent it is too late to retry: a broken stream ends with an error event.
``accepted`` is called as soon as a consumer's answer is known to be a 2xx (its headers:
a whole JSON answer, or the start of a stream), before the answer is relayed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from encoderpool_router.backends import Backend, BackendSet, Calls
from encoderpool_router.body import ClientBody
from encoderpool_router.config import RouterSettings
from encoderpool_router.metrics import RouterMetrics
from encoderpool_router.parts import payload
from encoderpool_router.policy import ConsumerChoice, choose_consumer, choose_consumer_by_media
from encoderpool_router.protocol import (
    COUNT_TOKENS_PATH,
    INVALID,
    MESSAGES_PATH,
    REQUEST_ID,
    RESPONSES_PATH,
    TOO_DEEP,
    error_response,
)
from encoderpool_router.upstream import JSON, Upstream, UpstreamError

logger = logging.getLogger(__name__)
# A JSON answer is read whole up to this size (so a failed read can be retried), then
# passed through: the router never holds more of one answer.
ANSWER_BUFFER = 256 << 10
_BROKE = "the consumer's stream broke"
# How a stream that broke after its headers ends, in each API's own events (chat's and
# completions': an error chunk and [DONE]).
_BROKEN_EVENTS = {
    RESPONSES_PATH: "event: error\ndata: "
    + json.dumps({"type": "error", "code": "502", "message": _BROKE, "param": None})
    + "\n\n",
    MESSAGES_PATH: "event: error\ndata: "
    + json.dumps({"type": "error", "error": {"type": "api_error", "message": _BROKE}})
    + "\n\n",
}
# Paths whose clients read Anthropic's error shape (the router's own 400, 502, 503).
_ANTHROPIC = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})
_BROKEN_DEFAULT = (
    f"data: {json.dumps({'error': {'message': _BROKE, 'code': 502}})}\n\ndata: [DONE]\n\n"
)


class ClientGone(Exception):
    """The client closed the connection while its stream was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client went away")
        self.response = response


class Relay:
    """The consumer side of the router: the consumers, their choice, the calls to them."""

    def __init__(
        self,
        settings: RouterSettings,
        consumers: BackendSet,
        upstream: Upstream,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.consumers = consumers
        self.upstream = upstream
        self.metrics = metrics
        self.calls = Calls(
            settings.eject_s, metrics.consumers_in_flight, metrics.consumer_total, metrics.error
        )
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.consumer_connect_timeout_s,
            sock_read=settings.consumer_read_timeout_s,
        )

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: ClientBody | None,
        params: dict[str, Any],
        affinity: bytes | None,
        rid: str,
        accepted: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """``body`` (None: a GET) with ``params`` to a consumer, retrying a failure on
        another; the consumer's answer. ``affinity``: the first media item's key (None:
        no media), for ``media-affinity``. ``accepted``: called when a consumer answers
        2xx (once per such answer: with retries, make it idempotent)."""
        try:
            data = body.upstream_parts(params) if body is not None else None
        except RecursionError:  # parsed, but too deep to write again from this stack
            self.metrics.error("bad_request")
            return error_response(400, TOO_DEEP, INVALID, rid, anthropic=path in _ANTHROPIC)
        tried: list[Backend] = []
        attempts = 1 + self.settings.consumer_retries
        last = ""
        for attempt in range(attempts):
            consumer = self.choose(affinity, tried)
            if consumer is None:
                self.metrics.error("consumer_unavailable")
                message = "no consumer is available"
                return error_response(
                    503, message, "service_unavailable", rid, anthropic=path in _ANTHROPIC
                )
            if attempt:
                self.metrics.consumer_retries.inc()
                if body is not None and params:  # a retry goes without params
                    params = {}
                    data = body.upstream_parts()
            tried.append(consumer)
            try:
                return await self._try(
                    request, consumer, path, data, rid, attempt == attempts - 1, accepted
                )
            except UpstreamError as e:
                last = f"{consumer.url}: {e}"
                logger.warning("request %s: consumer %s failed: %s", rid, consumer.url, e)
        # The body names no pod address nor upstream text (the log has both, by request id).
        logger.warning("request %s: no consumer answered; last: %s", rid, last)
        message = f"no consumer answered (request id {rid})"
        return error_response(502, message, "upstream_error", rid, anthropic=path in _ANTHROPIC)

    def choose(self, affinity: bytes | None, tried: list[Backend]) -> Backend | None:
        """The consumer for this attempt, by ``--consumer-policy``; counted by how."""
        how: ConsumerChoice
        if self.settings.consumer_policy == "media-affinity":
            consumer, how = choose_consumer_by_media(
                affinity, self.consumers.backends, self.settings.consumer_load_bound, tried
            )
        else:
            consumer, how = choose_consumer(self.consumers.backends, tried), "least_busy"
        if consumer is not None:
            self.metrics.consumer_choice[how].inc()
        return consumer

    async def _try(
        self,
        request: web.Request,
        consumer: Backend,
        path: str,
        data: Sequence[bytes | memoryview] | None,
        rid: str,
        last_try: bool,
        accepted: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """One attempt on ``consumer``: ``UpstreamError`` when it may be retried (a 5xx is
        passed on as it is on the last try)."""
        with self.calls.track(consumer):
            start = time.perf_counter()
            resp = await self._send(consumer, path, data, rid)
            self.metrics.consumer_first_byte.observe(time.perf_counter() - start)
            try:
                if accepted is not None and 200 <= resp.status < 300:
                    accepted()
                if resp.status >= 500 and not last_try:
                    text = await resp.text(errors="replace")
                    raise UpstreamError("consumer_error", f"HTTP {resp.status}: {text[:200]}")
                return await self._answer(request, resp, rid, path)
            finally:
                resp.close()  # a no-op once fully read; otherwise vLLM sees the disconnect

    async def _send(
        self, consumer: Backend, path: str, data: Sequence[bytes | memoryview] | None, rid: str
    ) -> aiohttp.ClientResponse:
        """The consumer's response, once its headers are in."""
        url = consumer.url + path
        try:
            if data is None:
                return await self.upstream.session.get(
                    url, headers=self.upstream.headers(rid, json_body=False), timeout=self._timeout
                )
            return await self.upstream.session.post(
                url,
                data=payload(data, JSON),  # a large body in pieces, not joined
                headers=self.upstream.headers(rid, json_body=True),
                timeout=self._timeout,
            )
        except TimeoutError:
            raise UpstreamError("consumer_timeout", "no answer in time", eject=True) from None
        except aiohttp.ClientError as e:
            raise UpstreamError("consumer_error", f"unreachable: {e}", eject=True) from None

    async def _answer(
        self, request: web.Request, resp: aiohttp.ClientResponse, rid: str, path: str
    ) -> web.StreamResponse:
        """The consumer's answer as it comes: JSON whole up to ``ANSWER_BUFFER`` and
        passed through beyond it, SSE chunk by chunk."""
        headers = {REQUEST_ID: rid}
        for name in ("Content-Type", "Content-Encoding"):
            if name in resp.headers:
                headers[name] = resp.headers[name]
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return await self._json(request, resp, headers)
        out = web.StreamResponse(status=resp.status, headers=headers)
        out.headers["Cache-Control"] = "no-cache"
        await out.prepare(request)
        while True:
            try:
                chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError) as e:
                # Headers are sent: too late to retry. End the stream with an error event.
                self._broken(rid, e)
                await _write(out, _BROKEN_EVENTS.get(path, _BROKEN_DEFAULT).encode())
                break
            if not chunk:
                break
            await _write(out, chunk)
        await out.write_eof()
        return out

    async def _json(
        self, request: web.Request, resp: aiohttp.ClientResponse, headers: dict[str, str]
    ) -> web.StreamResponse:
        """A JSON answer: read whole when it is small (a failed read can still be retried
        on another consumer), passed through once it passes ``ANSWER_BUFFER`` (a large
        ``n`` or ``prompt_logprobs`` answer is never held whole)."""
        rid = headers[REQUEST_ID]
        length = resp.content_length
        chunks: list[bytes] = []
        size = 0
        try:
            if length is not None and length <= ANSWER_BUFFER:  # the common case, at once
                return web.Response(body=await resp.read(), status=resp.status, headers=headers)
            while size < ANSWER_BUFFER:
                chunk = await resp.content.readany()
                if not chunk:
                    body = b"".join(chunks)
                    return web.Response(body=body, status=resp.status, headers=headers)
                chunks.append(chunk)
                size += len(chunk)
        except TimeoutError:
            raise UpstreamError("consumer_timeout", "read timed out", eject=True) from None
        except aiohttp.ClientError as e:
            raise UpstreamError("consumer_error", f"read failed: {e!r}") from None
        out = web.StreamResponse(status=resp.status, headers=headers)
        if resp.content_length is not None:
            out.content_length = resp.content_length
        await out.prepare(request)
        for chunk in chunks:
            await _write(out, chunk)
        chunks.clear()
        while True:
            try:
                chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError) as e:
                # Headers are sent: the client must see the answer cut, not a short one
                # that looks whole. Dropping the connection says so.
                self._broken(rid, e)
                if request.transport is not None:
                    request.transport.close()
                return out
            if not chunk:
                break
            await _write(out, chunk)
        await out.write_eof()
        return out

    def _broken(self, rid: str, e: BaseException) -> None:
        self.metrics.error("consumer_timeout" if isinstance(e, TimeoutError) else "stream_broken")
        logger.warning("request %s: consumer answer broke: %r", rid, e)


async def _write(out: web.StreamResponse, chunk: bytes) -> None:
    try:
        await out.write(chunk)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        raise ClientGone(out) from None

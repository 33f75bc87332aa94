"""The router's HTTP server: OpenAI endpoints in front of producers and consumers.

Flow for a chat request with media: each item goes alone to a producer
(``max_tokens: 1``), concurrently; their ``ec_transfer_params`` are merged and
set on the original request, which goes to a consumer; the consumer's answer
(JSON or SSE, chunk by chunk) goes back unchanged. A producer that fails only
costs its item a remote encode: the consumer encodes it itself. A consumer that
fails before answering is retried on another one. Handlers run with aiohttp's
handler cancellation on, so a client that disconnects cancels the upstream
requests (closing their connections makes vLLM abort them).

Authentication: with ``--auth-token-file`` every route but the probes' needs one
of the client tokens (``auth.TokenFile``); upstream requests carry the router's own
key (``--backend-api-key``), never the client's ``Authorization``: producers and
consumers answer /v1 only to the router. ``/metrics`` is served on a port of its
own (``metrics_lifespan``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from encoderpool_contracts import EC_TRANSFER_PARAMS, Announcement, raw_announcement
from encoderpool_router.auth import TokenFile
from encoderpool_router.backends import (
    Backend,
    BackendSet,
    EndpointSliceWatcher,
    kube_client,
    producer_groups,
)
from encoderpool_router.body import ClientBody, NotAnObject, parse
from encoderpool_router.config import RouterSettings
from encoderpool_router.content import PartRefused, modality, read_media
from encoderpool_router.media import (
    encoder_request_parts,
    media_key,
    media_url,
    mm_kwargs_problem,
    over_limits,
    url_problem,
)
from encoderpool_router.metrics import RouterMetrics
from encoderpool_router.parts import payload
from encoderpool_router.policy import (
    ConsumerChoice,
    RecentlyEncoded,
    choose_consumer,
    choose_consumer_by_media,
    choose_producer,
)
from encoderpool_router.shares import Shares, client_of

logger = logging.getLogger(__name__)

REQUEST_ID = "x-request-id"
CHAT_PATH = "/v1/chat/completions"
# The router owns this field: a client's is dropped, so nobody outside the pool
# can point a consumer at producer memory or at cache entries of its choosing.
EC_PARAMS = EC_TRANSFER_PARAMS
_JSON = "application/json"
# Idle upstream connections are dropped before vLLM drops them (uvicorn's keep-alive,
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, is 5 s): reusing one that vLLM is closing at that moment
# fails the request ("connection reset"), which ejected a healthy producer or retried a
# consumer without params after every lull of 5-30 s.
UPSTREAM_KEEPALIVE_S = 4.0
_TOO_DEEP = "request body is nested too deeply"
# Open without a client token: what the kubelet's probes call.
PROBE_PATHS = frozenset({"/health", "/livez"})


class ClientGone(Exception):
    """The client closed the connection while its stream was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client went away")
        self.response = response


class UpstreamError(Exception):
    """A backend could not be reached or did not answer usably.

    ``eject``: the backend itself looks down (refused, timed out; a producer's 5xx or
    answer without params), so it is avoided for a while. A consumer's HTTP error and
    a producer's 4xx do not eject: they may be the request's own fault.
    """

    def __init__(self, kind: str, message: str, eject: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.eject = eject


def _error(status: int, message: str, kind: str, rid: str) -> web.Response:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers={REQUEST_ID: rid})


def _over_share(message: str, rid: str) -> web.Response:
    """A 429 for a client past its share: retry in a moment."""
    response = _error(429, f"{message}; retry later", "rate_limit_error", rid)
    response.headers["Retry-After"] = "1"
    return response


class Router:
    """Backends, policy state, metrics and the HTTP session; one per process."""

    def __init__(
        self,
        settings: RouterSettings,
        producers: BackendSet | None = None,
        consumers: BackendSet | None = None,
        metrics: RouterMetrics | None = None,
        resolver: AbstractResolver | None = None,
    ) -> None:
        self.settings = settings
        self._resolver = resolver  # None: aiohttp's default (the system's DNS)
        self.producers = producers or BackendSet("producer", settings.producers)
        # modality -> its producers (all of them, or its group's; none: the consumer encodes)
        self.groups = producer_groups(settings, self.producers)
        self.consumers = consumers or BackendSet("consumer", settings.consumers)
        self.metrics = metrics or RouterMetrics()
        self.watchers: list[EndpointSliceWatcher] = []
        self.recent = (
            RecentlyEncoded(settings.reuse_encoded_s) if settings.reuse_encoded_s else None
        )
        self._session: aiohttp.ClientSession | None = None
        self._producer_timeout = aiohttp.ClientTimeout(total=settings.producer_timeout_s)
        self._consumer_timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.consumer_connect_timeout_s,
            sock_read=settings.consumer_read_timeout_s,
        )
        self._producer_slots = asyncio.Semaphore(settings.max_producer_requests)
        self.shares = Shares(settings.max_requests_per_client, settings.max_items_per_client)
        self.tokens: TokenFile | None = None
        if settings.auth_token_file is not None:
            self.tokens = TokenFile(settings.auth_token_file)
            self.tokens.load()  # ValueError: unreadable or empty, a start-up error
        # What every upstream request carries: the router's key, never the client's.
        self._upstream_auth: dict[str, str] = {}
        if settings.backend_api_key is not None:
            key = settings.backend_api_key.get_secret_value()
            self._upstream_auth = {"Authorization": f"Bearer {key}"}
        for role in (*self.groups.sets, self.consumers):
            role.listeners.append(self._count_backends)
            self._count_backends(role)

    def _count_backends(self, role: BackendSet) -> None:
        self.metrics.backends.labels(role.role).set(len(role))

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the app's startup has not run"
        return self._session

    # --- lifecycle ----------------------------------------------------------------

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """Open the upstream session and start watching EndpointSlices; undo both."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, resolver=self._resolver
            ),
            auto_decompress=False,  # bodies pass through as the backend sent them
            # One session serves every client: a cookie a backend set must never ride
            # along on another client's request (and no jar is consulted per request).
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        tasks: list[asyncio.Task[None]] = []
        kube = None
        if self.settings.discovery:
            kube = kube_client(self.settings.kubeconfig)
            namespace = self.settings.namespace or kube.default_namespace
            if not namespace:
                kube.close()
                raise ValueError("--namespace is required outside a pod (no default namespace)")
            for service, target in (
                *self.groups.services.items(),
                (self.settings.consumer_service, self.consumers),
            ):
                assert service is not None
                w = EndpointSliceWatcher(
                    kube,
                    namespace,
                    service,
                    target,
                    self.settings.endpoint_port_name,
                    pool_uid=self.settings.pool_uid,
                    ignored=self.metrics.slice_ignored,
                )
                self.watchers.append(w)
                tasks.append(asyncio.create_task(w.run(), name=f"watch-{service}"))
        # Everything made at start-up (modules, settings, the Kubernetes client) lives as
        # long as the process: out of the collector's sight, a full collection no longer
        # walks it, which showed as multi-millisecond pauses in the latency tail.
        gc.collect()  # garbage first: what is frozen is never collected
        gc.freeze()
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._session.close()
            if kube is not None:
                kube.close()

    # --- handlers -----------------------------------------------------------------

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With client tokens configured, every route but the probes' needs one (else 401)."""
        if (
            self.tokens is None
            or request.path in PROBE_PATHS
            or self.tokens.accepts(request.headers.get("Authorization"))
        ):
            response: web.StreamResponse = await handler(request)
            return response
        self.metrics.error("unauthorized")
        rid = request.headers.get(REQUEST_ID) or os.urandom(16).hex()
        logger.debug("request %s: %s %s without a valid token", rid, request.method, request.path)
        response = _error(
            401, "a valid bearer token is required (Authorization: Bearer <token>)",
            "authentication_error", rid,
        )  # fmt: skip
        response.headers["WWW-Authenticate"] = 'Bearer realm="encoderpool"'
        return response

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CHAT_PATH, with_body=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Completions carry no media items: straight to a consumer."""
        return await self._handle(request, "/v1/completions", with_body=True)

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/models", with_body=False)

    async def _handle(self, request: web.Request, path: str, with_body: bool) -> web.StreamResponse:
        """Request id, body, remote encoding, forwarding; one status counted per request."""
        rid = request.headers.get(REQUEST_ID) or os.urandom(16).hex()
        code = "500"
        client = client_of(request, by_token=self.tokens is not None)
        if not self.shares.admit(client):
            self.metrics.error("client_requests_limit")
            self.metrics.request(path, "429")
            limit = self.settings.max_requests_per_client
            return _over_share(f"at most {limit} requests in flight per client", rid)
        try:
            response = await self._serve(request, path, with_body, rid, client)
            code = str(response.status)
            return response
        except ClientGone as gone:
            code = "499"  # nginx's "client closed request"
            self.metrics.error("client_disconnect")
            logger.info("request %s: the client went away mid-stream", rid)
            return gone.response
        except asyncio.CancelledError:
            code = "499"
            self.metrics.error("client_disconnect")
            logger.info("request %s: the client went away; upstream work cancelled", rid)
            raise
        except web.HTTPException as e:  # aiohttp answers it (413: a body over the limit)
            code = str(e.status)
            raise
        finally:
            self.shares.leave(client)
            self.metrics.request(path, code)

    async def _serve(
        self, request: web.Request, path: str, with_body: bool, rid: str, client: str
    ) -> web.StreamResponse:
        body: ClientBody | None = None
        params: dict[str, Any] = {}
        affinity: bytes | None = None  # the first media item's key: the consumer's ranking
        if with_body:
            parsed = await self._json_body(request, rid)  # a client's ec_transfer_params dropped
            if isinstance(parsed, web.Response):
                return parsed
            body = parsed
            limits = self.settings
            if refused := mm_kwargs_problem(body.data, limits.trust_request_mm_kwargs):
                self.metrics.error("bad_request")
                return _error(400, refused, "invalid_request_error", rid)
            items: list[dict[str, Any]] = []
            if path == CHAT_PATH:
                try:  # every part as vLLM reads it; media in canonical form, uuids gone
                    read = read_media(body.data, limits.trust_client_media_ids)
                except PartRefused as e:
                    self.metrics.error("bad_request")
                    return _error(400, str(e), "invalid_request_error", rid)
                if read.changed:
                    body.changed()
                items = read.parts
            if too_many := over_limits(
                items, limits.max_items_per_request, limits.limit_mm_per_prompt
            ):
                self.metrics.error("too_many_items")
                return _error(400, too_many, "invalid_request_error", rid)
            if refused := await self._refused_media(items):
                self.metrics.error("media_url_refused")
                return _error(400, refused, "invalid_request_error", rid)
            if items:
                # Computed here, after the uuids went, from what the router read itself:
                # a client steers its request only through the media it sends.
                keys = [media_key(part, body.utf8_of) for part in items]
                affinity = keys[0]
                distinct = len(set(keys))
                if not self.shares.reserve_items(client, distinct):
                    self.metrics.error("client_items_limit")
                    limit = self.settings.max_items_per_client
                    return _over_share(f"at most {limit} media items in flight per client", rid)
                try:
                    params = await self._encode_remotely(body, items, keys, rid)
                finally:
                    self.shares.release_items(client, distinct)
        return await self._forward(request, path, body, params, affinity, rid)

    async def health(self, request: web.Request) -> web.Response:
        """Ready when a consumer is known: producers are an optimisation, consumers are not."""
        producers = sum(len(s) for s in self.groups.sets)
        state = {"producers": producers, "consumers": len(self.consumers)}
        ok = len(self.consumers) > 0
        return web.json_response(
            {"status": "ok" if ok else "no consumers", **state}, status=200 if ok else 503
        )

    async def live(self, request: web.Request) -> web.Response:
        """Liveness: the event loop answers. Never tied to backends: consumers rolling
        must make the router unready (readiness: /health), not restart it."""
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def _read(self, request: web.Request) -> bytes:
        """The body, at most ``max_body_bytes`` (else 413), copied once: aiohttp's
        ``read`` copies a large body twice (into a bytearray, then into bytes)."""
        limit = self.settings.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=length)
        content = request.content
        content.set_read_chunk_size(limit)  # as aiohttp's read: no pause/resume per 64 KiB
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(self.settings.body_read_timeout_s):  # TimeoutError: 408
            while chunk := await content.readany():
                size += len(chunk)
                if size > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
                chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _json_body(self, request: web.Request, rid: str) -> ClientBody | web.Response:
        try:
            raw = await self._read(request)
        except TimeoutError:
            self.metrics.error("body_timeout")
            limit = self.settings.body_read_timeout_s
            response = _error(408, f"request body not received within {limit:g} s", "timeout", rid)
            response.force_close()  # the rest of a slow body is not worth waiting for
            return response
        try:
            return parse(raw)
        except NotAnObject as e:
            self.metrics.error("bad_request")
            return _error(400, str(e), "invalid_request_error", rid)
        except ValueError as e:  # UnicodeDecodeError included
            self.metrics.error("bad_request")
            return _error(400, f"request body is not JSON: {e}", "invalid_request_error", rid)
        except RecursionError:  # json's C parser refuses nesting past the recursion limit
            self.metrics.error("bad_request")
            return _error(400, _TOO_DEEP, "invalid_request_error", rid)

    # --- producers ----------------------------------------------------------------

    async def _refused_media(self, items: list[dict[str, Any]]) -> str | None:
        """Why one of the items' URLs may not be fetched (SSRF guard), or None."""
        settings = self.settings
        for part in items:
            url = media_url(part)
            if url is None or url[:5].lower() == "data:":  # inline: nothing is fetched
                continue
            problem = await asyncio.to_thread(
                url_problem, url, settings.allowed_media_domains, settings.allow_private_media
            )
            if problem:
                return problem
        return None

    async def _encode_remotely(
        self, body: ClientBody, items: list[dict[str, Any]], keys: list[bytes], rid: str
    ) -> dict[str, Any]:
        """Each distinct item (``keys``: their media keys) to a producer, at most
        ``max_encodes_per_request`` at once (a repeated item is encoded once); the merged
        params of those that answered."""
        by_key: dict[bytes, dict[str, Any]] = {}
        for key, part in zip(keys, items, strict=True):
            by_key.setdefault(key, part)
        if len(items) > len(by_key):
            self.metrics.items_by["duplicate"].inc(len(items) - len(by_key))
        if len(by_key) == 1:  # the common case: no semaphore, no gather
            ((key, part),) = by_key.items()
            results = [await self._encode_one(body, part, key, f"{rid}-enc0")]
        else:
            mine = asyncio.Semaphore(self.settings.max_encodes_per_request)

            async def one(i: int, key: bytes, part: dict[str, Any]) -> tuple[str, dict[str, Any]]:
                async with mine:
                    return await self._encode_one(body, part, key, f"{rid}-enc{i}")

            results = await asyncio.gather(
                *(one(i, key, part) for i, (key, part) in enumerate(by_key.items()))
            )
        merged: dict[str, Any] = {}
        for where, params in results:
            self.metrics.items_by[where].inc()
            merged.update(params)
        return merged

    async def _encode_one(
        self, body: ClientBody, part: dict[str, Any], key: bytes, rid: str
    ) -> tuple[str, dict[str, Any]]:
        """One item on one producer: ("remote", its params); ("local", {}) on any failure
        (the consumer encodes it); ("reused", {}) when a producer encoded it moments ago."""
        if self.groups.for_modality(modality(part)) is None:
            return "local", {}  # no producer group for its modality: the consumer encodes it
        if self.recent is not None and self.recent.fresh(key):
            return "reused", {}
        try:  # a slot among all clients' producer requests, or the consumer encodes it
            await asyncio.wait_for(self._producer_slots.acquire(), self.settings.producer_timeout_s)
        except TimeoutError:
            self.metrics.error("producer_saturated")
            return "local", {}
        try:
            return await self._encode_on_producer(body, part, key, rid)
        finally:
            self._producer_slots.release()

    async def _encode_on_producer(
        self, body: ClientBody, part: dict[str, Any], key: bytes, rid: str
    ) -> tuple[str, dict[str, Any]]:
        group = self.groups.for_modality(modality(part))
        backends = group.backends if group is not None else []
        producer = choose_producer(key, backends, self.settings.producer_load_bound)
        if producer is None:
            self.metrics.error("producer_unavailable")
            return "local", {}
        start = time.perf_counter()
        producer.in_flight += 1
        self.metrics.producers_in_flight.inc()
        try:
            params = await self._post_producer(
                producer, encoder_request_parts(body.data, part, body.literal), rid
            )
            if self.recent is not None:
                self.recent.add(key)
            return "remote", params
        except UpstreamError as e:
            self.metrics.error(e.kind)
            if e.eject:
                self._eject(producer)
            logger.warning(
                "request %s: producer %s failed (%s); the consumer encodes the item",
                rid,
                producer.url,
                e,
            )
            return "local", {}
        finally:
            producer.in_flight -= 1
            self.metrics.producers_in_flight.dec()
            self.metrics.producer_latency.observe(time.perf_counter() - start)

    async def _post_producer(
        self, producer: Backend, req: Sequence[bytes | memoryview], rid: str
    ) -> dict[str, Any]:
        try:
            async with self.session.post(
                producer.url + CHAT_PATH,
                data=payload(req, _JSON),  # the client's literal as a view, not joined
                headers={"Content-Type": _JSON, REQUEST_ID: rid, **self._upstream_auth},
                timeout=self._producer_timeout,
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    # A 4xx is the item's (an undecodable image): ejecting the producer
                    # for it would let one client's bad item cost every client its encodes.
                    raise UpstreamError(
                        "producer_error",
                        f"HTTP {resp.status}: {raw[:200]!r}",
                        eject=not 400 <= resp.status < 500,
                    )
        except TimeoutError:
            raise UpstreamError(
                "producer_timeout", f"no answer in {self.settings.producer_timeout_s}s", eject=True
            ) from None
        except aiohttp.ClientError as e:
            raise UpstreamError("producer_error", repr(e), eject=True) from None
        try:
            params = json.loads(raw).get(EC_PARAMS)
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or not params:
            raise UpstreamError(
                "producer_error", f"answer without {EC_PARAMS}: {raw[:200]!r}", eject=True
            )
        self._check_announcements(producer, params, rid)
        return params

    @staticmethod
    def _check_announcements(producer: Backend, params: dict[str, Any], rid: str) -> None:
        """Warn when a producer announces items in a format this router does not know.

        The params still go to the consumer unchanged (it validates them itself, and
        other connectors announce nothing); the warning points at version skew
        between the producer image and the router.
        """
        for mm_hash in params:
            raw = raw_announcement(params, mm_hash)
            if raw is None:
                continue
            try:
                Announcement.parse(raw)
            except ValueError as e:
                logger.warning(
                    "request %s: producer %s: item %r: %s (a producer of another version?)",
                    rid,
                    producer.url,
                    mm_hash[:80],
                    e,
                )

    def _eject(self, backend: Backend) -> None:
        backend.ejected_until = time.monotonic() + self.settings.eject_s

    # --- consumers ----------------------------------------------------------------

    async def _forward(
        self,
        request: web.Request,
        path: str,
        body: ClientBody | None,
        params: dict[str, Any],
        affinity: bytes | None,
        rid: str,
    ) -> web.StreamResponse:
        """Send to a consumer, retrying a failure on another; relay its answer.
        ``affinity``: the first media item's key (None: no media), for media-affinity."""
        try:
            data = body.upstream_parts(params) if body is not None else None
        except RecursionError:  # parsed, but too deep to write again from this stack
            self.metrics.error("bad_request")
            return _error(400, _TOO_DEEP, "invalid_request_error", rid)
        tried: list[Backend] = []
        attempts = 1 + self.settings.consumer_retries
        last = ""
        for attempt in range(attempts):
            consumer = self._choose_consumer(affinity, tried)
            if consumer is None:
                self.metrics.error("consumer_unavailable")
                return _error(503, "no consumer is available", "service_unavailable", rid)
            if attempt:
                self.metrics.consumer_retries.inc()
                if body is not None and params:
                    # What the first consumer could not obtain must not fail the
                    # retry: without params the next one loads what it finds, or encodes.
                    params = {}
                    data = body.upstream_parts()
            tried.append(consumer)
            try:
                return await self._try_consumer(
                    request, consumer, path, data, rid, last_try=attempt == attempts - 1
                )
            except UpstreamError as e:
                self.metrics.error(e.kind)
                if e.eject:
                    self._eject(consumer)
                last = f"{consumer.url}: {e}"
                logger.warning("request %s: consumer %s failed: %s", rid, consumer.url, e)
        # The body names no pod address nor upstream text (the log has both, by request id).
        logger.warning("request %s: no consumer answered; last: %s", rid, last)
        return _error(502, f"no consumer answered (request id {rid})", "upstream_error", rid)

    def _choose_consumer(self, affinity: bytes | None, tried: list[Backend]) -> Backend | None:
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

    async def _try_consumer(
        self,
        request: web.Request,
        consumer: Backend,
        path: str,
        data: Sequence[bytes | memoryview] | None,
        rid: str,
        last_try: bool,
    ) -> web.StreamResponse:
        timeout = self._consumer_timeout
        headers = {REQUEST_ID: rid, **self._upstream_auth}
        start = time.perf_counter()
        consumer.in_flight += 1
        self.metrics.consumers_in_flight.inc()
        try:
            try:
                if data is None:
                    resp = await self.session.get(
                        consumer.url + path, headers=headers, timeout=timeout
                    )
                else:
                    headers["Content-Type"] = _JSON
                    resp = await self.session.post(
                        consumer.url + path,
                        data=payload(data, _JSON),  # a large body in pieces, not joined
                        headers=headers,
                        timeout=timeout,
                    )
            except TimeoutError:
                raise UpstreamError("consumer_timeout", "no answer in time", eject=True) from None
            except aiohttp.ClientError as e:
                raise UpstreamError("consumer_error", f"unreachable: {e}", eject=True) from None
            self.metrics.consumer_first_byte.observe(time.perf_counter() - start)
            try:
                if resp.status >= 500 and not last_try:
                    text = await resp.text(errors="replace")
                    raise UpstreamError("consumer_error", f"HTTP {resp.status}: {text[:200]}")
                return await self._relay(request, resp, rid)
            finally:
                resp.close()  # a no-op once fully read; otherwise vLLM sees the disconnect
        finally:
            consumer.in_flight -= 1
            self.metrics.consumers_in_flight.dec()
            self.metrics.consumer_total.observe(time.perf_counter() - start)

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, rid: str
    ) -> web.StreamResponse:
        """The consumer's answer as it comes: whole for JSON, chunk by chunk for SSE."""
        headers = {REQUEST_ID: rid}
        for name in ("Content-Type", "Content-Encoding"):
            if name in resp.headers:
                headers[name] = resp.headers[name]
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            try:
                data = await resp.read()
            except TimeoutError:
                raise UpstreamError("consumer_timeout", "read timed out", eject=True) from None
            except aiohttp.ClientError as e:
                raise UpstreamError("consumer_error", f"read failed: {e!r}") from None
            return web.Response(body=data, status=resp.status, headers=headers)
        out = web.StreamResponse(status=resp.status, headers=headers)
        out.headers["Cache-Control"] = "no-cache"
        await out.prepare(request)
        while True:
            try:
                chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError) as e:
                # Headers are sent: too late to retry. End the stream with an error event.
                self.metrics.error(
                    "consumer_timeout" if isinstance(e, TimeoutError) else "stream_broken"
                )
                logger.warning("request %s: consumer stream broke: %r", rid, e)
                event = {"error": {"message": "the consumer's stream broke", "code": 502}}
                chunk = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
                await self._write(out, chunk)
                break
            if not chunk:
                break
            await self._write(out, chunk)
        await out.write_eof()
        return out

    @staticmethod
    async def _write(out: web.StreamResponse, chunk: bytes) -> None:
        try:
            await out.write(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            raise ClientGone(out) from None


def build_app(router: Router) -> web.Application:
    """The API application; run it with ``handler_cancellation=True``. No /metrics here:
    ``build_metrics_app`` serves them on their own port."""
    app = web.Application(
        client_max_size=router.settings.max_body_bytes,
        # Without client tokens the middleware would only pass every request through.
        middlewares=[router.authenticate] if router.tokens is not None else [],
    )
    app.cleanup_ctx.append(router.lifespan)
    app.router.add_post(CHAT_PATH, router.chat)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/livez", router.live)
    return app


def build_metrics_app(router: Router) -> web.Application:
    """``/metrics`` alone, for the metrics port."""
    app = web.Application()
    app.router.add_get("/metrics", router.prometheus)
    return app


def metrics_lifespan(
    router: Router, host: str, port: int
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context for the API app that serves ``build_metrics_app`` on ``port``
    for as long as the API app runs (one process, one event loop, two listeners)."""

    async def serve_metrics(app: web.Application) -> AsyncIterator[None]:
        runner = web.AppRunner(build_metrics_app(router), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            yield
        finally:
            await runner.cleanup()

    return serve_metrics

"""The router's HTTP server: its parts wired together, its routes and its lifecycle.

A request's walk (read, classify, admit, encode on producers, relay from a consumer) is
``pipeline``; this module builds the parts it walks over, serves the OpenAI routes, the
probes (also on a port of their own: ``build_probe_app``) and ``/metrics`` (on a port
of its own: ``build_metrics_app``), and checks client tokens (``--auth-token-file``:
every route but the probes' needs one of them).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractResolver
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from encoderpool_router.auth import TokenFile
from encoderpool_router.backends import BackendSet, producer_groups
from encoderpool_router.budget import BodyBudget
from encoderpool_router.config import RouterSettings
from encoderpool_router.discovery import EndpointSliceWatcher, follow
from encoderpool_router.encode import Encoder
from encoderpool_router.listener import quiet_bad_requests
from encoderpool_router.metrics import RouterMetrics
from encoderpool_router.pipeline import ENDPOINTS, Endpoint, Pipeline
from encoderpool_router.protocol import INVALID, PROBE_PATHS, error_response, request_id
from encoderpool_router.relay import Relay
from encoderpool_router.shares import Shares
from encoderpool_router.upstream import Upstream

logger = logging.getLogger(__name__)


class Router:
    """Backends, the upstream session, the request pipeline and metrics; one per process."""

    def __init__(self, settings: RouterSettings, resolver: AbstractResolver | None = None) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self.producers = BackendSet("producer", settings.producers)
        # modality -> its producers (all of them, or its group's; none: the consumer encodes)
        self.groups = producer_groups(settings, self.producers)
        self.consumers = BackendSet("consumer", settings.consumers)
        self.watchers: list[EndpointSliceWatcher] = []
        self.tokens: TokenFile | None = None
        if settings.auth_token_file is not None:
            self.tokens = TokenFile(settings.auth_token_file)
            self.tokens.load()  # ValueError: unreadable or empty, a start-up error
        self.shares = Shares(settings.max_requests_per_client, settings.max_items_per_client)
        memory = settings.memory_plan
        self.budget = BodyBudget(memory.body_bytes, memory.body_per_client_bytes)
        self.upstream = Upstream(settings.backend_api_key, resolver)
        self.encoder = Encoder(
            settings,
            self.groups,
            self.upstream,
            self.metrics,
            consumer_load=lambda: min((b.in_flight for b in self.consumers.backends), default=0),
        )
        self.relay = Relay(settings, self.consumers, self.upstream, self.metrics)
        self.pipeline = Pipeline(
            settings,
            self.metrics,
            self.shares,
            self.budget,
            self.encoder,
            self.relay,
            clients_by_token=self.tokens is not None,
        )
        for role in (*self.groups.sets, self.consumers):
            role.listeners.append(self._count_backends)
            self._count_backends(role)

    def _count_backends(self, role: BackendSet) -> None:
        self.metrics.backends.labels(role.role).set(len(role))

    # --- lifecycle ----------------------------------------------------------------

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """Open the upstream session and follow the Services' EndpointSlices; undo both."""
        self.upstream.open()
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.settings.discovery:
                    assert self.settings.consumer_service is not None
                    targets = [
                        *self.groups.services.items(),
                        (self.settings.consumer_service, self.consumers),
                    ]
                    self.watchers = await stack.enter_async_context(
                        follow(self.settings, targets, self.metrics.slice_ignored)
                    )
                # What start-up made (modules, settings, the Kubernetes client) lives as long
                # as the process: frozen, out of the collector's sight, so a full collection
                # does not walk it (a pause of milliseconds in the latency tail).
                gc.collect()  # garbage first: what is frozen is never collected
                gc.freeze()
                yield
        finally:
            await self.upstream.close()

    # --- routes -------------------------------------------------------------------

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
        rid = request_id(request)
        logger.debug("request %s: %s %s without a valid token", rid, request.method, request.path)
        response = error_response(
            401, "a valid bearer token is required (Authorization: Bearer <token>)",
            "authentication_error", rid,
        )  # fmt: skip
        response.headers["WWW-Authenticate"] = 'Bearer realm="encoderpool"'
        return response

    def serve(self, endpoint: Endpoint) -> Any:
        """The handler of one endpoint: the request walked by the pipeline."""

        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.pipeline.handle(request, endpoint)

        return handler

    async def not_served(self, request: web.Request) -> web.Response:
        """Any other path or method: a 404 (405: a served path, another method) whose
        body lists what the pool serves, so a client sees at once what is missing here
        rather than a bare error from an upstream it cannot see."""
        served = [f"{method} {e.path}" for e, method in ENDPOINTS.items()]
        methods = {m for e, m in ENDPOINTS.items() if e.path == request.path}
        status = 405 if methods else 404
        self.metrics.request("other", str(status))
        rid = request_id(request)
        what = "method" if methods else "path"
        message = (
            f"{request.method} {request.path[:200]}: this {what} is not served by the pool; "
            f"it serves {', '.join(served)}"
        )
        kind = INVALID if methods else "not_found_error"
        response = error_response(status, message, kind, rid)
        if methods:
            response.headers["Allow"] = ", ".join(sorted(methods))
        return response

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


def build_app(router: Router) -> web.Application:
    """The API application; run it with ``handler_cancellation=True``. No /metrics here:
    ``build_metrics_app`` serves them on their own port."""
    quiet_bad_requests()
    app = web.Application(
        client_max_size=router.settings.max_body_bytes,
        # Without client tokens the middleware would only pass every request through.
        middlewares=[router.authenticate] if router.tokens is not None else [],
    )
    app.cleanup_ctx.append(router.lifespan)
    for endpoint, method in ENDPOINTS.items():
        app.router.add_route(method, endpoint.path, router.serve(endpoint))
    app.router.add_get("/health", router.health)
    app.router.add_get("/livez", router.live)
    app.router.add_route("*", "/{path:.*}", router.not_served)  # last: what nothing else took
    return app


def build_metrics_app(router: Router) -> web.Application:
    """``/metrics`` alone, for the metrics port."""
    app = web.Application()
    app.router.add_get("/metrics", router.prometheus)
    return app


def build_probe_app(router: Router) -> web.Application:
    """``/health`` and ``/livez`` alone, for the probe port: outside the API's connection
    caps and the clients' shares, so clients filling the API port do not fail them."""
    app = web.Application()
    app.router.add_get("/health", router.health)
    app.router.add_get("/livez", router.live)
    return app

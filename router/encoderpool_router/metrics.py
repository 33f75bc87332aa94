"""The router's Prometheus metrics, in a registry of its own (one per app, so tests can
run several routers in one process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from encoderpool_contracts.metrics import (
    ROUTER_BACKENDS,
    ROUTER_CONSUMER_LATENCY,
    ROUTER_ERRORS,
    ROUTER_MEDIA_ITEMS,
    ROUTER_REQUESTS,
    family,
)
from encoderpool_router.discovery import IGNORED_REASONS
from encoderpool_router.policy import CONSUMER_CHOICES
from encoderpool_router.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    COUNT_TOKENS_PATH,
    DETOKENIZE_PATH,
    MESSAGES_PATH,
    MODELS_PATH,
    RESPONSES_PATH,
    TOKENIZE_PATH,
    VERSION_PATH,
)

# The 5xx codes the router answers with itself (its own fault, no consumer, a consumer's
# fault passed on), pre-created per endpoint with 200.
OUTAGE_CODES = ("200", "500", "502", "503")
# The ``endpoint`` label's values: each path served, and ``other`` for every request to a
# path the router does not serve (its 404s; never the path itself, which a client picks).
ENDPOINT_LABELS = (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MODELS_PATH,
    RESPONSES_PATH,
    MESSAGES_PATH,
    COUNT_TOKENS_PATH,
    TOKENIZE_PATH,
    DETOKENIZE_PATH,
    VERSION_PATH,
)

# Every error kind the router counts; pre-created so dashboards see zeros, not gaps.
ERROR_KINDS = (
    "unauthorized",  # no or a wrong client bearer token (--auth-token-file): 401
    "bad_request",  # not a JSON object, nested too deeply, a part that cannot be read: 400
    "body_timeout",  # the body took longer than --body-read-timeout-s to arrive: 408
    "client_requests_limit",  # a client past --max-requests-per-client: 429
    "client_items_limit",  # a client past --max-items-per-client: 429
    "client_body_memory",  # a client holding its share of --body-memory-bytes: 429
    "body_memory_full",  # the router holds --body-memory-bytes of bodies: 503
    "body_memory",  # a body that would pass any client's share once parsed: 413
    "too_many_items",  # more media items than --max-items-per-request / --limit-mm-per-prompt
    "media_url_refused",  # a media URL of another scheme, host or a private address: 400
    "producer_saturated",  # no producer slot free within --producer-timeout-s (consumer encodes)
    "producer_unavailable",  # no producer known: items encoded by the consumer
    "producer_timeout",  # a producer took longer than --producer-timeout-s
    "producer_error",  # a producer failed, refused the pool's key (401/403), or answered
    # without ec_transfer_params; the producer is ejected
    "producer_refused_item",  # a producer answered 4xx for the item itself (not ejected)
    "consumer_unavailable",  # no consumer known: the client gets 503
    "consumer_error",  # a consumer could not be reached or answered 5xx
    "consumer_timeout",  # a consumer was silent longer than its timeouts
    "stream_broken",  # a consumer's stream ended early; the client got an error event
    "client_disconnect",  # the client went away; upstream work was cancelled
)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    """Requests, items encoded remotely vs locally, latencies, errors by kind, backends."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            family(ROUTER_REQUESTS),
            "Client requests by endpoint and HTTP status returned.",
            ["endpoint", "code"],
            registry=r,
        )
        self.items = Counter(
            family(ROUTER_MEDIA_ITEMS),
            "Media items by where they were encoded: remote (a producer), local (the "
            "consumer), reused (a producer encoded it moments ago; not sent again), duplicate "
            "(the same item again in one request; encoded once).",
            ["encoded"],
            registry=r,
        )
        self.producer_latency = Histogram(
            "encoderpool_router_producer_latency_seconds",
            "Time of one producer request (one item), successful or not.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.consumer_latency = Histogram(
            ROUTER_CONSUMER_LATENCY,
            "Consumer time: to its response headers (first_byte) and to its last byte (total).",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(family(ROUTER_ERRORS), "Errors by kind.", ["kind"], registry=r)
        self.consumer_retries = Counter(
            "encoderpool_router_consumer_retries",
            "Consumer requests retried on another consumer.",
            registry=r,
        )
        self.consumer_choices = Counter(
            "encoderpool_router_consumer_choices",
            "Consumers chosen (retries included), by how: least_busy (--consumer-policy "
            "least-busy); with media-affinity: affinity (the first media item's own consumer), "
            "next_ranked (a later one in its ranking: the first was busy, ejected or tried), "
            "over_bound (all at --consumer-load-bound: the least busy), no_media (text only: "
            "the least busy).",
            ["choice"],
            registry=r,
        )
        self.endpointslices_ignored = Counter(
            "encoderpool_router_endpointslices_ignored",
            "EndpointSlice events (and Service reads) not used for backends, by reason: "
            "not_managed (not made by the EndpointSlice controller), not_owned (not owned by "
            "the Service's uid), service_not_owned (the Service is not the pool's), "
            "service_unreadable (no get on the Service: nothing can be checked).",
            ["reason"],
            registry=r,
        )
        self.backends = Gauge(ROUTER_BACKENDS, "Backends known, by role.", ["role"], registry=r)
        self.in_flight = Gauge(
            "encoderpool_router_in_flight",
            "Upstream requests in flight, by role.",
            ["role"],
            registry=r,
        )
        # Children bound once (pre-created, so dashboards see zeros, not gaps): ``labels()``
        # takes a lock and hashes the label values on every call, which the hot path skips.
        self._errors = {kind: self.errors.labels(kind) for kind in ERROR_KINDS}
        self.items_by = {
            where: self.items.labels(where) for where in ("remote", "local", "reused", "duplicate")
        }
        self.consumer_choice = {c: self.consumer_choices.labels(c) for c in CONSUMER_CHOICES}
        for reason in IGNORED_REASONS:
            self.endpointslices_ignored.labels(reason)
        self.producers_in_flight = self.in_flight.labels("producer")
        self.consumers_in_flight = self.in_flight.labels("consumer")
        self.consumer_first_byte = self.consumer_latency.labels("first_byte")
        self.consumer_total = self.consumer_latency.labels("total")
        # The answers of an outage, per endpoint, from the start: a child born at its first
        # request counts every request before its first scrape nowhere in rate(), so a
        # burst of 503s (no consumer) would never reach the 5xx alert.
        self._requests: dict[tuple[str, str], Any] = {
            (path, code): self.requests.labels(path, code)
            for path in ENDPOINT_LABELS
            for code in OUTAGE_CODES
        }
        self._requests[("other", "404")] = self.requests.labels("other", "404")

    def slice_ignored(self, reason: str) -> None:
        """Count an EndpointSlice (or Service) the watchers would not use (any thread)."""
        self.endpointslices_ignored.labels(reason).inc()

    def error(self, kind: str) -> None:
        self._errors[kind].inc()  # KeyError: a kind missing from ERROR_KINDS

    def request(self, endpoint: str, code: str) -> None:
        """Count one client request (endpoints and codes are few: children are kept)."""
        child = self._requests.get((endpoint, code))
        if child is None:
            child = self._requests[(endpoint, code)] = self.requests.labels(endpoint, code)
        child.inc()

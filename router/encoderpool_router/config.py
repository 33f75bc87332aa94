"""``RouterSettings``: the router's configuration, from flags and ``ENCODERPOOL_ROUTER_*``.

One pydantic model so that flags, environment (what the operator renders into
the router's Deployment) and tests validate the same way, and every bad value
fails at start-up with a message naming the flag and what to do.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from encoderpool_contracts.report import MAX_ENCODE_SECONDS, MODALITY_PATTERN
from encoderpool_contracts.router_args import ENV_PREFIX, flag
from encoderpool_router.budget import MemoryPlan, plan
from encoderpool_router.listener import ConnectionLimits

# Service names are DNS-1035 labels; namespaces DNS-1123 labels (Kubernetes' rules).
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MODALITY = re.compile(MODALITY_PATTERN)

Seconds = Annotated[float, Field(gt=0, le=86400)]
UrlList = Annotated[tuple[str, ...], NoDecode]
# Modalities the router can route to a producer group (``content.modality``'s values).
GROUP_MODALITIES = ("image", "video", "audio")


class RouterSettings(BaseSettings):
    """Everything the router needs; either static backends or two Services to watch."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    host: str = Field(default="0.0.0.0", description="Address to listen on.")  # noqa: S104
    port: Annotated[int, Field(ge=1, le=65535)] = Field(default=8000, description="Port.")
    metrics_port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=9090,
        description="Port of /metrics (Prometheus), apart from the API: scrapers never "
        "need to reach the API, clients never the metrics.",
    )
    auth_token_file: Path | None = Field(
        default=None,
        description="File of accepted client bearer tokens, one per line (a mounted Secret); "
        "re-read when it changes. Set: every request but /health and /livez needs "
        "`Authorization: Bearer <token>`, else 401. Unset: no client authentication.",
    )
    backend_api_key: SecretStr | None = Field(
        default=None,
        description="Key sent to producers and consumers as `Authorization: Bearer` (their "
        "vLLM --api-key / VLLM_API_KEY). Prefer the variable to the flag: a flag shows in "
        "the process list.",
    )
    producers: UrlList = Field(
        default=(), description="Static producer base URLs (http://host:port), for local runs."
    )
    consumers: UrlList = Field(
        default=(), description="Static consumer base URLs (http://host:port), for local runs."
    )
    producer_service: str | None = Field(
        default=None, description="Service whose EndpointSlices list the producers."
    )
    consumer_service: str | None = Field(
        default=None, description="Service whose EndpointSlices list the consumers."
    )
    producers_by_modality: Annotated[dict[str, UrlList], NoDecode] = Field(
        default_factory=dict,
        description="Static producer groups: base URLs per modality, as JSON, e.g. "
        '{"image": ["http://127.0.0.1:8001"], "video": ["http://127.0.0.1:8002"]}. Each item '
        "goes to its modality's producers; a modality not listed is encoded by the consumer. "
        "Instead of --producers.",
    )
    producer_services_by_modality: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Producer groups from EndpointSlices: the Service of each modality's "
        'group, as JSON, e.g. {"image": "pool-producer-images"}; a modality not listed is '
        "encoded by the consumer. Instead of --producer-service.",
    )
    namespace: str | None = Field(
        default=None,
        description="Namespace of the Services; defaults to the pod's own (or the "
        "kubeconfig context's).",
    )
    kubeconfig: str | None = Field(
        default=None,
        description="Kubeconfig for local runs; in a pod the ServiceAccount is used.",
    )
    pool_uid: str | None = Field(
        default=None,
        description="uid of the EncoderPool (the operator sets it): the watched Services "
        "count only when that pool controls them. EndpointSlices count only when the "
        "EndpointSlice controller made them for the Service's uid, either way.",
    )
    endpoint_port_name: str | None = Field(
        default=None,
        description="EndpointSlice port to use; unset: the slice's only port.",
    )
    producer_timeout_s: Seconds = Field(
        default=30.0,
        description="Longest wait for one producer; past it the consumer encodes the item.",
    )
    consumer_connect_timeout_s: Seconds = Field(
        default=5.0, description="Longest wait to connect to a consumer before retrying."
    )
    consumer_read_timeout_s: Seconds = Field(
        default=600.0, description="Longest silence from a consumer (between bytes)."
    )
    consumer_retries: Annotated[int, Field(ge=0, le=3)] = Field(
        default=1, description="Retries of a failed consumer request, each on another consumer."
    )
    producer_load_bound: Annotated[int, Field(ge=1, le=10000)] = Field(
        default=4,
        description="In-flight items at which an item's preferred producer yields to "
        "the next one in the item's ranking.",
    )
    dispatch: Literal["always", "when-faster"] = Field(
        default="always",
        description="Where a media item is encoded. always: on a producer whenever one of "
        "its group is ready. when-faster: on a producer only when its expected wait there, "
        "(the group's items per ready producer + 1) x the producers' measured seconds per "
        "item, hop included, is shorter than the delay the consumer's own encode would "
        "cause, --encode-seconds x (1 + the consumer's requests in flight): an idle "
        "consumer encodes the item itself and no hop is paid (docs/router.md).",
    )
    encode_seconds: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict,
        description="Seconds one warm encode of one item takes, per modality, as JSON, e.g. "
        '{"image": 0.08}: the width Job\'s measurement (status.encodeSeconds), which the '
        "operator passes with when-faster. It prices the consumer's own encode and is the "
        "producers' time per item (plus 20 ms for the hop) until they answer. A modality "
        "left out is taken to encode as fast as its producers answer: the decision then "
        "compares queues.",
    )
    consumer_policy: Literal["least-busy", "media-affinity"] = Field(
        default="least-busy",
        description="How a request's consumer is chosen. least-busy: fewest requests in "
        "flight. media-affinity: rank consumers by rendezvous hashing of the request's "
        "first media item, so repeats of an image (and later turns of a chat) reach the "
        "consumer whose prefix and processor caches hold it; text-only requests go to the "
        "least busy.",
    )
    consumer_load_bound: Annotated[int, Field(ge=1, le=10000)] = Field(
        default=16,
        description="media-affinity: requests in flight at which a request's preferred "
        "consumer yields to the next one in the request's ranking.",
    )
    reuse_encoded_s: Annotated[float, Field(ge=0, le=86400)] = Field(
        default=0.0,
        description="For this long after a producer encoded an item, repeats of it skip the "
        "producer and the consumer finds the entry by hash. Only for the sharedVolume "
        "transport; 0 (off) for rdma, whose consumers need the producer's params.",
    )
    eject_s: Annotated[float, Field(ge=0, le=3600)] = Field(
        default=5.0, description="How long a backend that failed to answer is avoided."
    )
    max_body_bytes: Annotated[int, Field(ge=1 << 10, le=1 << 31)] = Field(
        default=64 << 20, description="Largest request body accepted from a client."
    )
    max_items_per_request: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=32,
        description="Most media items one request may carry; more is a 400, before any "
        "producer is asked.",
    )
    limit_mm_per_prompt: Annotated[dict[str, Annotated[int, Field(ge=0, le=1024)]], NoDecode] = (
        Field(
            default_factory=dict,
            description="Most items per modality in one request, as vLLM's --limit-mm-per-prompt "
            '(JSON, e.g. {"image": 4}); more is a 400 before any fan-out.',
        )
    )
    allowed_media_domains: UrlList = Field(
        default=(),
        description="Hosts media URLs may name, exactly (comma-separated); empty: any public host.",
    )
    allow_private_media: bool = Field(
        default=False,
        description="Let media URLs name private, loopback or link-local addresses "
        "(otherwise a 400: they reach services inside the cluster).",
    )
    trust_client_media_ids: bool = Field(
        default=False,
        description="Keep the uuid a client gives a media item. vLLM then keys the item's "
        "embedding by it, so one client could have another's request answered with its "
        "media: only for single-tenant pools. Off: uuids are dropped (vLLM hashes content).",
    )
    trust_request_mm_kwargs: bool = Field(
        default=False,
        description="Pass requests' mm_processor_kwargs and media_io_kwargs on (bounded in "
        "size); the vLLM pods must run with --trust-request-mm-kwargs too. Off: a request "
        "with either is a 400, as vLLM itself answers it, before any producer is asked.",
    )
    max_encodes_per_request: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=8, description="Producer requests one client request may have in flight."
    )
    max_requests_per_client: Annotated[int, Field(ge=1, le=100000)] = Field(
        default=64,
        description="Requests one client may have in flight (a client is its bearer token "
        "with --auth-token-file, else its address); past it: 429.",
    )
    max_items_per_client: Annotated[int, Field(ge=1, le=100000)] = Field(
        default=64,
        description="Distinct media items one client may have at the producers at once; a "
        "request that would pass it is a 429 (never half-encoded). At least "
        "--max-items-per-request.",
    )
    probe_port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=8081,
        description="Port of /health and /livez for the kubelet, apart from the API: "
        "clients filling the API port's connections cannot fail the probes.",
    )
    memory_limit_bytes: Annotated[int, Field(ge=256 << 20, le=1 << 40)] = Field(
        default=2 << 30,
        description="The router container's memory limit (the operator passes limits.memory). "
        "The connection cap and the body memory budget left unset are derived from it so "
        "that together they stay under 75% of it (docs/router.md).",
    )
    max_connections: Annotated[int, Field(ge=1, le=1000000)] | None = Field(
        default=None,
        description="Client connections open at once (each carries at most one request at "
        "a time); one past it is answered 503 and closed before anything is read. Unset: "
        "derived from --memory-limit-bytes.",
    )
    max_connections_per_address: Annotated[int, Field(ge=1, le=1000000)] = Field(
        default=128,
        description="Client connections one peer address may have open at once (twice "
        "--max-requests-per-client's default: each request in flight, and as many kept "
        "alive); past it: 503 and closed. Behind a proxy or SNAT every client shares its "
        "address: raise it there, and turn on client tokens for per-client shares.",
    )
    head_timeout_s: Seconds = Field(
        default=10.0,
        description="Time a connection has, from its opening or its previous answer, to "
        "send a complete request head; a connection silent, idle or mid-head that long is "
        "closed.",
    )
    max_headers: Annotated[int, Field(ge=8, le=256)] = Field(
        default=32,
        description="Header fields one request may carry (each at most 8190 bytes, name "
        "and value); more is a 400 before any handler runs.",
    )
    body_memory_bytes: Annotated[int, Field(ge=1 << 20, le=1 << 40)] | None = Field(
        default=None,
        description="Router memory that request bodies being read, parsed and relayed may "
        "take, in all; a request that would pass it is a 503 (Retry-After) before its body "
        "is read. Unset: derived from --memory-limit-bytes.",
    )
    body_memory_per_client_bytes: Annotated[int, Field(ge=1 << 20, le=1 << 40)] | None = Field(
        default=None,
        description="Each client's share of --body-memory-bytes; past it: 429 (Retry-After) "
        "before the body is read. Unset: a quarter of the body budget.",
    )
    body_read_timeout_s: Seconds = Field(
        default=60.0,
        description="Longest time to receive a request body; a client that sends slower "
        "gets a 408 and its slot back.",
    )
    max_producer_requests: Annotated[int, Field(ge=1, le=100000)] = Field(
        default=256,
        description="Producer requests in flight across all clients; an item that waits past "
        "--producer-timeout-s for a slot is encoded by the consumer instead.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Log level of the router's own loggers."
    )

    @field_validator("producers", "consumers", "allowed_media_domains", mode="before")
    @classmethod
    def _split_lists(cls, v: Any) -> Any:
        """Accept ``a,b`` (flags, environment) as well as a list."""
        return _split(v)

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _json_limits(cls, v: Any) -> Any:
        """Flags and environment give the limits as JSON text."""
        if isinstance(v, str):
            try:
                return json.loads(v) if v.strip() else {}
            except ValueError as e:
                raise ValueError(f'not JSON like {{"image": 4}}: {e}') from None
        return v

    @field_validator("encode_seconds", mode="before")
    @classmethod
    def _json_seconds(cls, v: Any) -> Any:
        """Flags and environment give the times as JSON text."""
        if isinstance(v, str):
            try:
                return json.loads(v) if v.strip() else {}
            except ValueError as e:
                raise ValueError(f'not JSON like {{"image": 0.08}}: {e}') from None
        return v

    @field_validator("encode_seconds")
    @classmethod
    def _seconds(cls, v: dict[str, float]) -> dict[str, float]:
        """Any modality name is taken (a router routes those it knows): the operator may
        know modalities an older router does not; every time must be a real one."""
        for modality, seconds in v.items():
            if not _MODALITY.match(modality):
                raise ValueError(f"{modality!r} is not a modality name like image")
            if not 0 < seconds <= MAX_ENCODE_SECONDS:
                raise ValueError(
                    f"{modality}: {seconds} s; give seconds above 0, at most {MAX_ENCODE_SECONDS}"
                )
        return v

    @field_validator("producers_by_modality", "producer_services_by_modality", mode="before")
    @classmethod
    def _json_groups(cls, v: Any, info: ValidationInfo) -> Any:
        """Flags and environment give the groups as JSON text; URL lists may be ``a,b``."""
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else {}
            except ValueError as e:
                raise ValueError(f'not JSON like {{"image": ...}}: {e}') from None
        if isinstance(v, dict):
            unknown = sorted(str(m) for m in v if m not in GROUP_MODALITIES)
            if unknown:
                raise ValueError(f"unknown modality {unknown}: give {', '.join(GROUP_MODALITIES)}")
            if info.field_name == "producers_by_modality":
                return {m: _split(u) for m, u in v.items()}
        return v

    @field_validator("producers_by_modality")
    @classmethod
    def _group_urls(cls, v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        empty = sorted(m for m, urls in v.items() if not urls)
        if empty:
            raise ValueError(
                f"{empty} list no producer: leave a modality out to have it encoded by the consumer"
            )
        return {m: _urls(urls) for m, urls in v.items()}

    @field_validator("producer_services_by_modality")
    @classmethod
    def _group_services(cls, v: dict[str, str]) -> dict[str, str]:
        for service in v.values():
            _service(service)
        return v

    @field_validator("producers", "consumers")
    @classmethod
    def _backend_urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _urls(v)

    @field_validator("producer_service", "consumer_service")
    @classmethod
    def _service_name(cls, v: str | None) -> str | None:
        return v if v is None else _service(v)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str | None) -> str | None:
        if v is not None and not _DNS1123.match(v):
            raise ValueError(f"{v!r} is not a namespace name (lowercase DNS-1123 label)")
        return v

    @field_validator("backend_api_key")
    @classmethod
    def _key(cls, v: SecretStr | None) -> SecretStr | None:
        key = None if v is None else v.get_secret_value()
        if key is not None and (not key or key != key.strip()):
            raise ValueError("must be a non-empty key without surrounding whitespace")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> RouterSettings:
        if self.max_items_per_client < self.max_items_per_request:
            raise ValueError(
                f"--max-items-per-client ({self.max_items_per_client}) must be at least "
                f"--max-items-per-request ({self.max_items_per_request}), or no request "
                "with that many items could ever be served"
            )
        if self.producers and self.producers_by_modality:
            raise ValueError(
                "give either --producers (one set for every modality) or "
                "--producers-by-modality (producer groups), not both"
            )
        if self.producer_service is not None and self.producer_services_by_modality:
            raise ValueError(
                "give either --producer-service (one Service for every modality) or "
                "--producer-services-by-modality (producer groups), not both"
            )
        static = bool(self.producers or self.producers_by_modality or self.consumers)
        services = (
            self.producer_service is not None
            or bool(self.producer_services_by_modality)
            or self.consumer_service is not None
        )
        if static and services:
            raise ValueError(
                "give either --producers/--consumers (static) or "
                "--producer-service/--consumer-service (EndpointSlices), not both"
            )
        if not static and not services:
            raise ValueError(
                "no backends: give --consumers (and --producers) for a local run, or "
                "--producer-service and --consumer-service to follow EndpointSlices"
            )
        if static and not self.consumers:
            raise ValueError("--consumers is empty: the router needs at least one consumer")
        grouped = bool(self.producer_services_by_modality)
        if services and (
            (self.producer_service is None and not grouped) or self.consumer_service is None
        ):
            raise ValueError(
                "give both --producer-service and --consumer-service (or "
                "--producer-services-by-modality, for producer groups)"
            )
        ports = {"--port": self.port, "--metrics-port": self.metrics_port}
        ports["--probe-port"] = self.probe_port
        if len(set(ports.values())) != len(ports):
            given = ", ".join(f"{k} {v}" for k, v in ports.items())
            raise ValueError(f"{given}: give three different ports")
        self.memory_plan  # noqa: B018  (ValueError when the budgets cannot fit the limit)
        return self

    @cached_property
    def memory_plan(self) -> MemoryPlan:
        """The connection cap and body budget: as given, or derived from the memory limit."""
        return plan(
            self.memory_limit_bytes,
            self.max_headers,
            self.max_body_bytes,
            self.max_connections,
            self.body_memory_bytes,
            self.body_memory_per_client_bytes,
        )

    def api_limits(self) -> ConnectionLimits:
        """What the API port admits."""
        return ConnectionLimits(
            max_connections=self.memory_plan.max_connections,
            max_per_address=self.max_connections_per_address,
            head_timeout_s=self.head_timeout_s,
            max_headers=self.max_headers,
        )

    @property
    def discovery(self) -> bool:
        """True when backends come from EndpointSlices."""
        return self.consumer_service is not None

    @property
    def grouped(self) -> bool:
        """True when producers come in groups, one per modality (or several modalities)."""
        return bool(self.producers_by_modality or self.producer_services_by_modality)


def _split(v: Any) -> Any:
    """``a,b`` as a tuple; anything else as it is."""
    if isinstance(v, str):
        return tuple(u.strip() for u in v.split(",") if u.strip())
    return v


def _urls(v: tuple[str, ...]) -> tuple[str, ...]:
    out = tuple(backend_url(u) for u in v)
    if len(set(out)) != len(out):
        raise ValueError(f"lists a backend twice: {list(out)}")
    return out


def _service(v: str) -> str:
    if not _DNS1035.match(v):
        raise ValueError(f"{v!r} is not a Service name (lowercase DNS-1035 label)")
    return v


def backend_url(url: str) -> str:
    """``http(s)://host:port`` without a trailing slash; ValueError says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not a base URL like http://127.0.0.1:8000")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not carry a path or query; give only http://host:port")
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise ValueError(f"{url!r} has an invalid port") from None
    return f"{parts.scheme}://{parts.netloc}"


def build_parser() -> argparse.ArgumentParser:
    """Flags mirror the settings' fields one to one (``--producer-timeout-s`` ...)."""
    parser = argparse.ArgumentParser(
        prog="python -m encoderpool_router",
        description="OpenAI-compatible EPD router for an EncoderPool. Every flag can also be "
        f"set as {ENV_PREFIX}<NAME> (e.g. {ENV_PREFIX}CONSUMERS).",
    )
    for name, info in RouterSettings.model_fields.items():
        extra = " (comma-separated)" if name in ("producers", "consumers") else ""
        parser.add_argument(
            flag(name),
            dest=name,
            default=None,
            metavar=name.upper(),
            help=f"{info.description}{extra} Default: {info.default!r}.".replace("%", "%%"),
        )
    return parser


def format_error(e: ValidationError) -> str:
    """One line per problem, naming the flag and its environment variable."""
    lines = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"]]
        msg = err["msg"].removeprefix("Value error, ")
        if loc:
            lines.append(f"{flag(loc[0])} ({ENV_PREFIX}{loc[0].upper()}): {msg}")
        else:
            lines.append(msg)
    return "invalid router settings:\n  " + "\n  ".join(lines)


def parse_settings(argv: Sequence[str] | None = None) -> RouterSettings:
    """Flags over environment over defaults; ValueError lists every bad value."""
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return RouterSettings(**given)
    except ValidationError as e:
        raise ValueError(format_error(e)) from None

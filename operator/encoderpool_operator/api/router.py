"""``spec.router``: the pool's OpenAI-compatible endpoint and who may use it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from encoderpool_operator.api.roles import ResourceRequirements
from encoderpool_operator.api.schema import ApiModel, Rule, SecretKeySelector


class RouterAuth(ApiModel):
    """Who may use the pool's endpoint: clients must send one of these bearer tokens."""

    bearer_token_secret: SecretKeySelector = Field(
        description="A key of a Secret in the pool's namespace (you make it) holding the "
        "accepted tokens, one per line: add a line to roll a new token in, remove one to "
        "revoke it. It is mounted into the router pods, which re-read it when Kubernetes "
        "updates it; every request but /health and /livez then needs `Authorization: "
        "Bearer <token>` (else 401). The operator never reads it."
    )


class RouterSpec(ApiModel):
    """The pool's OpenAI-compatible endpoint: fans media out to producers, text to consumers."""

    rules: ClassVar[tuple[Rule[RouterSpec], ...]] = (
        Rule(
            "",
            cel="!has(self.auth) || self.enabled",
            check=lambda r: r.auth is None or r.enabled,
            message="auth needs the router: set enabled to true, or remove auth",
        ),
    )

    enabled: bool = Field(
        default=True, description="Run the router; false leaves routing to your own proxy."
    )
    replicas: int = Field(default=1, ge=1, le=32, description="Number of router pods.")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Type of the router's Service, <pool>."
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Port of the router's Service.")
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="Router image; default: the operator's own router image.",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Resources of the router container; empty: requests 250m CPU and "
        "256Mi, limits 2 CPU and 2Gi (anything given replaces all four). The router sizes "
        "its connection cap and its memory for request bodies from the memory limit.",
    )
    trust_client_media_ids: bool = Field(
        default=False,
        description="Pass clients' media item uuids on to vLLM, which keys embeddings by them: "
        "one client could then have another's request answered with its own media. Only for "
        "single-tenant pools; off, the router drops them and vLLM hashes the content.",
    )
    trust_request_mm_kwargs: bool = Field(
        default=False,
        description="Accept requests' mm_processor_kwargs and media_io_kwargs (a video's "
        "frames, an image's pixels): the router passes them on (at most 4 KiB) and vLLM "
        "runs with --trust-request-mm-kwargs. They set what each item costs to encode, so "
        "only for clients trusted with the pool's capacity; off, both refuse them (400).",
    )
    consumer_policy: Literal["LeastBusy", "MediaAffinity"] = Field(
        default="LeastBusy",
        description="How the router picks a consumer. LeastBusy: fewest requests in flight. "
        "MediaAffinity: the same first image (or other media item) goes to the same "
        "consumer, whose prefix and processor caches then hit; past 16 requests in flight "
        "there it goes to the next consumer in that item's ranking; text-only requests go "
        "to the least busy. Worth it with several consumers and repeated media (multi-turn "
        "chats, shared images).",
    )
    dispatch: Literal["Always", "WhenFaster"] = Field(
        default="Always",
        description="Where the router has a media item encoded. Always: on a producer "
        "whenever one of its group is ready. WhenFaster: on a producer only when its "
        "expected wait there, (the group's items per ready producer + 1) x the producers' "
        "seconds per item as the router measures them (hop included; before the first "
        "answer, status.encodeSeconds + 20 ms), is shorter than the delay the consumer's "
        "own encode causes, status.encodeSeconds x (1 + the consumer's requests in flight); "
        "an idle consumer encodes the item itself and no hop is paid. Always is the "
        "default: measured side by side on 2 CPU cores (docs/benchmarks-epd.md, "
        "2026-12-07), WhenFaster left most images of image-heavy traffic to consumers busy "
        "decoding, whose time per output token (p99) got 3-9x worse, without a consistent "
        "gain in time to first token or throughput. Either way, an item whose producers "
        "are all down or scaled to zero is encoded by the consumer.",
    )
    auth: RouterAuth | None = Field(
        default=None,
        description="Client authentication: bearer tokens from a Secret. Omit for an open "
        "endpoint (NetworkPolicy clients still apply).",
    )

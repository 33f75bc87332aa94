"""``ConnectorConfig``: what the operator renders into ``ec_connector_extra_config``.

One model, imported by the operator (to render) and by the connector (to
parse at vLLM start-up), so the two cannot drift. Producer and consumer of a
pool get the identical config; only ``ec_role`` differs between them.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from encoderpool_contracts.base import Frozen
from encoderpool_contracts.identity import ModelIdentity

# Modality names as vLLM spells them; they are map keys, never paths.
_MODALITY = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class SharedVolumeSettings(Frozen):
    """A filesystem every producer and consumer of the pool mounts (RWX PVC)."""

    root: str = Field(description="Absolute directory inside the pod that holds the cache.")
    capacity_bytes: Annotated[int, Field(ge=1 << 20, le=1 << 50)] = Field(
        description="Upper bound on the bytes the cache keeps; older entries are evicted."
    )
    eviction: Literal["lru", "fifo"] = Field(
        default="lru",
        description="lru evicts the least recently loaded entry; fifo the oldest written.",
    )
    writer_queue: Annotated[int, Field(ge=1, le=4096)] = Field(
        default=64,
        description="Saves queued for the background writer; when it is full a save is "
        "dropped (counted, and the consumer encodes that item) rather than blocking the encoder.",
    )
    publish_wait_ms: Annotated[int, Field(ge=0, le=60_000)] = Field(
        default=3000,
        description="How long a consumer waits for an item a producer announced "
        "(ec_transfer_params) to appear before it encodes the item itself.",
    )
    verify_threads: Annotated[int, Field(ge=1, le=64)] = Field(
        default=2,
        description="Threads per consumer that verify entries (checksum) off the engine loop.",
    )
    load_buffer_bytes: Annotated[int, Field(ge=0, le=1 << 40)] | None = Field(
        default=None,
        description="Host memory per consumer worker kept for loads (grown on demand, "
        "pinned on GPUs; unset: 256 MiB): entries are read into reused, already-touched "
        "buffers instead of fresh tensors. On CPU a buffer stays lent while vLLM's encoder "
        "cache holds the item, so size it like that cache; when it is exhausted a load "
        "allocates (slower, counted as load_buffer_fallbacks). 0 turns the pool off.",
    )
    load_threads: Annotated[int, Field(ge=1, le=8)] | None = Field(
        default=None,
        description="Threads that read one large entry (6 MiB or more) at once, each a "
        "part of it: the worker's own thread plus load_threads - 1 helpers made once per "
        "worker; each part is at least 3 MiB. Unset: one per CPU the worker may use (its "
        "affinity, lowered to the container's CPU limit), at most 8. 1 reads with the "
        "worker's thread alone.",
    )

    @field_validator("root")
    @classmethod
    def _absolute_clean(cls, v: str) -> str:
        p = PurePosixPath(v)
        if not p.is_absolute() or ".." in p.parts or str(p) != v.rstrip("/") or v == "/":
            raise ValueError(f"root must be a clean absolute directory other than '/', got {v!r}")
        return v.rstrip("/")


class RdmaSettings(Frozen):
    """NIXL over UCX: producers keep embeddings in registered host memory; consumers READ."""

    side_channel_port: Annotated[int, Field(ge=1024, le=65535)] = Field(
        default=5600, description="TCP port of the producer's metadata side channel."
    )
    buffer_bytes: Annotated[int, Field(ge=1 << 20, le=1 << 40)] = Field(
        default=1 << 30, description="Registered host memory per producer for embeddings."
    )
    backends: tuple[Literal["UCX"], ...] = Field(
        default=("UCX",), description="NIXL backends, in order of preference."
    )
    bind_host: str = Field(
        default="0.0.0.0",  # noqa: S104  # pods: the pod IP is not known to vLLM
        pattern=r"^[0-9A-Za-z.:-]{1,253}$",
        description="Address the producer's side channel listens on (0.0.0.0 in pods). "
        "The address consumers are told comes from env ENCODERPOOL_ADVERTISE_HOST "
        "(the pod IP), default 127.0.0.1.",
    )
    transfer_timeout_ms: Annotated[int, Field(ge=100, le=600_000)] = Field(
        default=5000,
        description="How long a consumer lets one READ (metadata fetch included) take before "
        "it gives up and encodes the item itself.",
    )
    metadata_timeout_ms: Annotated[int, Field(ge=50, le=60_000)] = Field(
        default=2000,
        description="Connect/read timeout of one side-channel request to a producer.",
    )
    slot_ttl_s: Annotated[int, Field(ge=1, le=86_400)] = Field(
        default=300,
        description="A producer frees an item's memory once every consumer it was announced "
        "to confirmed its READ, or after this many seconds, whichever comes first.",
    )
    shm_dir: str = Field(
        default="/dev/shm",  # noqa: S108  # tmpfs shared by vLLM's own processes
        pattern=r"^/[^\x00]*$",
        description="Directory (tmpfs) of the host buffer shared by vLLM's scheduler and "
        "worker processes; in pods mount a memory emptyDir there at least buffer_bytes large.",
    )


class ConnectorConfig(Frozen):
    """The parsed ``ec_connector_extra_config`` of an encoderpool connector."""

    version: Literal[1] = Field(default=1, description="Format version.")
    transport: Literal["sharedVolume", "rdma"] = Field(
        description="How embeddings travel from producers to consumers."
    )
    model_fingerprint: str = Field(
        pattern=r"^[0-9a-f]{16}$",
        description="Fingerprint of the model as served (see contracts.ModelIdentity); "
        "entries written under another fingerprint are never loaded.",
    )
    model_identity: ModelIdentity | None = Field(
        default=None,
        description="The identity the fingerprint was computed from; the connector checks "
        "at start-up that vLLM serves exactly this model (warning with the field otherwise).",
    )
    encoder_output_widths: dict[str, Annotated[int, Field(ge=1, le=1 << 20)]] = Field(
        default_factory=dict,
        description="Measured encoder output width per modality (from the WidthReport).",
    )
    shared_volume: SharedVolumeSettings | None = Field(
        default=None, description="Settings of the sharedVolume transport."
    )
    rdma: RdmaSettings | None = Field(default=None, description="Settings of the rdma transport.")

    @field_validator("encoder_output_widths")
    @classmethod
    def _modalities(cls, v: dict[str, int]) -> dict[str, int]:
        for name in v:
            if not _MODALITY.match(name):
                raise ValueError(f"modality name {name!r} must match {_MODALITY.pattern}")
        return v

    @model_validator(mode="after")
    def _transport_settings(self) -> ConnectorConfig:
        want = {"sharedVolume": "shared_volume", "rdma": "rdma"}[self.transport]
        if getattr(self, want) is None:
            raise ValueError(f"transport {self.transport!r} needs the {want!r} section")
        other = "rdma" if want == "shared_volume" else "shared_volume"
        if getattr(self, other) is not None:
            raise ValueError(f"transport {self.transport!r} does not use {other!r}; remove it")
        return self

    def to_extra_config(self) -> dict[str, Any]:
        """The JSON-ready dict that goes into ``ec_connector_extra_config``."""
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Parse vLLM's ``ec_connector_extra_config``; the error names each bad key."""
        try:
            return cls.model_validate(extra or {})
        except ValidationError as e:
            problems = "; ".join(
                f"ec_connector_extra_config.{'.'.join(str(p) for p in err['loc']) or '<root>'}: "
                f"{err['msg']}"
                for err in e.errors()
            )
            raise ValueError(f"invalid encoderpool connector config: {problems}") from None

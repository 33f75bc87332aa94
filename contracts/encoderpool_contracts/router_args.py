"""The router's command line as the operator writes it: one typed model, both sides.

The operator image renders the router's Deployment and the router image parses its
flags; they upgrade apart. So the flags the operator sets are fields here, serialised by
``RouterArgs.argv`` and parsed by the router, whose settings carry a field of the same
name for each (``tests/contracts`` holds the two together): no flag is spelt twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Port = Annotated[int, Field(ge=1, le=65535)]
# Every router flag can also be given as an environment variable: this prefix and the
# field's name in capitals (the operator passes secrets and the pool's uid that way).
ENV_PREFIX = "ENCODERPOOL_ROUTER_"


def env_name(name: str) -> str:
    """The variable of a settings field: ``backend_api_key`` -> ``..._BACKEND_API_KEY``."""
    return ENV_PREFIX + name.upper()


# The router's key toward producers and consumers (from the pool's Secret, never a flag:
# a flag shows in the process list), and the pool's uid (an env, so that a router older
# than the field ignores it instead of failing on an unknown flag).
BACKEND_API_KEY_ENV = env_name("backend_api_key")
POOL_UID_ENV = env_name("pool_uid")
# The probe port, and the container's memory limit (from the downward API), which the
# router's connection cap and body budget are derived from: envs for the same reason.
PROBE_PORT_ENV = env_name("probe_port")
MEMORY_LIMIT_ENV = env_name("memory_limit_bytes")
# The width Job's warm encode time per modality (status.encodeSeconds), which the router's
# when-faster dispatch weighs: an env too, for the same reason. A JSON map, as
# ``encode_seconds_value`` writes it and the router's --encode-seconds reads it.
ENCODE_SECONDS_ENV = env_name("encode_seconds")


# The router's longest wait for one producer (past it the consumer encodes the item): the
# router's default, and what a producer being removed waits out before it stops, so that
# every item the router sent it is answered (the operator's drain).
PRODUCER_TIMEOUT_S = 30.0


def flag(name: str) -> str:
    """The flag of a settings field: ``producer_timeout_s`` -> ``--producer-timeout-s``."""
    return "--" + name.replace("_", "-")


def flag_value(value: object) -> str:
    """A field's value as its flag takes it: booleans as true/false, lists comma-separated,
    maps as JSON (keys sorted, so a rendered Deployment never changes by accident)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def encode_seconds_value(seconds: Mapping[str, float]) -> str:
    """``ENCODE_SECONDS_ENV``'s value: a JSON map, keys sorted and each time to three
    significant digits (the rest is the measurement's noise)."""
    return flag_value({m: float(f"{s:.3g}") for m, s in seconds.items()})


class RouterArgs(BaseModel):
    """The router flags the operator sets; a field left unset is left to the router's
    default (and not rendered, so a new field does not roll existing routers)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    producer_service: str | None = None
    producer_services_by_modality: dict[str, str] | None = None
    consumer_service: str
    namespace: str
    host: str
    port: Port
    metrics_port: Port
    trust_client_media_ids: bool | None = None
    trust_request_mm_kwargs: bool | None = None
    consumer_policy: Literal["least-busy", "media-affinity"] | None = None
    dispatch: Literal["always", "when-faster"] | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    allow_private_media: bool | None = None
    limit_mm_per_prompt: dict[str, int] | None = None
    reuse_encoded_s: int | None = None
    auth_token_file: str | None = None

    def argv(self) -> list[str]:
        """The flags, in field order, of every field given a value."""
        out: list[str] = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is not None:
                out += [flag(name), flag_value(value)]
        return out

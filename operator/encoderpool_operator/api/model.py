"""``spec.model``: the model every producer and consumer serves, and how vLLM serves it.

Where its files come from (the image, the hub, a PersistentVolumeClaim), the hub
token by reference, the vLLM arguments and env a pool may add (never a flag the
operator sets from a typed field, in any spelling vLLM accepts), and where media
URLs may point.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from encoderpool_contracts import CHANNEL_KEY_ENV, VLLM_API_KEY_ENV
from encoderpool_operator.api.schema import (
    DNS_SUBDOMAIN_PATTERN,
    RELATIVE_PATH_TEXT,
    ApiModel,
    Modality,
    Rule,
    SecretKeySelector,
    cel_is_inside,
    is_inside,
)

# A model's PersistentVolumeClaim is mounted read-only at <MODEL_MOUNT_ROOT>/<claimName>.
MODEL_MOUNT_ROOT = "/models"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
HOSTNAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _cel_list(names: tuple[str, ...]) -> str:
    """A CEL list of string literals."""
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


# ----------------------------------------------------------------------------- extraArgs

# vLLM flags the operator renders from typed fields (or must never be given): `extraArgs`
# may not set them in any spelling vLLM accepts. vLLM's parser (argparse with
# allow_abbrev) takes any unambiguous prefix (--ec-transfer-conf), `--flag=value`, `_`
# for `-` in the name, and dotted JSON keys (--ec-transfer-config.ec_role x), which it
# re-appends after every other argument, so they win wherever the operator puts its own
# flags; `--config FILE` reads flags (dotted keys too) from a file. So every prefix of an
# owned flag is refused, whatever follows it after `=` or `.`, and `--config`. Checked
# against vLLM's real parser in tests/operator/test_vllm_args.py.
OWNED_FLAGS = (
    "model", "revision", "dtype", "served-model-name", "tensor-parallel-size",
    "limit-mm-per-prompt", "ec-transfer-config", "host", "port", "allowed-media-domains",
    "allowed-local-media-path", "api-key", "config",
)  # fmt: skip
OWNED_SHORT_FLAGS = ("tp",)  # -tp (argparse also takes -t for it)


def _prefixes(flag: str) -> str:
    """RE2 for every non-empty prefix of ``flag``, `_` or `-` where it has `-`."""
    out = ""
    for ch in reversed(flag[1:]):
        out = f"(?:{'[-_]' if ch == '-' else re.escape(ch)}{out})?"
    return re.escape(flag[0]) + out


OWNED_FLAGS_PATTERN = (
    r"^(--(" + "|".join(_prefixes(f) for f in OWNED_FLAGS) + r")?"
    r"|-(" + "|".join(_prefixes(f) for f in OWNED_SHORT_FLAGS) + r"))([=.].*)?$"
)
# The owned flags as users know them: --tensor-parallel-size/-tp, ... (--config apart).
_OWNED_FLAG_NAMES = ", ".join(
    f"--{f}" + ("/-tp" if f == "tensor-parallel-size" else "") for f in OWNED_FLAGS[:-1]
)
_OWNED_FLAGS_FIX = (
    f"an item spells a flag the operator sets ({_OWNED_FLAG_NAMES}) or --config (flags "
    "from a file), --, or a prefix, `_` or dotted spelling of one, which vLLM accepts as "
    "that flag: set spec.model, spec.producer/consumer.tensorParallelSize or "
    "spec.connector instead (the API key comes from the pool's internal Secret)"
)


# ----------------------------------------------------------------------------- model


class EnvVar(ApiModel):
    """An environment variable with a literal value."""

    name: str = Field(
        pattern=ENV_NAME_PATTERN, min_length=1, max_length=128, description="Variable name."
    )
    value: str = Field(default="", max_length=4096, description="Literal value.")


class PersistentVolumeClaimSource(ApiModel):
    """Model files on a PersistentVolumeClaim in the pool's namespace, mounted read-only."""

    rules: ClassVar[tuple[Rule[PersistentVolumeClaimSource], ...]] = (
        Rule(
            ".subPath",
            cel="!has(self.subPath) || (" + cel_is_inside("self.subPath") + ")",
            check=lambda s: s.sub_path is None or is_inside(s.sub_path),
            message="subPath must be " + RELATIVE_PATH_TEXT,
        ),
    )

    claim_name: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN,
        min_length=1,
        max_length=253,
        description="Name of the PVC. It is mounted read-only at /models/<claimName> in "
        "producers, consumers and the width Job; pods on several nodes need a ReadOnlyMany "
        "or ReadWriteMany claim.",
    )
    sub_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="A folder inside the claim to mount at /models/<claimName> instead of "
        "the claim's root; " + RELATIVE_PATH_TEXT + ".",
    )

    @property
    def mount_path(self) -> str:
        return f"{MODEL_MOUNT_ROOT}/{self.claim_name}"


class ModelSource(ApiModel):
    """Where the pods find the model files, instead of the image or the hub."""

    persistent_volume_claim: PersistentVolumeClaimSource = Field(
        description="A PVC holding the model files; spec.model.name is then the model's "
        "folder inside it."
    )


class HubToken(ApiModel):
    """A Hugging Face token, by reference: the pool holds where it is, never its value."""

    secret_key_ref: SecretKeySelector = Field(
        description="The Secret key holding the token; it becomes HF_TOKEN in producers, "
        "consumers and the width Job (valueFrom.secretKeyRef)."
    )


HUB_TOKEN_ENV = "HF_TOKEN"  # noqa: S105 (the variable's name; its value comes from a Secret)
# vLLM's API key (it honours VLLM_API_KEY like --api-key) and the rdma side channel's key:
# the operator sets both from the pool's internal Secret, so spec.model.env may not.
RESERVED_ENV = (VLLM_API_KEY_ENV, CHANNEL_KEY_ENV)


class MediaFetchSpec(ApiModel):
    """Where the pool's pods may fetch media from when a request names it by URL.

    A request's image URL makes a vLLM pod (and the router's checks) reach out:
    without limits a client can point it at services inside the cluster. The
    router refuses other schemes than http, https and data, and addresses in
    private, loopback and link-local ranges; vLLM gets the domain allow-list and
    no redirects.
    """

    allowed_domains: tuple[Annotated[str, Field(max_length=253, pattern=HOSTNAME_PATTERN)], ...] = (
        Field(
            default=(),
            max_length=64,
            description="Hosts media URLs may name, exactly (vLLM --allowed-media-domains "
            "and the router); empty: any public host.",
        )
    )
    allow_redirects: bool = Field(
        default=False,
        description="Follow HTTP redirects when fetching media (a redirect can lead anywhere).",
    )
    allow_private_addresses: bool = Field(
        default=False,
        description="Let media URLs name private, loopback or link-local addresses (an "
        "in-cluster media server); off, the router refuses them.",
    )


def _env_names_unique(model: ModelSpec) -> bool:
    names = [e.name for e in model.env]
    return len(set(names)) == len(names)


class ModelSpec(ApiModel):
    """The multimodal model every producer and consumer serves, and how vLLM serves it."""

    rules: ClassVar[tuple[Rule[ModelSpec], ...]] = (
        Rule(
            ".name",
            cel="!has(self.source) || (" + cel_is_inside("self.name") + ")",
            check=lambda m: m.source is None or is_inside(m.name),
            message="with source, name is the model's folder inside the claim: "
            + RELATIVE_PATH_TEXT
            + ", e.g. tiny-qwen2vl for /models/<claimName>/tiny-qwen2vl",
        ),
        Rule(
            ".env",
            cel=f"!has(self.hubToken) || !has(self.env) || "
            f"!self.env.exists(e, e.name == '{HUB_TOKEN_ENV}')",
            check=lambda m: m.hub_token is None or all(e.name != HUB_TOKEN_ENV for e in m.env),
            message=f"{HUB_TOKEN_ENV} is set from hubToken: remove it from env",
        ),
        Rule(
            ".env",
            cel=f"!has(self.env) || self.env.all(e, !(e.name in {_cel_list(RESERVED_ENV)}))",
            check=lambda m: all(e.name not in RESERVED_ENV for e in m.env),
            message=f"{' and '.join(RESERVED_ENV)} are set by the operator from the pool's "
            "internal Secret: remove them from env",
        ),
        # The API server refuses duplicates itself (env is a list map keyed by name).
        Rule(
            ".env",
            cel=None,
            check=_env_names_unique,
            message="duplicate env names: give each name once",
        ),
        Rule(
            ".extraArgs",
            cel="!has(self.extraArgs) || "
            f"self.extraArgs.all(a, !a.matches('{OWNED_FLAGS_PATTERN}'))",
            check=lambda m: not any(re.match(OWNED_FLAGS_PATTERN, a) for a in m.extra_args),
            message=_OWNED_FLAGS_FIX,
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=512,
        pattern=r"^\S+$",
        description="Model to serve, as given to `vllm serve`: a Hugging Face id "
        "(Qwen/Qwen2-VL-2B-Instruct) or an absolute path inside the pod; with source, the "
        "model's folder inside the claim (tiny-qwen2vl). Changing it re-measures encoder "
        "widths before the pods roll.",
    )
    source: ModelSource | None = Field(
        default=None,
        description="Model files on a PersistentVolumeClaim, mounted read-only at "
        "/models/<claimName>; omit to load name from the image or the hub.",
    )
    hub_token: HubToken | None = Field(
        default=None,
        description="Hugging Face token for gated or private hub models, from a Secret "
        "(HF_TOKEN in the pods); never a literal in the pool.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^\S+$",
        description="Model revision (branch, tag or commit) for a hub id; omit for a path.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="Weights and activations dtype; also the dtype of cached embeddings.",
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^\S+$",
        description="Name clients use in requests (vLLM --served-model-name); default: name.",
    )
    limit_mm_per_prompt: dict[Modality, Annotated[int, Field(ge=0, le=256)]] = Field(
        default_factory=dict,
        max_length=8,
        description="Most media items of each modality in one prompt (vLLM "
        "--limit-mm-per-prompt) by modality name, e.g. {image: 4, video: 0}.",
    )
    media: MediaFetchSpec = Field(
        default_factory=MediaFetchSpec,
        description="Where media URLs in requests may point (fetching is SSRF-guarded).",
    )
    extra_args: tuple[Annotated[str, Field(min_length=1, max_length=1024)], ...] = Field(
        default=(),
        max_length=64,
        description="More `vllm serve` arguments for producers and consumers, e.g. "
        f"[--max-model-len, '8192']. Flags the operator sets from typed fields "
        f"({_OWNED_FLAG_NAMES}) and --config are refused in every spelling vLLM accepts "
        "(prefixes, --flag=value, _ for -, dotted keys).",
    )
    env: tuple[EnvVar, ...] = Field(
        default=(),
        max_length=64,
        description="Environment variables for the vLLM containers (names unique; not "
        f"{' or '.join(RESERVED_ENV)}, nor {HUB_TOKEN_ENV} with hubToken).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    def path(self) -> str:
        """What vLLM loads: name itself, or with a source, name inside the claim's mount."""
        if self.source is None:
            return self.name
        return f"{self.source.persistent_volume_claim.mount_path}/{self.name}"

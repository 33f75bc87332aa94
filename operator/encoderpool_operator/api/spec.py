"""``EncoderPool.spec``: what a user asks for (model, images, roles, connector, router, Job).

Every ``description`` here is what ``kubectl explain`` prints, and every bound
is one the API server enforces (the CRD is generated from these models). Rules
that span fields are each model's ``rules`` table (``schema.Rule``): one CEL
expression for the API server, one check for the operator, one message.
Helpers that turn the spec into the connector's contracts live beside it, so a
new field and its effect stay in one place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from encoderpool_contracts import (
    CHANNEL_KEY_ENV,
    VLLM_API_KEY_ENV,
    ConnectorConfig,
    ModelIdentity,
    RdmaSettings,
    SharedVolumeSettings,
)
from encoderpool_contracts.pod import ROUTER_METRICS_PORT
from encoderpool_operator.api.autoscaling import Autoscaling
from encoderpool_operator.api.pod_template import (
    POD_TEMPLATE_SCHEMA,
    SECURITY_ANNOTATION_PREFIXES,
    forbidden_fields,
)
from encoderpool_operator.api.quantity import ByteRange, Quantity, quantity_bytes
from encoderpool_operator.api.schema import ApiModel, Label, Modality, ResourceName, Rule

DEFAULT_MOUNT_PATH = "/var/cache/encoderpool"
# A model's PersistentVolumeClaim is mounted read-only at <MODEL_MOUNT_ROOT>/<claimName>.
MODEL_MOUNT_ROOT = "/models"
DEFAULT_UCX_TRANSPORTS = "rc,sm,self"

# DNS-1123 subdomain (object names such as PVCs, Secrets).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A Multus network: `name`, `namespace/name`, optionally `@interface`.
NETWORK_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(@[A-Za-z0-9_.-]{1,15})?$"
)
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
HOSTNAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CIDR_PATTERN = r"^[0-9a-fA-F:.]+/[0-9]{1,3}$"
# A map key that is a label or annotation key (an optional DNS prefix, '/', a name).
LabelKey = Annotated[str, Field(max_length=317)]


def _cel_list(names: tuple[str, ...]) -> str:
    """A CEL list of string literals."""
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


def _cel_starts_with_any(expr: str, prefixes: tuple[str, ...]) -> str:
    """CEL: the string ``expr`` starts with one of ``prefixes``."""
    return " || ".join(f"{expr}.startsWith('{p}')" for p in prefixes)


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


# ----------------------------------------------------------------------------- paths

# A path inside a volume: segments separated by single '/', none of them '.' or '..',
# so it can never leave the volume it is joined to.
RELATIVE_PATH_PATTERN = r"^[^/]+(/[^/]+)*$"
DOT_SEGMENT_PATTERN = r"(^|/)[.][.]?(/|$)"
_RELATIVE_PATH = "a relative path inside the volume (no leading '/', no '.' or '..' segments)"


def _is_inside(path: str) -> bool:
    """``path`` is relative and stays inside the volume it is joined to."""
    return bool(re.match(RELATIVE_PATH_PATTERN, path)) and not re.search(DOT_SEGMENT_PATTERN, path)


def _cel_is_inside(expr: str) -> str:
    """CEL for ``_is_inside(expr)``."""
    return f"{expr}.matches('{RELATIVE_PATH_PATTERN}') && !{expr}.matches('{DOT_SEGMENT_PATTERN}')"


# ----------------------------------------------------------------------------- model


class EnvVar(ApiModel):
    """An environment variable with a literal value."""

    name: str = Field(
        pattern=ENV_NAME_PATTERN, min_length=1, max_length=128, description="Variable name."
    )
    value: str = Field(default="", max_length=4096, description="Literal value.")


class LocalObjectReference(ApiModel):
    """A reference to an object in the pool's namespace."""

    name: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253, description="Object name."
    )


class PersistentVolumeClaimSource(ApiModel):
    """Model files on a PersistentVolumeClaim in the pool's namespace, mounted read-only."""

    rules: ClassVar[tuple[Rule[PersistentVolumeClaimSource], ...]] = (
        Rule(
            ".subPath",
            cel="!has(self.subPath) || (" + _cel_is_inside("self.subPath") + ")",
            check=lambda s: s.sub_path is None or _is_inside(s.sub_path),
            message="subPath must be " + _RELATIVE_PATH,
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
        "the claim's root; " + _RELATIVE_PATH + ".",
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


class SecretKeySelector(ApiModel):
    """One key of a Secret in the pool's namespace."""

    name: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253, description="Secret name."
    )
    key: str = Field(
        pattern=r"^[-._a-zA-Z0-9]+$",
        min_length=1,
        max_length=253,
        description="Key in the Secret's data.",
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
            cel="!has(self.source) || (" + _cel_is_inside("self.name") + ")",
            check=lambda m: m.source is None or _is_inside(m.name),
            message="with source, name is the model's folder inside the claim: "
            + _RELATIVE_PATH
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


# ----------------------------------------------------------------------------- roles


class ResourceRequirements(ApiModel):
    """Compute resources of a container, as in a Pod: requests and limits by resource name."""

    requests: dict[ResourceName, Quantity] = Field(
        default_factory=dict,
        max_length=16,
        description="Minimum resources, e.g. {cpu: '4', memory: 32Gi}.",
    )
    limits: dict[ResourceName, Quantity] = Field(
        default_factory=dict,
        max_length=16,
        description="Maximum resources; GPUs go here, e.g. {nvidia.com/gpu: 1}.",
    )


class Toleration(ApiModel):
    """A Pod toleration (see `kubectl explain pod.spec.tolerations`)."""

    rules: ClassVar[tuple[Rule[Toleration], ...]] = (
        Rule(
            ".value",
            cel="!has(self.operator) || self.operator != 'Exists' || "
            "!has(self.value) || self.value == ''",
            check=lambda t: t.operator != "Exists" or not t.value,
            message="value must be empty when operator is Exists",
        ),
        Rule(
            ".tolerationSeconds",
            cel="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            check=lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
            message="tolerationSeconds applies only to effect NoExecute",
        ),
    )

    key: str | None = Field(
        default=None, max_length=316, description="Taint key; empty with Exists matches all."
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (the default)."
    )
    value: str | None = Field(default=None, max_length=63, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all."
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        le=31_536_000,
        description="With NoExecute: how long the pod stays bound after the taint appears.",
    )


_FREE_FORM: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}

# Label key prefixes the operator's selectors and owner labels use; podLabels may not.
RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "encoderpool.io/")


class TopologySpreadConstraint(ApiModel):
    """Spread the role's pods over a topology; the operator selects the role's own pods."""

    max_skew: int = Field(
        default=1, ge=1, le=1000, description="Most pods one domain may exceed another by."
    )
    topology_key: str = Field(
        min_length=1,
        max_length=317,
        description="Node label whose values are the domains, e.g. topology.kubernetes.io/zone.",
    )
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        default="ScheduleAnyway",
        description="ScheduleAnyway (the default) schedules a pod even where it skews "
        "further; DoNotSchedule keeps it Pending instead.",
    )

    def render(self, selector: Mapping[str, str]) -> dict[str, Any]:
        return {
            "maxSkew": self.max_skew,
            "topologyKey": self.topology_key,
            "whenUnsatisfiable": self.when_unsatisfiable,
            "labelSelector": {"matchLabels": dict(selector)},
        }


class RolloutSpec(ApiModel):
    """A Deployment's rolling update, in pods.

    The default replaces a pod before starting its successor (maxSurge 0): a GPU
    cluster rarely has a spare GPU for a surge pod, and a rollout that waits for
    one never finishes. With spare capacity, maxSurge 1 and maxUnavailable 0 keep
    every replica serving during the roll.
    """

    rules: ClassVar[tuple[Rule[RolloutSpec], ...]] = (
        Rule(
            "",
            cel="self.maxSurge > 0 || self.maxUnavailable > 0",
            check=lambda r: r.max_surge > 0 or r.max_unavailable > 0,
            message="maxSurge and maxUnavailable cannot both be 0: the rollout could never "
            "start; raise one of them",
        ),
    )

    max_surge: int = Field(
        default=0, ge=0, le=256, description="Pods started above replicas during a rollout."
    )
    max_unavailable: int = Field(
        default=1, ge=0, le=256, description="Pods that may be missing during a rollout."
    )


class RoleSpec(ApiModel):
    """One role's pods: producers run the encoder only, consumers run the LM."""

    rules: ClassVar[tuple[Rule[RoleSpec], ...]] = (
        Rule(
            ".podLabels",
            cel="!has(self.podLabels) || !self.podLabels.exists(k, "
            + _cel_starts_with_any("k", RESERVED_LABEL_PREFIXES)
            + ")",
            check=lambda r: not any(k.startswith(RESERVED_LABEL_PREFIXES) for k in r.pod_labels),
            message="podLabels may not set "
            + " or ".join(f"{p}*" for p in RESERVED_LABEL_PREFIXES)
            + " keys: the operator's selectors and owner labels use them; remove them",
        ),
        Rule(
            ".podAnnotations",
            cel="!has(self.podAnnotations) || !self.podAnnotations.exists(k, "
            + _cel_starts_with_any("k", SECURITY_ANNOTATION_PREFIXES)
            + ")",
            check=lambda r: (
                not any(k.startswith(SECURITY_ANNOTATION_PREFIXES) for k in r.pod_annotations)
            ),
            message="podAnnotations may not set seccomp or AppArmor profiles ("
            + ", ".join(f"{p}*" for p in SECURITY_ANNOTATION_PREFIXES)
            + "): the operator sets the pods' profile; remove them",
        ),
        # podTemplate's rules live with its schema (pod_template.py): it is a partial
        # PodTemplateSpec, not a model, so its CEL sits inside the schema it declares and
        # forbidden_fields (the validator below) mirrors it path by path.
    )

    replicas: int = Field(default=1, ge=1, le=256, description="Number of pods.")
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs one vLLM instance spans (vLLM --tensor-parallel-size); request "
        "that many GPUs in resources.",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Resources of the vLLM container, e.g. limits {nvidia.com/gpu: 1}.",
    )
    node_selector: dict[LabelKey, Label] = Field(
        default_factory=dict, max_length=32, description="Node labels the pods must match."
    )
    tolerations: tuple[Toleration, ...] = Field(
        default=(), max_length=32, description="Taints the pods tolerate."
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Pod affinity, as in a Pod's spec.affinity (passed through unchanged).",
        json_schema_extra=_FREE_FORM,
    )
    pod_template: dict[str, Any] | None = Field(
        default=None,
        description="Partial PodTemplateSpec (metadata, spec) merged over the one the "
        "operator renders: maps merge key by key, named lists (containers, volumes, "
        "volumeMounts, env, ...) by name, other values replace. For what the typed fields do "
        "not cover, e.g. runtimeClassName, terminationGracePeriodSeconds, sidecar containers, "
        "extra volumes and mounts. An allow-list: pod spec fields as listed in the schema "
        "(others are pruned), volumes of the Pod Security restricted kinds, security "
        "contexts that only lower privileges. Refused: serviceAccountName, "
        "automountServiceAccountToken, nodeName, host namespaces, hostPath volumes, "
        "projected serviceAccountToken sources, privileged or root (runAsUser/runAsGroup 0, "
        "runAsNonRoot false) containers, privilege escalation, added capabilities, seccomp, "
        "AppArmor and SELinux profiles, procMount, sysctls, and the vllm container's image, "
        "command and args. The operator's restricted security fields are applied after the "
        "merge.",
        json_schema_extra=POD_TEMPLATE_SCHEMA,
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How the role's Deployment replaces pods when the spec or model changes.",
    )
    autoscaling: Autoscaling | None = Field(
        default=None,
        description="Size the role from its own load between minReplicas and maxReplicas "
        "(docs/autoscaling.md); replicas is then ignored, and the autoscaler owns the "
        "Deployment's replica count. Removing it hands the count back to replicas.",
    )
    priority_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PriorityClass of the pods (it must exist).",
    )
    topology_spread_constraints: tuple[TopologySpreadConstraint, ...] = Field(
        default=(), max_length=8, description="How the pods spread over nodes or zones."
    )
    pod_labels: dict[LabelKey, Label] = Field(
        default_factory=dict,
        max_length=32,
        description="Extra labels on the pods (not app.kubernetes.io/* or encoderpool.io/*).",
    )
    pod_annotations: dict[LabelKey, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict,
        max_length=32,
        description="Extra annotations on the pods (no seccomp or AppArmor profile ones).",
    )

    @field_validator("pod_template")
    @classmethod
    def _safe_template(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (problems := forbidden_fields(value)):
            raise ValueError("; ".join(f"podTemplate.{p}" for p in problems))
        return value


# Modalities a producer group can take: those vLLM's chat API sends as media items.
ProducerModality = Literal["image", "video", "audio"]
MAX_PRODUCER_GROUPS = 3  # one per modality at most: a modality belongs to one group
MAX_GROUP_NAME = 16
GROUP_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# The words of the pool's child names after `<pool>-` (naming: producer, producer-<group>,
# consumer, router, cache, internal, width-job, width-<key>). A group name holding none of
# them as a word (between '-') cannot make `<pool>-producer-<group>` another pool's child:
# a group `consumer` would be pool `<pool>-producer`'s consumer Deployment, a group
# `x-router` pool `<pool>-producer-x`'s router. (A pool's own name can still equal another
# pool's child name, e.g. a pool `a-consumer` beside a pool `a`: that stays a NameConflict.)
CHILD_NAME_WORDS = ("producer", "consumer", "router", "cache", "internal", "width")
RESERVED_GROUP_WORD = "(^|-)(" + "|".join(CHILD_NAME_WORDS) + ")(-|$)"


class ProducerGroup(ApiModel):
    """Producers for some modalities only, in a Deployment of their own.

    Large video or audio encoders want other replicas, GPUs or nodes than image
    encoders; a group gives them that. Every other pod setting (tensor parallelism,
    rollout, podTemplate, labels, ...) comes from spec.producer, and every group gets
    the pool's one connector configuration, so its entries load in any consumer.
    """

    rules: ClassVar[tuple[Rule[ProducerGroup], ...]] = (
        Rule(
            ".name",
            cel=f"!self.name.matches('{RESERVED_GROUP_WORD}')",
            check=lambda g: re.search(RESERVED_GROUP_WORD, g.name) is None,
            message="a group name may not hold the word "
            + ", ".join(CHILD_NAME_WORDS)
            + " (between '-'): <pool>-producer-<name> would then be a child name of "
            "another pool (a group consumer is pool <pool>-producer's consumer); "
            "choose another name",
        ),
        # The API server refuses duplicates itself (modalities is a list-type set).
        Rule(
            ".modalities",
            cel=None,
            check=lambda g: len(set(g.modalities)) == len(g.modalities),
            message="list each modality once per group",
        ),
    )

    name: str = Field(
        min_length=1,
        max_length=MAX_GROUP_NAME,
        pattern=GROUP_NAME_PATTERN,
        description="The group's name (a DNS-1035 label): its Deployment, headless Service "
        "and NetworkPolicy are <pool>-producer-<name> (past 63 characters, the pool's name "
        "is cut and suffixed with a hash of it). It may not hold the word producer, "
        "consumer, router, cache, internal or width (between '-'), which other pools' "
        "child names are made of.",
    )
    modalities: tuple[ProducerModality, ...] = Field(
        min_length=1,
        max_length=3,
        description="Modalities whose items the router sends to this group (image, video, "
        "audio). A modality in no group is encoded by the consumers themselves.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    replicas: int | None = Field(
        default=None, ge=1, le=256, description="Number of pods; default: spec.producer.replicas."
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Resources of the vLLM container; default: spec.producer.resources.",
    )
    node_selector: dict[LabelKey, Label] | None = Field(
        default=None,
        max_length=32,
        description="Node labels the pods must match; default: spec.producer.nodeSelector.",
    )
    tolerations: tuple[Toleration, ...] | None = Field(
        default=None,
        max_length=32,
        description="Taints the pods tolerate; default: spec.producer.tolerations.",
    )
    autoscaling: Autoscaling | None = Field(
        default=None,
        description="The group's own autoscaling (signal: its own items in flight); "
        "default: spec.producer.autoscaling.",
    )

    def role(self, producer: RoleSpec) -> RoleSpec:
        """``producer`` with what this group sets instead (the group's pod settings)."""
        update: dict[str, Any] = {}
        if self.replicas is not None:
            update["replicas"] = self.replicas
        if self.resources is not None:
            update["resources"] = self.resources
        if self.node_selector is not None:
            update["node_selector"] = dict(self.node_selector)
        if self.tolerations is not None:
            update["tolerations"] = self.tolerations
        if self.autoscaling is not None:
            update["autoscaling"] = self.autoscaling
        return producer.model_copy(update=update)


# ----------------------------------------------------------------------------- connector


def _capacity_fits(volume: SharedVolumeSpec) -> bool:
    if volume.capacity is None or volume.size is None:
        return True
    return quantity_bytes(volume.capacity) <= quantity_bytes(volume.size)


def _clean_mount_path(path: str) -> bool:
    """No '.' or '..' segment and no empty one ('//'): the path says where it mounts."""
    return not re.search(DOT_SEGMENT_PATTERN, path) and "//" not in path


class SharedVolumeSpec(ApiModel):
    """A filesystem every producer and consumer mounts; embeddings are files on it."""

    rules: ClassVar[tuple[Rule[SharedVolumeSpec], ...]] = (
        Rule(
            "",
            cel="has(self.size) != has(self.existingClaim)",
            check=lambda v: (v.size is None) != (v.existing_claim is None),
            message="set exactly one of size (the operator creates a ReadWriteMany PVC of "
            "that size) or existingClaim (a PVC you created)",
        ),
        Rule(
            "",
            cel="!has(self.storageClassName) || has(self.size)",
            check=lambda v: v.storage_class_name is None or v.size is not None,
            message="storageClassName applies only to a new claim: remove it, or use size "
            "instead of existingClaim",
        ),
        Rule(
            "",
            cel="has(self.capacity) || has(self.size)",
            check=lambda v: v.capacity is not None or v.size is not None,
            message="capacity is required with existingClaim: the operator cannot tell the "
            "claim's size",
        ),
        Rule(
            ".capacity",
            cel="!has(self.capacity) || !has(self.size) || "
            "quantity(string(self.capacity)).compareTo(quantity(string(self.size))) <= 0",
            check=_capacity_fits,
            message="capacity must not exceed size: lower capacity or grow size",
        ),
        Rule(
            ".mountPath",
            cel=f"!self.mountPath.matches('{DOT_SEGMENT_PATTERN}') && "
            "!self.mountPath.contains('//')",
            check=lambda v: _clean_mount_path(v.mount_path),
            message="mountPath must be a clean absolute path: no '.' or '..' segments, no '//'",
        ),
        # Transition rules: only the API server holds the stored object to compare with.
        Rule(
            ".size",
            cel="!has(self.size) || !has(oldSelf.size) || "
            "quantity(string(self.size)).compareTo(quantity(string(oldSelf.size))) >= 0",
            check=None,
            message="size cannot shrink (a PVC can only grow): keep it or raise it",
        ),
        Rule(
            "",
            cel="!has(self.size) || !has(oldSelf.size) || "
            "(has(self.storageClassName) ? self.storageClassName : '') == "
            "(has(oldSelf.storageClassName) ? oldSelf.storageClassName : '')",
            check=None,
            message="storageClassName cannot change (a PVC keeps its storage class): restore "
            "it, or use a new pool",
        ),
    )

    size: Annotated[Quantity, ByteRange(1 << 20, 1 << 50)] | None = Field(
        default=None,
        description="Size of a new ReadWriteMany PVC the operator creates for the pool, "
        "e.g. 200Gi. It can grow (if the storage class allows expansion), never shrink.",
    )
    storage_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Storage class of the new PVC; it must offer ReadWriteMany and cannot "
        "change. Default: the cluster's default class.",
    )
    existing_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Name of a ReadWriteMany PVC in the pool's namespace to use instead "
        "of a new one.",
    )
    mount_path: str = Field(
        default=DEFAULT_MOUNT_PATH,
        min_length=2,
        max_length=256,
        pattern=r"^/[^\s]*[^/\s]$",
        description="Where the volume is mounted in the pods (an absolute path); the cache "
        "lives there.",
    )
    capacity: Annotated[Quantity, ByteRange(1 << 20, 1 << 50)] | None = Field(
        default=None,
        description="Most bytes the cache keeps before evicting, e.g. 180Gi; at most size. "
        "Default with size: 90% of size. Required with existingClaim.",
    )
    eviction: Literal["lru", "fifo"] = Field(
        default="lru",
        description="lru (the default) evicts the least recently loaded entry; fifo the "
        "oldest written.",
    )

    def capacity_bytes(self) -> int:
        """The cache bound: capacity, else 90% of a new claim's size (room for temp files)."""
        if self.capacity is not None:
            return quantity_bytes(self.capacity)
        assert self.size is not None, "validated: capacity or size is set"
        return quantity_bytes(self.size) * 9 // 10

    def settings(self) -> SharedVolumeSettings:
        """What the connector reads (ConnectorConfig.shared_volume)."""
        return SharedVolumeSettings(
            root=self.mount_path, capacity_bytes=self.capacity_bytes(), eviction=self.eviction
        )


# UCX_TLS values that let UCX cross nodes without an RDMA device: tcp, all, or an
# exclusion list (^x: every transport but x, tcp included).
CROSSES_NODES_PATTERN = r"(^|,)(tcp|all)(,|$)"


def _shm_fits(rdma: RdmaSpec) -> bool:
    if rdma.shm_size is None:
        return True
    return quantity_bytes(rdma.shm_size) >= quantity_bytes(rdma.buffer_size)


def _reaches_other_nodes(rdma: RdmaSpec) -> bool:
    return bool(
        rdma.resource_name
        or rdma.networks
        or rdma.ucx_transports.startswith("^")
        or re.search(CROSSES_NODES_PATTERN, rdma.ucx_transports)
    )


class RdmaSpec(ApiModel):
    """NIXL over UCX: producers keep embeddings in registered memory, consumers READ them.

    ``rdma: {}`` would render UCX_TLS=rc,sm,self with no device: pods start, but
    every read across nodes fails, and consumers silently encode everything
    themselves. Refused at admission with what to set instead.
    """

    rules: ClassVar[tuple[Rule[RdmaSpec], ...]] = (
        Rule(
            ".shmSize",
            cel="!has(self.shmSize) || !has(self.bufferSize) || "
            "quantity(string(self.shmSize)).compareTo(quantity(string(self.bufferSize))) >= 0",
            check=_shm_fits,
            message="shmSize must be at least bufferSize: the registered buffer lives in "
            "/dev/shm; raise shmSize or lower bufferSize",
        ),
        Rule(
            ".ucxTransports",
            cel="has(self.resourceName) || (has(self.networks) && size(self.networks) > 0) || "
            "(has(self.ucxTransports) && (self.ucxTransports.startsWith('^') || "
            f"self.ucxTransports.matches('{CROSSES_NODES_PATTERN}')))",
            check=_reaches_other_nodes,
            message="ucxTransports lists no transport that reaches another node without an "
            "RDMA device (rc, ud, dc, ... need one; sm, self, cma stay on the node), and "
            "neither resourceName nor networks gives the pods one: set resourceName (your "
            "RDMA device plugin's resource, e.g. rdma/hca), or networks (a Multus network "
            "with an RDMA NIC), or add tcp to ucxTransports (e.g. tcp,sm,self) where there "
            "is no RDMA NIC",
        ),
    )

    resource_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="Extended resource of the RDMA device plugin to request (requests and "
        "limits), e.g. rdma/hca or nvidia.com/hostdev. Omit where UCX uses TCP or shared "
        "memory.",
    )
    resource_count: int = Field(
        default=1, ge=1, le=16, description="How many of resourceName each pod requests."
    )
    networks: tuple[Annotated[str, Field(max_length=253, pattern=NETWORK_PATTERN)], ...] = Field(
        default=(),
        max_length=8,
        description="Multus NetworkAttachmentDefinitions to attach (name, namespace/name, "
        "optionally @interface); rendered into the k8s.v1.cni.cncf.io/networks annotation.",
    )
    ucx_transports: str = Field(
        default=DEFAULT_UCX_TRANSPORTS,
        min_length=1,
        max_length=256,
        pattern=r"^\^?[a-z0-9_]+(,[a-z0-9_]+)*$",
        description="UCX_TLS: UCX transports in order, e.g. rc,sm,self (verbs, the default) "
        "or tcp,sm,self; ^x means every transport but x.",
    )
    ucx_net_devices: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$",
        description="UCX_NET_DEVICES, e.g. mlx5_0:1; default: UCX picks.",
    )
    side_channel_port: int = Field(
        default=5600,
        ge=1024,
        le=65535,
        description="TCP port of the producers' NIXL metadata side channel.",
    )
    ipc_lock: bool = Field(
        default=True,
        description="Add the IPC_LOCK capability so UCX can pin registered memory.",
    )
    shm_size: Annotated[Quantity, ByteRange(1 << 20, 1 << 40)] | None = Field(
        default=None,
        description="Size limit of the pods' memory-backed /dev/shm, which holds the "
        "registered buffer (at least bufferSize) and UCX's shared-memory segments, e.g. 8Gi; "
        "default: no limit but the container's memory limit.",
    )
    buffer_size: Annotated[Quantity, ByteRange(1 << 20, 1 << 40)] = Field(
        default="1Gi",
        description="Registered host memory per producer that holds embeddings until "
        "consumers read them. Count it in the producer's memory request.",
    )

    def settings(self) -> RdmaSettings:
        """What the connector reads (ConnectorConfig.rdma)."""
        return RdmaSettings(
            side_channel_port=self.side_channel_port,
            buffer_bytes=quantity_bytes(self.buffer_size),
        )


class ConnectorSpec(ApiModel):
    """How embeddings travel from producers to consumers: exactly one transport."""

    rules: ClassVar[tuple[Rule[ConnectorSpec], ...]] = (
        Rule(
            "",
            cel="has(self.sharedVolume) != has(self.rdma)",
            check=lambda c: (c.shared_volume is None) != (c.rdma is None),
            message="set exactly one of sharedVolume (a ReadWriteMany volume) or rdma (NIXL "
            "over UCX)",
        ),
    )

    shared_volume: SharedVolumeSpec | None = Field(
        default=None, description="Embeddings as files on a ReadWriteMany volume."
    )
    rdma: RdmaSpec | None = Field(
        default=None, description="Embeddings read over RDMA (NIXL with UCX)."
    )

    @property
    def transport(self) -> Literal["sharedVolume", "rdma"]:
        """The transport's name as ConnectorConfig and status.transport spell it."""
        return "sharedVolume" if self.shared_volume is not None else "rdma"


# ----------------------------------------------------------------------------- network


class LabelSelector(ApiModel):
    """Objects whose labels hold every pair (an empty selector matches all)."""

    match_labels: dict[LabelKey, Label] = Field(
        default_factory=dict, max_length=16, description="Labels the objects must carry."
    )

    def render(self) -> dict[str, Any]:
        return {"matchLabels": dict(self.match_labels)}


class IpBlock(ApiModel):
    """An address range (for clients outside the cluster, e.g. a load balancer's)."""

    cidr: str = Field(
        min_length=9, max_length=43, pattern=CIDR_PATTERN, description="CIDR, e.g. 10.0.0.0/8."
    )
    except_: tuple[Annotated[str, Field(max_length=43, pattern=CIDR_PATTERN)], ...] = Field(
        default=(), alias="except", max_length=16, description="CIDRs inside cidr to leave out."
    )


class NetworkPeer(ApiModel):
    """Who may connect: as a NetworkPolicyPeer (selectors by matchLabels)."""

    rules: ClassVar[tuple[Rule[NetworkPeer], ...]] = (
        Rule(
            "",
            cel="has(self.podSelector) || has(self.namespaceSelector) || has(self.ipBlock)",
            check=lambda p: (
                not (p.pod_selector is None and p.namespace_selector is None and p.ip_block is None)
            ),
            message="set at least one of podSelector, namespaceSelector or ipBlock",
        ),
    )

    pod_selector: LabelSelector | None = Field(
        default=None, description="Pods (in the pool's namespace, or the selected namespaces)."
    )
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces; {} means every namespace."
    )
    ip_block: IpBlock | None = Field(default=None, description="An address range.")

    def render(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.pod_selector is not None:
            out["podSelector"] = self.pod_selector.render()
        if self.namespace_selector is not None:
            out["namespaceSelector"] = self.namespace_selector.render()
        if self.ip_block is not None:
            out["ipBlock"] = self.ip_block.model_dump(
                mode="json", by_alias=True, exclude_defaults=True
            )
        return out


class NetworkPolicySpec(ApiModel):
    """Who may reach the pool's pods: one ingress NetworkPolicy per component.

    Clients reach the router; the router reaches producers and consumers; consumers
    reach producers (rdma: the side channel and UCX's ports); nothing reaches the
    width Job. vLLM serves /metrics on its API port, so scrapers named in
    ``metrics`` reach that port (its API still needs the pool's key) and the router's
    metrics port. Effective only where the cluster's network plugin enforces
    NetworkPolicy.
    """

    enabled: bool = Field(default=True, description="Render the policies; false removes them.")
    clients: tuple[NetworkPeer, ...] = Field(
        default=(),
        max_length=16,
        description="Who may reach the pool's endpoint (the router; without a router, the "
        "consumers and producers). Empty: anyone.",
    )
    metrics: tuple[NetworkPeer, ...] = Field(
        default=(),
        max_length=16,
        description="Scrapers allowed on the vLLM pods' port (vLLM serves /metrics beside "
        "its API, which needs the pool's key) "
        f"and on the router's metrics port ({ROUTER_METRICS_PORT}).",
    )


# ----------------------------------------------------------------------------- router


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


# ----------------------------------------------------------------------------- the pool


class WidthJobSpec(ApiModel):
    """The Job that loads the model once and measures its encoder output widths."""

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="Image of the Job; default: spec.image (it must hold vLLM and the connector).",
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Resources of the Job's container; default: spec.producer.resources.",
    )
    active_deadline_seconds: int = Field(
        default=1800,
        ge=60,
        le=86400,
        description="How long a measurement may run before the Job fails, in seconds.",
    )
    backoff_limit: int = Field(
        default=2, ge=0, le=10, description="Retries before the Job counts as failed."
    )


def _groups_have_items(spec: EncoderPoolSpec) -> bool:
    limits = spec.model.limit_mm_per_prompt
    return all(limits.get(m, 1) != 0 for g in spec.producer_groups for m in g.modalities)


def _modality_in_one_group(spec: EncoderPoolSpec) -> bool:
    # With each group's modalities unique (ProducerGroup's rule), this is CEL's "every
    # group shares a modality with exactly one group: itself".
    modalities = [m for g in spec.producer_groups for m in g.modalities]
    return len(set(modalities)) == len(modalities)


def _group_names_unique(spec: EncoderPoolSpec) -> bool:
    names = [g.name for g in spec.producer_groups]
    return len(set(names)) == len(names)


class EncoderPoolSpec(ApiModel):
    """Desired state: one model served by encoder producers and LM consumers."""

    rules: ClassVar[tuple[Rule[EncoderPoolSpec], ...]] = (
        # The API server refuses duplicates itself (producerGroups is a list map by name).
        Rule(
            ".producerGroups",
            cel=None,
            check=_group_names_unique,
            message="producer group names must be unique: rename one of the groups",
        ),
        Rule(
            ".producerGroups",
            cel="!has(self.producerGroups) || self.producerGroups.all(g, "
            "self.producerGroups.exists_one(h, h.modalities.exists(m, m in g.modalities)))",
            check=_modality_in_one_group,
            message="each modality may belong to one producer group only: the router sends "
            "every item of a modality to that modality's group; move the modality into one "
            "group",
        ),
        Rule(
            ".producerGroups",
            cel="!has(self.producerGroups) || !has(self.model.limitMmPerPrompt) || "
            "self.producerGroups.all(g, g.modalities.all(m, "
            "!(m in self.model.limitMmPerPrompt) || self.model.limitMmPerPrompt[m] > 0))",
            check=_groups_have_items,
            message="a producer group serves a modality that model.limitMmPerPrompt sets to "
            "0: no item of it can reach the group; remove the modality from the group or "
            "raise the limit",
        ),
        Rule(
            ".consumer",
            cel="!has(self.consumer.autoscaling) || self.consumer.autoscaling.minReplicas >= 1",
            check=lambda s: (
                s.consumer.autoscaling is None or s.consumer.autoscaling.min_replicas >= 1
            ),
            message="consumers cannot scale to zero (they serve every request): set "
            "minReplicas to 1 or more",
        ),
        Rule(
            ".producer",
            cel="!has(self.producer.autoscaling) || "
            "!has(self.producer.autoscaling.targetKvCacheUsage)",
            check=lambda s: (
                s.producer.autoscaling is None
                or s.producer.autoscaling.target_kv_cache_usage is None
            ),
            message="targetKvCacheUsage is a consumer signal (producers keep no KV cache): "
            "remove it from spec.producer.autoscaling",
        ),
        Rule(
            ".producerGroups",
            cel="!has(self.producerGroups) || self.producerGroups.all(g, "
            "!has(g.autoscaling) || !has(g.autoscaling.targetKvCacheUsage))",
            check=lambda s: all(
                g.autoscaling is None or g.autoscaling.target_kv_cache_usage is None
                for g in s.producer_groups
            ),
            message="targetKvCacheUsage is a consumer signal (producers keep no KV cache): "
            "remove it from the producer group's autoscaling",
        ),
    )

    model: ModelSpec = Field(description="The model and how vLLM serves it.")
    image: str = Field(
        min_length=1,
        max_length=512,
        pattern=r"^\S+$",
        description="vLLM image with the encoderpool connector installed, for producers, "
        "consumers and the width Job, e.g. registry.example.com/vllm-encoderpool:0.32.0. "
        "Pin a version: measured widths are keyed by it.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Pull policy of all images; default: Kubernetes' own."
    )
    image_pull_secrets: tuple[LocalObjectReference, ...] = Field(
        default=(), max_length=8, description="Secrets to pull all images with."
    )
    producer: RoleSpec = Field(description="Encoder-only vLLM pods (EC producers).")
    consumer: RoleSpec = Field(description="LM vLLM pods (EC consumers).")
    producer_groups: tuple[ProducerGroup, ...] = Field(
        default=(),
        max_length=MAX_PRODUCER_GROUPS,
        description="Producers per modality, each group a Deployment of its own (e.g. one "
        "for images, one for video). Empty: one producer Deployment, <pool>-producer, "
        "encodes every modality. Set: no <pool>-producer; each group is spec.producer "
        "with the group's replicas, resources, nodeSelector and tolerations, the router "
        "sends each item to its modality's group, and items of a modality in no group are "
        "encoded by the consumers.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    connector: ConnectorSpec = Field(description="How embeddings reach the consumers.")
    router: RouterSpec = Field(
        default_factory=RouterSpec, description="The pool's endpoint; on by default."
    )
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec,
        description="Ingress NetworkPolicies for the pool's pods; on by default.",
    )
    width_job: WidthJobSpec = Field(
        default_factory=WidthJobSpec, description="The encoder-width measurement Job."
    )

    def group_of(self, modality: str) -> ProducerGroup | None:
        """The producer group that encodes ``modality``; None without one."""
        return next((g for g in self.producer_groups if modality in g.modalities), None)

    def served_model_name(self) -> str:
        """What clients put in `model`: servedModelName, else the model name."""
        return self.model.served_model_name or self.model.name

    def model_identity(self, vllm_version: str) -> ModelIdentity:
        """The identity whose fingerprint keys the width report (producers run the encoder)."""
        return ModelIdentity(
            model=self.model.path(),
            revision=self.model.revision or "",
            dtype=self.model.dtype,
            tensor_parallel_size=self.producer.tensor_parallel_size,
            vllm_version=vllm_version,
            limit_mm_per_prompt=dict(self.model.limit_mm_per_prompt),
        )

    def connector_config(
        self,
        model_fingerprint: str,
        encoder_output_widths: Mapping[str, int],
        model_identity: ModelIdentity | None = None,
    ) -> ConnectorConfig:
        """The one ConnectorConfig producers and consumers of this pool get."""
        shared = self.connector.shared_volume
        rdma = self.connector.rdma
        return ConnectorConfig(
            transport=self.connector.transport,
            model_fingerprint=model_fingerprint,
            model_identity=model_identity,
            encoder_output_widths=dict(encoder_output_widths),
            shared_volume=shared.settings() if shared is not None else None,
            rdma=rdma.settings() if rdma is not None else None,
        )

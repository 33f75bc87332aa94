"""``spec.producer``, ``spec.consumer`` and ``spec.producerGroups``: each role's pods.

A role's replicas, resources, scheduling, rollout, autoscaling and what a pool owner
may add to its pods; a producer group is ``spec.producer`` for some modalities only,
with its own replicas, resources and nodes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from encoderpool_operator.api.autoscaling import Autoscaling
from encoderpool_operator.api.pod_template import (
    POD_TEMPLATE_SCHEMA,
    SECURITY_ANNOTATION_PREFIXES,
    forbidden_fields,
)
from encoderpool_operator.api.quantity import Quantity
from encoderpool_operator.api.schema import (
    DNS_SUBDOMAIN_PATTERN,
    ApiModel,
    Label,
    LabelKey,
    ResourceName,
    Rule,
)


def _cel_starts_with_any(expr: str, prefixes: tuple[str, ...]) -> str:
    """CEL: the string ``expr`` starts with one of ``prefixes``."""
    return " || ".join(f"{expr}.startsWith('{p}')" for p in prefixes)


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


# ----------------------------------------------------------------------------- groups

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

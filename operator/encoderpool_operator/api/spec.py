"""``EncoderPool.spec``: what a user asks for, and the rules that span its parts.

Every ``description`` here is what ``kubectl explain`` prints, and every bound
is one the API server enforces (the CRD is generated from these models). Rules
that span fields are each model's ``rules`` table (``schema.Rule``): one CEL
expression for the API server, one check for the operator, one message.
Helpers that turn the spec into the connector's contracts live beside it, so a
new field and its effect stay in one place.

The parts, one module each (as ``render/`` has one per family of children):

    model      spec.model: the model, its files, vLLM args and env, media fetching
    roles      spec.producer, spec.consumer (RoleSpec) and spec.producerGroups
    transport  spec.connector: sharedVolume or rdma
    network    spec.networkPolicy
    router     spec.router
    widths     spec.widthJob
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field

from encoderpool_contracts import ConnectorConfig, ModelIdentity
from encoderpool_operator.api.model import ModelSpec
from encoderpool_operator.api.network import NetworkPolicySpec
from encoderpool_operator.api.roles import MAX_PRODUCER_GROUPS, ProducerGroup, RoleSpec
from encoderpool_operator.api.router import RouterSpec
from encoderpool_operator.api.schema import ApiModel, LocalObjectReference, Rule
from encoderpool_operator.api.transport import ConnectorSpec
from encoderpool_operator.api.widths import WidthJobSpec


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

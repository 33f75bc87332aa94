"""EncoderPool samples the operator tests share: a minimal pool, patches of it that
must be refused, and every validation rule of the models (``schema.Rule``) with an
invalid sample (test_api.py checks the operator's side, test_crd_apiserver.py the API
server's)."""

from __future__ import annotations

import copy
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from encoderpool_operator.api import METADATA_NAME_RULE, ApiModel, EncoderPool, Rule, format_errors
from encoderpool_operator.api.schema import RULE_ERROR

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "examples").glob("pool-*.yaml"))

# The smallest valid pool; invalid cases are patches of it.
BASE: dict[str, Any] = {
    "apiVersion": "encoderpool.io/v1alpha1",
    "kind": "EncoderPool",
    "metadata": {"name": "pool"},
    "spec": {
        "model": {"name": "/models/tiny"},
        "image": "vllm:0.32",
        "producer": {},
        "consumer": {},
        "connector": {"sharedVolume": {"size": "1Gi"}},
    },
}


# A model on a PersistentVolumeClaim (spec.model.source).
CLAIM = {"persistentVolumeClaim": {"claimName": "models"}}


def patched(patch: dict[str, Any], base: dict[str, Any] = BASE) -> dict[str, Any]:
    """JSON merge patch (RFC 7386): maps merge, None deletes, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = patched(value, out[key])
        else:
            out[key] = copy.deepcopy(value)
    return out


def _template(spec: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"consumer": {"podTemplate": {"spec": spec}}}}


def _groups(*groups: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"producerGroups": list(groups)}}


# ----------------------------------------------------------------------------- rules


def rules() -> list[tuple[str, Rule[Any]]]:
    """Every rule of the EncoderPool models, with where its model sits in a pool."""
    out: list[tuple[str, Rule[Any]]] = [("metadata.name", METADATA_NAME_RULE)]
    seen: set[type[ApiModel]] = set()
    for path, model in _models(EncoderPool, ""):
        if model not in seen:
            seen.add(model)
            out += [(path, rule) for rule in model.rules]
    return out


def _models(model: type[ApiModel], path: str) -> Iterator[tuple[str, type[ApiModel]]]:
    yield path.lstrip("."), model
    for name, field in model.model_fields.items():
        for inner in _models_in(field.annotation):
            yield from _models(inner, f"{path}.{field.alias or name}")


def _models_in(annotation: Any) -> Iterator[type[ApiModel]]:
    if isinstance(annotation, type) and issubclass(annotation, ApiModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def refusal(patch: dict[str, Any]) -> tuple[str, str]:
    """The one error the operator refuses ``patched(patch)`` with, as (path, message)."""
    try:
        EncoderPool.model_validate(patched(patch))
    except ValidationError as e:
        (error,) = e.errors()
        assert error["type"] == RULE_ERROR, error
        path, _, message = format_errors(e).partition(": ")
        return path, message
    raise AssertionError(f"accepted: {patch}")


def rule_at(path: str, message: str | None = None) -> Rule[Any]:
    """The rule whose error names ``path`` (list indices aside) with ``message``; without
    one, the transition rule there."""
    where = re.sub(r"\[[0-9]+\]", "", path)
    (rule,) = [
        r
        for model_path, r in rules()
        if f"{model_path}{r.field_path}" == where
        and (r.message == message if message is not None else r.check is None)
    ]
    return rule


# One invalid sample per rule: (id, patch of BASE, the path the error names). The
# operator and the API server both refuse each with the rule's message at that path
# (a rule without CEL: the API server with its own "Duplicate value").
RULE_CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "autoscaling-min-over-max",
        {"spec": {"producer": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}}},
        "spec.producer.autoscaling.minReplicas",
    ),
    (
        "consumers-to-zero",
        {"spec": {"consumer": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}}},
        "spec.consumer",
    ),
    (
        "producer-kv-cache-target",
        {
            "spec": {
                "producer": {
                    "autoscaling": {"maxReplicas": 2, "targetKvCacheUsage": 0.8},
                }
            }
        },
        "spec.producer",
    ),
    (
        "group-kv-cache-target",
        _groups(
            {
                "name": "v",
                "modalities": ["video"],
                "autoscaling": {"maxReplicas": 2, "targetKvCacheUsage": 0.8},
            }
        ),
        "spec.producerGroups",
    ),
    (
        "pod-annotations-apparmor",
        {
            "spec": {
                "producer": {
                    "podAnnotations": {
                        "container.apparmor.security.beta.kubernetes.io/vllm": "unconfined"
                    }
                }
            }
        },
        "spec.producer.podAnnotations",
    ),
    (
        "pod-labels-of-ours",
        {"spec": {"producer": {"podLabels": {"app.kubernetes.io/component": "x"}}}},
        "spec.producer.podLabels",
    ),
    (
        "rollout-that-cannot-move",
        {"spec": {"producer": {"rollout": {"maxSurge": 0, "maxUnavailable": 0}}}},
        "spec.producer.rollout",
    ),
    (
        "two-transports",
        {"spec": {"connector": {"rdma": {"ucxTransports": "tcp"}}}},
        "spec.connector",
    ),
    (
        "rdma-without-a-device",
        {"spec": {"connector": {"sharedVolume": None, "rdma": {}}}},
        "spec.connector.rdma.ucxTransports",
    ),
    (
        "size-and-claim",
        {"spec": {"connector": {"sharedVolume": {"existingClaim": "cache"}}}},
        "spec.connector.sharedVolume",
    ),
    (
        "claim-without-capacity",
        {"spec": {"connector": {"sharedVolume": {"size": None, "existingClaim": "cache"}}}},
        "spec.connector.sharedVolume",
    ),
    (
        "class-with-claim",
        {
            "spec": {
                "connector": {
                    "sharedVolume": {
                        "size": None,
                        "existingClaim": "cache",
                        "capacity": "1Gi",
                        "storageClassName": "nfs",
                    }
                }
            }
        },
        "spec.connector.sharedVolume",
    ),
    (
        "capacity-over-size",
        {"spec": {"connector": {"sharedVolume": {"capacity": "2Gi"}}}},
        "spec.connector.sharedVolume.capacity",
    ),
    (
        "owned-flag",
        {"spec": {"model": {"extraArgs": ["--max-model-len", "2048", "--dtype=float16"]}}},
        "spec.model.extraArgs",
    ),
    (
        "toleration-exists-value",
        {"spec": {"producer": {"tolerations": [{"operator": "Exists", "value": "x"}]}}},
        "spec.producer.tolerations[0].value",
    ),
    (
        "toleration-seconds",
        {"spec": {"producer": {"tolerations": [{"key": "k", "tolerationSeconds": 5}]}}},
        "spec.producer.tolerations[0].tolerationSeconds",
    ),
    (
        "long-name",
        {"metadata": {"name": "p" * 51}},
        "metadata.name",
    ),
    (
        "shm-smaller-than-buffer",
        {
            "spec": {
                "connector": {"sharedVolume": None, "rdma": {"shmSize": "1Gi", "bufferSize": "2Gi"}}
            }
        },
        "spec.connector.rdma.shmSize",
    ),
    (
        "absolute-model-path-with-a-claim",
        {"spec": {"model": {"source": CLAIM}}},
        "spec.model.name",
    ),
    (
        "sub-path-escapes-its-claim",
        {
            "spec": {
                "model": {
                    "name": "tiny",
                    "source": {"persistentVolumeClaim": {"claimName": "m", "subPath": "../x"}},
                }
            }
        },
        "spec.model.source.persistentVolumeClaim.subPath",
    ),
    (
        "hub-token-and-hf-token-env",
        {
            "spec": {
                "model": {
                    "hubToken": {"secretKeyRef": {"name": "hf", "key": "token"}},
                    "env": [{"name": "HF_TOKEN", "value": "hf_literal"}],
                }
            }
        },
        "spec.model.env",
    ),
    (
        "vllm-api-key-in-env",
        {"spec": {"model": {"env": [{"name": "VLLM_API_KEY", "value": "guessable"}]}}},
        "spec.model.env",
    ),
    (
        "router-auth-without-a-router",
        {
            "spec": {
                "router": {
                    "enabled": False,
                    "auth": {"bearerTokenSecret": {"name": "clients", "key": "tokens"}},
                }
            }
        },
        "spec.router",
    ),
    (
        "modality-in-two-producer-groups",
        _groups(
            {"name": "a", "modalities": ["image"]}, {"name": "b", "modalities": ["video", "image"]}
        ),
        "spec.producerGroups",
    ),
    (
        "producer-group-of-a-modality-limited-to-0",
        {
            "spec": {
                "model": {"limitMmPerPrompt": {"image": 1, "video": 0}},
                "producerGroups": [{"name": "v", "modalities": ["video"]}],
            }
        },
        "spec.producerGroups",
    ),
    (
        "duplicate-env",
        {"spec": {"model": {"env": [{"name": "A"}, {"name": "A", "value": "x"}]}}},
        "spec.model.env",
    ),
    (
        "duplicate-producer-group-names",
        _groups({"name": "a", "modalities": ["image"]}, {"name": "a", "modalities": ["video"]}),
        "spec.producerGroups",
    ),
    (
        # <pool>-producer-consumer would be pool <pool>-producer's consumer Deployment.
        "producer-group-named-like-a-child",
        _groups({"name": "consumer", "modalities": ["image"]}),
        "spec.producerGroups[0].name",
    ),
    (
        "modality-twice-in-a-group",
        _groups({"name": "a", "modalities": ["image", "image"]}),
        "spec.producerGroups[0].modalities",
    ),
    (
        "mount-path-dot-segment",
        {"spec": {"connector": {"sharedVolume": {"mountPath": "/cache/../etc"}}}},
        "spec.connector.sharedVolume.mountPath",
    ),
    (
        "network-peer-without-a-selector",
        {"spec": {"networkPolicy": {"clients": [{}]}}},
        "spec.networkPolicy.clients[0]",
    ),
]

# Transition rules (CEL only: the operator never sees the stored object): the
# sharedVolume a pool is created with, the update, and the path the error names.
TRANSITION_CASES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("size-shrinks", {"size": "2Gi"}, {"size": "1Gi"}, "spec.connector.sharedVolume.size"),
    (
        "storage-class-changes",
        {"size": "1Gi", "storageClassName": "a"},
        {"size": "2Gi", "storageClassName": "b"},
        "spec.connector.sharedVolume",
    ),
]


# ----------------------------------------------------------------------------- other refusals

# (id, patch, field path the error must name, words of the fix): refused by the API
# server (schema bounds, enums, patterns, podTemplate's rules) and by the operator.
# More samples of some rules too (RULE_CASES has one per rule).
INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "template-service-account",
        _template({"serviceAccountName": "admin"}),
        "spec.consumer.podTemplate",
        "serviceAccountName cannot be set",
    ),
    (
        "template-host-network",
        _template({"hostNetwork": True}),
        "spec.consumer.podTemplate",
        "hostNetwork cannot be true",
    ),
    (
        "template-host-path",
        _template({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}),
        "spec.consumer.podTemplate",
        "hostPath volumes are refused",
    ),
    (
        "template-privileged",
        _template({"containers": [{"name": "x", "securityContext": {"privileged": True}}]}),
        "spec.consumer.podTemplate",
        "may not set privileged",
    ),
    (
        "template-replaces-vllm",
        _template({"containers": [{"name": "vllm", "image": "evil.example/vllm"}]}),
        "spec.consumer.podTemplate",
        "may not set image, command or args",
    ),
    (
        "template-pod-seccomp",
        _template({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}),
        "spec.consumer.podTemplate",
        "cannot be set: the operator sets the pods' seccomp profile",
    ),
    (
        "template-container-apparmor",
        _template(
            {
                "containers": [
                    {"name": "vllm", "securityContext": {"appArmorProfile": {"type": "Unconfined"}}}
                ]
            }
        ),
        "spec.consumer.podTemplate",
        "cannot be set: the operator sets the pods' seccomp profile",
    ),
    (
        "template-selinux",
        _template({"securityContext": {"seLinuxOptions": {"type": "spc_t"}}}),
        "spec.consumer.podTemplate",
        "cannot be set: the operator sets the pods' seccomp profile",
    ),
    (
        "template-proc-mount",
        _template(
            {"initContainers": [{"name": "i", "securityContext": {"procMount": "Unmasked"}}]}
        ),
        "spec.consumer.podTemplate",
        "cannot be set: the operator sets the pods' seccomp profile",
    ),
    (
        "template-run-as-group-0",
        _template({"securityContext": {"runAsGroup": 0}}),
        "spec.consumer.podTemplate",
        "runAsGroup 0",
    ),
    (
        "template-container-run-as-group-0",
        _template({"containers": [{"name": "x", "securityContext": {"runAsGroup": 0}}]}),
        "spec.consumer.podTemplate",
        "runAsGroup 0",
    ),
    (
        "template-node-name",
        _template({"nodeName": "control-plane"}),
        "spec.consumer.podTemplate",
        "nodeName cannot be set",
    ),
    (
        "template-token-volume",
        _template(
            {
                "volumes": [
                    {
                        "name": "t",
                        "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]},
                    }
                ]
            }
        ),
        "spec.consumer.podTemplate",
        "projected serviceAccountToken sources are refused",
    ),
    (
        "template-apparmor-annotation",
        {
            "spec": {
                "consumer": {
                    "podTemplate": {
                        "metadata": {
                            "annotations": {
                                "container.apparmor.security.beta.kubernetes.io/vllm": "unconfined"
                            }
                        }
                    }
                }
            }
        },
        "spec.consumer.podTemplate",
        "may not set seccomp or AppArmor profiles",
    ),
    ("no-transport", {"spec": {"connector": {"sharedVolume": None}}}, "spec.connector", "rdma"),
    (
        "rdma-node-local-transports",
        {"spec": {"connector": {"sharedVolume": None, "rdma": {"ucxTransports": "sm,self"}}}},
        "spec.connector.rdma",
        "add tcp to ucxTransports",
    ),
    ("dtype", {"spec": {"model": {"dtype": "int8"}}}, "spec.model.dtype", "bfloat16"),
    ("no-producers", {"spec": {"producer": {"replicas": 0}}}, "spec.producer.replicas", "1"),
    (
        "owned-flag-underscore",
        {"spec": {"model": {"extraArgs": ["--tensor_parallel_size", "2"]}}},
        "spec.model.extraArgs",
        "tensorParallelSize",
    ),
    ("unknown-field", {"spec": {"consumer": {"replica": 2}}}, "spec.consumer", "replica"),
    (
        "bad-quantity",
        {"spec": {"consumer": {"resources": {"limits": {"memory": "lots"}}}}},
        "spec.consumer.resources.limits",
        "",
    ),
    (
        "negative-gpus",
        {"spec": {"producer": {"resources": {"limits": {"nvidia.com/gpu": -1}}}}},
        "spec.producer.resources.limits",
        "",
    ),
    ("name-with-digit-first", {"metadata": {"name": "1pool"}}, "metadata.name", "DNS-1035"),
    (
        "service-type",
        {"spec": {"router": {"serviceType": "ExternalName"}}},
        "spec.router.serviceType",
        "ClusterIP",
    ),
    (
        "consumer-policy",
        {"spec": {"router": {"consumerPolicy": "RoundRobin"}}},
        "spec.router.consumerPolicy",
        "MediaAffinity",
    ),
    (
        "deadline",
        {"spec": {"widthJob": {"activeDeadlineSeconds": 5}}},
        "spec.widthJob.activeDeadlineSeconds",
        "60",
    ),
    (
        "network-name",
        {"spec": {"connector": {"sharedVolume": None, "rdma": {"networks": ["Bad_Net"]}}}},
        "spec.connector.rdma.networks",
        "",
    ),
    (
        "relative-mount",
        {"spec": {"connector": {"sharedVolume": {"mountPath": "cache"}}}},
        "spec.connector.sharedVolume.mountPath",
        "",
    ),
    (
        "tiny-buffer",
        {"spec": {"connector": {"sharedVolume": None, "rdma": {"bufferSize": "1Ki"}}}},
        "spec.connector.rdma.bufferSize",
        "",
    ),
    (
        "too-many-args",
        {"spec": {"model": {"extraArgs": ["--enforce-eager"] * 65}}},
        "spec.model.extraArgs",
        "",
    ),
    (
        "model-path-escapes-its-claim",
        {"spec": {"model": {"name": "tiny/../../etc", "source": CLAIM}}},
        "spec.model",
        "no '.' or '..' segments",
    ),
    (
        "model-path-is-the-claim-s-parent",
        {"spec": {"model": {"name": "..", "source": CLAIM}}},
        "spec.model",
        "relative path inside the volume",
    ),
    (
        "channel-key-in-env",
        {"spec": {"model": {"env": [{"name": "ENCODERPOOL_CHANNEL_KEY", "value": "k"}]}}},
        "spec.model.env",
        "from the pool's internal Secret",
    ),
    (
        "api-key-flag",
        {"spec": {"model": {"extraArgs": ["--api-key=guessable"]}}},
        "spec.model.extraArgs",
        "--api-key",
    ),
    (
        "router-auth-token-as-a-literal",
        {"spec": {"router": {"auth": {"token": "guessable"}}}},
        "spec.router.auth",
        "",
    ),
    (
        "router-auth-secret-key",
        {"spec": {"router": {"auth": {"bearerTokenSecret": {"name": "clients", "key": "a b"}}}}},
        "spec.router.auth.bearerTokenSecret.key",
        "",
    ),
    (
        "hub-token-as-a-literal",
        {"spec": {"model": {"hubToken": {"value": "hf_literal"}}}},
        "spec.model.hubToken",
        "",
    ),
    (
        "hub-token-secret-name",
        {"spec": {"model": {"hubToken": {"secretKeyRef": {"name": "Not_A_Name", "key": "t"}}}}},
        "spec.model.hubToken.secretKeyRef.name",
        "",
    ),
    (
        "producer-group-name",
        _groups({"name": "Images", "modalities": ["image"]}),
        "spec.producerGroups",
        "should match",
    ),
    (
        "producer-group-name-too-long",
        _groups({"name": "a" * 17, "modalities": ["image"]}),
        "spec.producerGroups",
        "16",
    ),
    (
        "producer-group-without-modalities",
        _groups({"name": "a", "modalities": []}),
        "spec.producerGroups",
        "at least 1 item",
    ),
    (
        "producer-group-replicas",
        _groups({"name": "a", "modalities": ["image"], "replicas": 0}),
        "spec.producerGroups",
        "1",
    ),
    (
        "too-many-producer-groups",
        _groups(
            *(
                {"name": f"g{i}", "modalities": [m]}
                for i, m in enumerate(["image", "video", "audio", "image"])
            )
        ),
        "spec.producerGroups",
        "at most 3 items",
    ),
]

# Refused by the operator only.
PYDANTIC_ONLY: list[tuple[str, dict[str, Any], str, str]] = [
    # The API server prunes fields off the allow-list (or refuses them under strict
    # field validation); the operator refuses them naming the field.
    (
        "template-field-off-the-list",
        _template({"restartPolicy": "Never"}),
        "spec.consumer.podTemplate",
        "restartPolicy is not a field podTemplate may set",
    ),
    (
        "template-volume-off-the-list",
        _template({"volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]}),
        "spec.consumer.podTemplate",
        "nfs is not a field podTemplate may set",
    ),
    # The schema cannot carry constraints on map keys (patternProperties is not structural).
    (
        "modality-key",
        {"spec": {"model": {"limitMmPerPrompt": {"Image": 1}}}},
        "spec.model.limitMmPerPrompt",
        "",
    ),
]

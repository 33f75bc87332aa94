"""The EncoderPool models: samples parse, invalid pools are refused naming the field,
helpers the reconcile uses, and condition transitions (pure, no cluster)."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from encoderpool_contracts import ConnectorConfig
from encoderpool_operator.api import (
    CHILDREN_OWNED,
    CONSUMERS_AVAILABLE,
    PRODUCERS_AVAILABLE,
    READY,
    ROUTER_AVAILABLE,
    WIDTHS_MEASURED,
    Condition,
    ConditionUpdate,
    EncoderPool,
    EncoderPoolStatus,
    ReplicaStatus,
    parse_quantity,
    quantity_bytes,
)
from encoderpool_operator.conditions import find_condition, ready_condition, set_condition

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "examples").glob("pool-*.yaml"))
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T1 = T0 + timedelta(minutes=5)

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


# (id, patch, field path the error must name, words of the fix). Shared with
# test_crd_apiserver.py: the API server must refuse the same pools.
def _template(spec: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"consumer": {"podTemplate": {"spec": spec}}}}


def _groups(*groups: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"producerGroups": list(groups)}}


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
        "may not set seccomp or AppArmor profiles",
    ),
    (
        "pod-labels-of-ours",
        {"spec": {"producer": {"podLabels": {"app.kubernetes.io/component": "x"}}}},
        "spec.producer.podLabels",
        "may not set app.kubernetes.io/*",
    ),
    (
        "rollout-that-cannot-move",
        {"spec": {"producer": {"rollout": {"maxSurge": 0, "maxUnavailable": 0}}}},
        "spec.producer.rollout",
        "cannot both be 0",
    ),
    (
        "two-transports",
        {"spec": {"connector": {"rdma": {"ucxTransports": "tcp"}}}},
        "spec.connector",
        "exactly one of sharedVolume",
    ),
    ("no-transport", {"spec": {"connector": {"sharedVolume": None}}}, "spec.connector", "rdma"),
    (
        "rdma-without-a-device",
        {"spec": {"connector": {"sharedVolume": None, "rdma": {}}}},
        "spec.connector.rdma",
        "set resourceName (your RDMA device plugin's resource, e.g. rdma/hca), or networks",
    ),
    (
        "rdma-node-local-transports",
        {"spec": {"connector": {"sharedVolume": None, "rdma": {"ucxTransports": "sm,self"}}}},
        "spec.connector.rdma",
        "add tcp to ucxTransports",
    ),
    (
        "size-and-claim",
        {"spec": {"connector": {"sharedVolume": {"existingClaim": "cache"}}}},
        "spec.connector.sharedVolume",
        "exactly one of size",
    ),
    (
        "claim-without-capacity",
        {"spec": {"connector": {"sharedVolume": {"size": None, "existingClaim": "cache"}}}},
        "spec.connector.sharedVolume",
        "capacity is required",
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
        "storageClassName applies only",
    ),
    (
        "capacity-over-size",
        {"spec": {"connector": {"sharedVolume": {"capacity": "2Gi"}}}},
        "spec.connector.sharedVolume",
        "capacity must not exceed size",
    ),
    ("dtype", {"spec": {"model": {"dtype": "int8"}}}, "spec.model.dtype", "bfloat16"),
    ("no-producers", {"spec": {"producer": {"replicas": 0}}}, "spec.producer.replicas", "1"),
    (
        "owned-flag",
        {"spec": {"model": {"extraArgs": ["--max-model-len", "2048", "--dtype=float16"]}}},
        "spec.model.extraArgs",
        "spec.model",
    ),
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
    (
        "toleration-exists-value",
        {"spec": {"producer": {"tolerations": [{"operator": "Exists", "value": "x"}]}}},
        "spec.producer.tolerations",
        "value must be empty",
    ),
    (
        "toleration-seconds",
        {"spec": {"producer": {"tolerations": [{"key": "k", "tolerationSeconds": 5}]}}},
        "spec.producer.tolerations",
        "NoExecute",
    ),
    ("long-name", {"metadata": {"name": "p" * 51}}, "metadata.name", "at most 50"),
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
        "shm-smaller-than-buffer",
        {
            "spec": {
                "connector": {"sharedVolume": None, "rdma": {"shmSize": "1Gi", "bufferSize": "2Gi"}}
            }
        },
        "spec.connector.rdma",
        "shmSize must be at least bufferSize",
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
        "absolute-model-path-with-a-claim",
        {"spec": {"model": {"source": CLAIM}}},  # BASE's name is /models/tiny
        "spec.model",
        "relative path inside the volume",
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
        "relative path inside the volume",
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
        "spec.model",
        "HF_TOKEN is set from hubToken",
    ),
    (
        "vllm-api-key-in-env",
        {"spec": {"model": {"env": [{"name": "VLLM_API_KEY", "value": "guessable"}]}}},
        "spec.model.env",
        "VLLM_API_KEY and ENCODERPOOL_CHANNEL_KEY are set by the operator",
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
        "auth needs the router",
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
        "modality-in-two-producer-groups",
        _groups(
            {"name": "a", "modalities": ["image"]}, {"name": "b", "modalities": ["video", "image"]}
        ),
        "spec.producerGroups",
        "each modality may belong to one producer group only",
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
        "limitMmPerPrompt sets to 0",
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

# Refused by pydantic only (the CRD cannot check map keys or duplicates in a plain list
# cheaply, or the bound depends on quantity arithmetic the schema does not do).
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
    (
        "duplicate-env",
        {"spec": {"model": {"env": [{"name": "A"}, {"name": "A", "value": "x"}]}}},
        "spec.model.env",
        "duplicate env names",
    ),
    (
        "modality-key",
        {"spec": {"model": {"limitMmPerPrompt": {"Image": 1}}}},
        "spec.model.limitMmPerPrompt",
        "",
    ),
    # The API server refuses these too, as duplicates of a map key or set entry
    # (test_crd_apiserver.py), in its own words.
    (
        "duplicate-producer-group-names",
        _groups({"name": "a", "modalities": ["image"]}, {"name": "a", "modalities": ["video"]}),
        "spec.producerGroups",
        "producer group names must be unique",
    ),
    (
        "modality-twice-in-a-group",
        _groups({"name": "a", "modalities": ["image", "image"]}),
        "spec.producerGroups",
        "list each modality once per group",
    ),
]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_parse_and_round_trip(path: Path) -> None:
    pool = EncoderPool.from_object(yaml.safe_load(path.read_text()))
    again = EncoderPool.model_validate(pool.model_dump(mode="json"))
    assert again == pool
    assert pool.name
    assert pool.spec.model.name


def test_both_transports_have_a_sample() -> None:
    transports = {
        EncoderPool.from_object(yaml.safe_load(p.read_text())).spec.connector.transport
        for p in SAMPLES
    }
    assert transports == {"sharedVolume", "rdma"}


def test_minimal_pool_gets_fixed_defaults() -> None:
    spec = EncoderPool.model_validate(BASE).spec
    assert spec.model.dtype == "bfloat16"
    assert (spec.producer.replicas, spec.consumer.replicas) == (1, 1)
    assert spec.router.enabled
    assert spec.router.port == 8000
    assert spec.router.service_type == "ClusterIP"
    assert spec.router.consumer_policy == "LeastBusy"
    sv = spec.connector.shared_volume
    assert sv is not None
    assert sv.mount_path == "/var/cache/encoderpool"
    assert sv.eviction == "lru"
    assert spec.width_job.active_deadline_seconds == 1800
    assert spec.served_model_name() == "/models/tiny"


def test_what_the_api_server_returns_parses() -> None:
    """Server-filled metadata, int quantities, status with conditions, kopf-like mappings."""
    obj = patched(
        {
            "metadata": {
                "namespace": "ml",
                "uid": "0b7c",
                "generation": 3,
                "resourceVersion": "42",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}],
            },
            "spec": {"producer": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
            "status": {
                "observedGeneration": 3,
                "producers": {"desired": 2, "ready": 1, "available": 1, "summary": "1/2"},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "False",
                        "reason": "ProducersUnavailable",
                        "message": "1/2 producers",
                        "observedGeneration": 3,
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }
                ],
            },
        }
    )
    pool = EncoderPool.from_object(obj)
    assert (pool.name, pool.namespace, pool.generation) == ("pool", "ml", 3)
    assert pool.spec.producer.resources.limits == {"nvidia.com/gpu": "1"}
    assert find_condition(pool.status.conditions, READY) is not None
    assert pool.status.producers == ReplicaStatus(desired=2, ready=1, available=1)


@pytest.mark.parametrize(
    ("case", "patch", "field", "fix"),
    INVALID + PYDANTIC_ONLY,
    ids=[c[0] for c in INVALID + PYDANTIC_ONLY],
)
def test_invalid_pool_is_refused_naming_the_field(
    case: str, patch: dict[str, Any], field: str, fix: str
) -> None:
    with pytest.raises(ValueError, match="invalid") as info:
        EncoderPool.from_object(patched(patch))
    message = str(info.value)
    assert message.startswith("EncoderPool "), message
    assert field in message, message
    assert fix in message, message


def test_error_names_the_object() -> None:
    obj = patched({"metadata": {"namespace": "ml"}, "spec": {"model": {"dtype": "fp8"}}})
    with pytest.raises(ValueError, match=r"^EncoderPool ml/pool is invalid: spec\.model\.dtype"):
        EncoderPool.from_object(obj)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Gi", 1 << 30),
        ("1.5Gi", 3 << 29),
        ("500M", 500_000_000),
        ("1e3", 1000),
        ("2E", 2e18),
        ("1E3", 1000),
        ("250m", 0.25),
        ("3", 3),
        (3, 3),
    ],
)
def test_quantity(text: str | int, value: float) -> None:
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "1GB", "-1Gi", "Gi", "1 Gi"])
def test_bad_quantity(text: str) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(text)


def test_fractional_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        quantity_bytes("1500m")


def test_model_identity_is_stable_and_follows_the_spec() -> None:
    spec = EncoderPool.model_validate(BASE).spec
    identity = spec.model_identity("0.32.0")
    assert identity.model == "/models/tiny"
    assert identity.vllm_version == "0.32.0"
    assert identity.fingerprint() == spec.model_identity("0.32.0").fingerprint()
    other = EncoderPool.model_validate(patched({"spec": {"model": {"dtype": "float32"}}})).spec
    assert other.model_identity("0.32.0").fingerprint() != identity.fingerprint()


@pytest.mark.parametrize(
    "rdma",
    [
        {"ucxTransports": "tcp,sm,self"},  # the kind and local test beds
        {"ucxTransports": "rc,tcp"},
        {"ucxTransports": "^rc"},  # every transport but rc: tcp included
        {"ucxTransports": "all"},
        {"resourceName": "rdma/hca"},
        {"networks": ["rdma-net"]},
    ],
)
def test_rdma_that_can_reach_another_node_is_accepted(rdma: dict[str, Any]) -> None:
    obj = patched({"spec": {"connector": {"sharedVolume": None, "rdma": rdma}}})
    assert EncoderPool.from_object(obj).spec.connector.transport == "rdma"


@pytest.mark.parametrize(
    ("connector", "transport"),
    [
        ({"sharedVolume": {"size": "10Gi"}}, "sharedVolume"),
        ({"sharedVolume": {"existingClaim": "c", "capacity": "5Gi"}}, "sharedVolume"),
        ({"rdma": {"bufferSize": "2Gi", "sideChannelPort": 6000, "networks": ["n"]}}, "rdma"),
    ],
)
def test_connector_config_round_trips_through_the_connector(
    connector: dict[str, Any], transport: str
) -> None:
    obj = copy.deepcopy(BASE)
    obj["spec"]["connector"] = connector
    spec = EncoderPool.model_validate(obj).spec
    config = spec.connector_config("0123456789abcdef", {"image": 128})
    parsed = ConnectorConfig.from_extra_config(config.to_extra_config())
    assert parsed == config
    assert parsed.transport == transport
    if parsed.shared_volume is not None:
        cap = connector["sharedVolume"].get("capacity")
        want = quantity_bytes(cap) if cap else (10 << 30) * 9 // 10
        assert parsed.shared_volume.capacity_bytes == want
    if parsed.rdma is not None:
        assert (parsed.rdma.buffer_bytes, parsed.rdma.side_channel_port) == (2 << 30, 6000)


def test_replica_summary_is_derived() -> None:
    assert ReplicaStatus(desired=3, ready=2, available=1).summary == "2/3"
    assert ReplicaStatus.model_validate({"desired": 3, "ready": 3, "summary": "9/9"}).summary == (
        "3/3"
    )


def test_times_are_utc_seconds() -> None:
    cond = Condition.model_validate(
        {
            "type": READY,
            "status": "True",
            "reason": "AllAvailable",
            "lastTransitionTime": "2026-01-01T02:00:00.123456+02:00",
        }
    )
    assert cond.last_transition_time == T0
    assert cond.model_dump(mode="json")["lastTransitionTime"] == "2026-01-01T00:00:00Z"


# ------------------------------------------------------------------ conditions


def _update(type_: str, status: str, reason: str = "Because", **kw: Any) -> ConditionUpdate:
    return ConditionUpdate.model_validate({"type": type_, "status": status, "reason": reason, **kw})


def _set(*updates: ConditionUpdate, now: datetime = T0) -> tuple[Condition, ...]:
    conds: tuple[Condition, ...] = ()
    for u in updates:
        conds = set_condition(conds, u, now)
    return conds


@pytest.mark.parametrize(
    ("old", "new", "moves"),
    [
        ("True", "True", False),
        ("False", "False", False),
        ("True", "False", True),
        ("False", "True", True),
        ("Unknown", "True", True),
        ("True", "Unknown", True),
    ],
)
def test_transition_time_moves_only_when_status_flips(old: str, new: str, moves: bool) -> None:
    before = _set(_update(READY, old, "Old", message="old", observed_generation=1))
    after = set_condition(
        before, _update(READY, new, "New", message="new", observed_generation=2), T1
    )
    (cond,) = after
    assert cond.last_transition_time == (T1 if moves else T0)
    # Everything else always follows the update.
    assert (cond.status, cond.reason, cond.message, cond.observed_generation) == (
        new,
        "New",
        "new",
        2,
    )


def test_new_type_is_appended_and_others_are_untouched() -> None:
    before = _set(_update(WIDTHS_MEASURED, "True"), _update(PRODUCERS_AVAILABLE, "False"))
    after = set_condition(before, _update(CONSUMERS_AVAILABLE, "True"), T1)
    assert [c.type for c in after] == [WIDTHS_MEASURED, PRODUCERS_AVAILABLE, CONSUMERS_AVAILABLE]
    assert after[:2] == before
    assert after[2].last_transition_time == T1
    replaced = set_condition(after, _update(WIDTHS_MEASURED, "False"), T1)
    assert [c.type for c in replaced] == [c.type for c in after]


def test_unchanged_condition_gives_an_identical_status() -> None:
    """A reconcile pass that observes nothing new must not produce a write."""
    status = EncoderPoolStatus(conditions=_set(_update(READY, "True", "AllAvailable")))
    again = status.model_copy(
        update={
            "conditions": set_condition(
                status.conditions, _update(READY, "True", "AllAvailable"), T1
            )
        }
    )
    assert again.model_dump(mode="json") == status.model_dump(mode="json")


ALL_TRUE = (
    CHILDREN_OWNED,
    WIDTHS_MEASURED,
    PRODUCERS_AVAILABLE,
    CONSUMERS_AVAILABLE,
    ROUTER_AVAILABLE,
)


@pytest.mark.parametrize(
    ("statuses", "router", "want"),
    [
        (dict.fromkeys(ALL_TRUE, "True"), True, ("True", "AllAvailable")),
        (dict.fromkeys(ALL_TRUE[:-1], "True"), False, ("True", "AllAvailable")),
        (dict.fromkeys(ALL_TRUE[:-1], "True"), True, ("Unknown", "Pending")),
        ({**dict.fromkeys(ALL_TRUE, "True"), PRODUCERS_AVAILABLE: "False"}, True, ("False", "R")),
        ({**dict.fromkeys(ALL_TRUE, "True"), WIDTHS_MEASURED: "Unknown"}, True, ("Unknown", "R")),
        ({}, True, ("Unknown", "Pending")),
    ],
)
def test_ready_summarizes_the_others(
    statuses: dict[str, str], router: bool, want: tuple[str, str]
) -> None:
    conds = _set(*[_update(t, s, "R" if s != "True" else "Ok") for t, s in statuses.items()])
    ready = ready_condition(conds, router_enabled=router, observed_generation=7)
    assert (ready.type, ready.status, ready.reason) == (READY, *want)
    assert ready.observed_generation == 7

"""Pure functions from an EncoderPool (plus what was measured) to the objects it needs.

No I/O here: the reconcile applies what these return, and tests read them
directly. Every child has a fixed name derived from the pool's, the pool as
its controller owner (so deleting the pool deletes them), the
``app.kubernetes.io/*`` labels, and only the fields we mean to own (they are
server-side applied).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from encoderpool_contracts import (
    ADVERTISE_HOST_ENV,
    CHANNEL_KEY_ENV,
    CONFIGMAP_KEY,
    LABEL_FINGERPRINT,
    VLLM_API_KEY_ENV,
    ConnectorConfig,
    ModelIdentity,
    WidthReport,
    configmap_name,
)
from encoderpool_contracts import API_GUARD_MIDDLEWARE as API_GUARD
from encoderpool_contracts.pod import (
    CONNECTOR_CLASSES,
    HTTP_PORT,
    MEASURE_MODULE,
    ROUTER_METRICS_PORT,
)
from encoderpool_contracts.router_args import BACKEND_API_KEY_ENV, POOL_UID_ENV, RouterArgs
from encoderpool_operator.api import (
    API_VERSION,
    HUB_TOKEN_ENV,
    KIND,
    EncoderPool,
    ProducerGroup,
    ResourceRequirements,
    RoleSpec,
)

ROUTER_REUSE_SECONDS = 60
LABEL_POOL = "encoderpool.io/pool"
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_CONFIG_HASH = "encoderpool.io/config-hash"
# On every child: a digest of everything the operator applies to it. A field removed
# from the spec changes the digest, so the pass sees the change and re-applies, and
# server-side apply drops the field (is_subset alone cannot see a removal).
ANNOTATION_DIGEST = "encoderpool.io/spec-digest"
# The longest object name the children may take (Services and Job names: DNS-1035 labels;
# a Job's name is also a label value on its pods).
MAX_CHILD_NAME = 63
MANAGED_BY = "encoderpool-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
PRODUCER, CONSUMER, ROUTER, WIDTH_JOB = "producer", "consumer", "router", "width-job"
MEASURE_CONTAINER = "measure"
REPORT_COMPONENT = "width-report"
# On width reports and Jobs: the key reports are named and shared by (``report_key``).
LABEL_REPORT_KEY = "encoderpool.io/width-report-key"
# On a report the operator stored: ``report_digest`` of its data (see there).
ANNOTATION_REPORT_DIGEST = "encoderpool.io/width-report-digest"
# The per-pool Secret <pool>-internal: made by the operator (random values, see
# reconcile/act.py), never read by it; pods get its keys by secretKeyRef.
INTERNAL = "internal"
VLLM_API_KEY_KEY = "vllm-api-key"  # the router's key toward producers and consumers
CHANNEL_KEY_KEY = "channel-key"  # the pool key: rdma messages, shared-volume entries
INTERNAL_KEYS = (VLLM_API_KEY_KEY, CHANNEL_KEY_KEY)
# The router's copy of VLLM_API_KEY (RouterSettings.backend_api_key).
# Where the router pods see the client tokens (spec.router.auth): a Secret volume, so
# Kubernetes updates the file when the Secret changes (a subPath mount would not be).
CLIENT_TOKENS_DIR = "/etc/encoderpool/client-tokens"
CLIENT_TOKENS_FILE = "tokens"
# Where the width Job's container leaves its report; the kubelet keeps it in the pod's status.
TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True)
class Defaults:
    """Operator-wide settings a reconcile needs (from OperatorSettings)."""

    router_image: str
    width_retry_seconds: float = 30.0  # first back-off after a failed width Job


# ------------------------------------------------------------------ helpers


def selector_labels(pool: EncoderPool, component: str) -> dict[str, str]:
    """Labels that select a component's pods; they never change for a pool."""
    return {
        "app.kubernetes.io/name": "encoderpool",
        "app.kubernetes.io/instance": pool.name,
        LABEL_COMPONENT: component,
    }


def labels(pool: EncoderPool, component: str) -> dict[str, str]:
    return {
        **selector_labels(pool, component),
        LABEL_MANAGED_BY: MANAGED_BY,
        "app.kubernetes.io/part-of": "encoderpool",
        LABEL_POOL: pool.name,
    }


def owner_reference(pool: EncoderPool) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pool.name,
        "uid": pool.metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(pool: EncoderPool, name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": labels(pool, component),
        "ownerReferences": [owner_reference(pool)],
        **extra,
    }


def name_of(pool: EncoderPool, component: str) -> str:
    """Fixed child names: <pool>-producer, <pool>-consumer, <pool>-router; the Service is <pool>.

    A producer group's component (producer-<group>) can make the name longer than 63
    characters: then it is cut as ``bounded_name`` cuts it."""
    return bounded_name(pool.name, f"-{component}")


def bounded_name(pool_name: str, suffix: str) -> str:
    """<pool><suffix>, at most 63 characters: a long pool name is cut and a hash of the
    whole name keeps two long names with one prefix apart."""
    name = pool_name + suffix
    if len(name) <= MAX_CHILD_NAME:
        return name
    tag = hashlib.sha256(pool_name.encode()).hexdigest()[:6]
    head = pool_name[: MAX_CHILD_NAME - len(suffix) - len(tag) - 1].rstrip("-")
    return f"{head}-{tag}{suffix}"


def width_job_name(pool: EncoderPool, key: str) -> str:
    """<pool>-width-<report key>, at most 63 characters (``bounded_name``)."""
    return bounded_name(pool.name, f"-width-{key[:10]}")


def group_component(group: ProducerGroup) -> str:
    """The component (label value and name suffix) of a producer group's children."""
    return f"{PRODUCER}-{group.name}"


def producer_components(pool: EncoderPool) -> list[tuple[str, RoleSpec]]:
    """Each producer Deployment as (component, its pod settings): ``producer`` alone, or
    one ``producer-<group>`` per spec.producerGroups entry (and then no ``producer``)."""
    spec = pool.spec
    if not spec.producer_groups:
        return [(PRODUCER, spec.producer)]
    return [(group_component(g), g.role(spec.producer)) for g in spec.producer_groups]


def _resources(res: ResourceRequirements | None) -> dict[str, Any]:
    if res is None:
        return {}
    out: dict[str, Any] = {}
    if res.requests:
        out["requests"] = dict(res.requests)
    if res.limits:
        out["limits"] = dict(res.limits)
    return out


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """podTemplate semantics: maps merge key by key, lists of named entries (containers,
    volumes, volumeMounts, env, ports, ...) merge entry by entry on ``name`` (new names
    are appended), anything else in ``override`` replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        have = out.get(key)
        if isinstance(value, Mapping) and isinstance(have, Mapping):
            out[key] = deep_merge(have, value)
        elif isinstance(have, list) and _named_list(value) and _named_list(have):
            out[key] = _merge_named(have, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _named_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, Mapping) and "name" in v for v in value)


def _merge_named(base: list[Any], override: list[Any]) -> list[Any]:
    out = [copy.deepcopy(dict(v)) for v in base]
    index = {v["name"]: i for i, v in enumerate(out)}
    for entry in override:
        if entry["name"] in index:
            out[index[entry["name"]]] = deep_merge(out[index[entry["name"]]], entry)
        else:
            index[entry["name"]] = len(out)
            out.append(copy.deepcopy(dict(entry)))
    return out


def config_hash(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _scheduling(role: RoleSpec) -> dict[str, Any]:
    """A role's nodeSelector and tolerations, as pod spec fields (none when unset)."""
    out: dict[str, Any] = {}
    if role.node_selector:
        out["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        out["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in role.tolerations
        ]
    return out


def _model_env(pool: EncoderPool) -> list[dict[str, Any]]:
    """The user's env, then HF_TOKEN from the hub token's Secret (a reference, never a value)."""
    model = pool.spec.model
    env: list[dict[str, Any]] = [{"name": e.name, "value": e.value} for e in model.env]
    if model.hub_token is not None:
        ref = model.hub_token.secret_key_ref
        env.append(
            {
                "name": HUB_TOKEN_ENV,
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    return env


def _model_volume(pool: EncoderPool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The model's claim as a read-only volume and its mount; none without a source."""
    source = pool.spec.model.source
    if source is None:
        return [], []
    claim = source.persistent_volume_claim
    mount: dict[str, Any] = {"name": "model", "mountPath": claim.mount_path, "readOnly": True}
    if claim.sub_path:
        mount["subPath"] = claim.sub_path
    volume = {
        "name": "model",
        "persistentVolumeClaim": {"claimName": claim.claim_name, "readOnly": True},
    }
    return [volume], [mount]


def _internal_key(pool: EncoderPool, env: str, key: str) -> dict[str, Any]:
    """Env ``env`` from key ``key`` of the pool's internal Secret (a reference, never a value)."""
    return {
        "name": env,
        "valueFrom": {"secretKeyRef": {"name": name_of(pool, INTERNAL), "key": key}},
    }


def internal_secret(pool: EncoderPool) -> dict[str, Any]:
    """``<pool>-internal`` without its data: ``act`` fills ``INTERNAL_KEYS`` with fresh
    random values when it creates it. Owned by the pool, so it goes with the pool."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(pool, name_of(pool, INTERNAL), INTERNAL),
        "type": "Opaque",
    }


def _pull_secrets(pool: EncoderPool) -> dict[str, Any]:
    secrets = pool.spec.image_pull_secrets
    return {"imagePullSecrets": [{"name": s.name} for s in secrets]} if secrets else {}


_RESTRICTED_CONTAINER: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
_RESTRICTED_POD: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}


# ------------------------------------------------------------ vLLM workloads


# Pod and container fields a podTemplate may never keep (validation refuses them too).
_POD_NEVER = (
    "serviceAccountName", "serviceAccount", "nodeName", "hostNetwork", "hostPID", "hostIPC",
)  # fmt: skip
_CONTEXT_NEVER = ("appArmorProfile", "seLinuxOptions", "windowsOptions", "procMount", "sysctls")


def restrict(pod_spec: dict[str, Any], vllm_security: Mapping[str, Any]) -> None:
    """Our restricted fields again, after podTemplate merged over the pod: they win
    whatever the template says. Validation refuses the overrides first; this holds if
    one ever slips through, and covers containers the template adds. A pod without a
    template is left as rendered (so upgrading rolls no pod)."""
    pod_spec["automountServiceAccountToken"] = False
    for key in _POD_NEVER:
        pod_spec.pop(key, None)
    ctx = pod_spec.setdefault("securityContext", {})
    for key in (*_CONTEXT_NEVER, "seLinuxChangePolicy"):
        ctx.pop(key, None)
    ctx.update(runAsNonRoot=True, seccompProfile=copy.deepcopy(_RESTRICTED_POD["seccompProfile"]))
    for key in ("runAsUser", "runAsGroup"):
        if ctx.get(key) == 0:
            ctx[key] = _RESTRICTED_POD[key]
    for field in ("containers", "initContainers"):
        for c in pod_spec.get(field) or []:
            sc = c.setdefault("securityContext", {})
            for key in _CONTEXT_NEVER:
                sc.pop(key, None)
            if sc.get("privileged") is True:
                del sc["privileged"]
            for key in ("runAsUser", "runAsGroup"):
                if sc.get(key) == 0:
                    del sc[key]
            mine = vllm_security if c.get("name") == "vllm" else _RESTRICTED_CONTAINER
            sc.update(copy.deepcopy(dict(mine)))


def ec_transfer_config(pool: EncoderPool, config: ConnectorConfig, role: str) -> str:
    """The ``--ec-transfer-config`` JSON; producer and consumer differ only in ec_role."""
    connector, module = CONNECTOR_CLASSES[config.transport]
    return json.dumps(
        {
            "ec_connector": connector,
            "ec_connector_module_path": module,
            "ec_role": "ec_producer" if role == PRODUCER else "ec_consumer",
            "ec_connector_extra_config": config.to_extra_config(),
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def vllm_args(pool: EncoderPool, role: str, config: ConnectorConfig) -> list[str]:
    """`vllm serve` arguments of one role: typed fields first, the user's extras last."""
    spec = pool.spec
    role_spec = spec.producer if role == PRODUCER else spec.consumer
    args = [
        "serve", spec.model.path(),
        "--served-model-name", spec.served_model_name(),
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--dtype", spec.model.dtype,
        "--tensor-parallel-size", str(role_spec.tensor_parallel_size),
        # Every route but /health and /metrics needs VLLM_API_KEY (vLLM's own key check
        # leaves /invocations, /tokenize and more open).
        "--middleware", API_GUARD,
    ]  # fmt: skip
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.limit_mm_per_prompt:
        args += [
            "--limit-mm-per-prompt",
            json.dumps(dict(spec.model.limit_mm_per_prompt), sort_keys=True),
        ]
    if spec.model.media.allowed_domains:
        args += ["--allowed-media-domains", *spec.model.media.allowed_domains]
    if spec.router.trust_request_mm_kwargs:  # the router's rule and vLLM's, set together
        args += ["--trust-request-mm-kwargs"]
    args += ["--ec-transfer-config", ec_transfer_config(pool, config, role)]
    args += list(spec.model.extra_args)
    return args


def _rdma_bits(pool: EncoderPool) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, Any]]:
    """Pod annotations, env and resource additions for the rdma transport."""
    rdma = pool.spec.connector.rdma
    if rdma is None:
        return {}, [], {}
    annotations = {}
    if rdma.networks:
        annotations["k8s.v1.cni.cncf.io/networks"] = ",".join(rdma.networks)
    env: list[dict[str, Any]] = [
        {"name": "UCX_TLS", "value": rdma.ucx_transports},
        # Producers tell consumers where to READ from: their own pod IP.
        {
            "name": ADVERTISE_HOST_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
    ]
    if rdma.ucx_net_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": rdma.ucx_net_devices})
    extra: dict[str, Any] = {}
    if rdma.resource_name:
        extra = {rdma.resource_name: str(rdma.resource_count)}
    return annotations, env, extra


def hash_seed(pool: EncoderPool) -> str:
    """One string-hash seed for every process of a tensor-parallel pod.

    vLLM 0.32 measures an EC producer's encoder output widths at start-up by encoding
    one dummy item per modality on every rank, iterating a *set* of modalities
    (``MultiModalBudget``). Its workers are spawned, so each has its own hash seed and
    may walk the modalities in another order: the ranks' collectives then mismatch and
    the engine fails to start (seen with TP 2 and Qwen2-VL's image and video). A seed
    shared by the pod's processes fixes the order. It is derived from the pool's uid,
    which no client can read, rather than a constant, so that no client can compute
    colliding dict keys for vLLM's JSON parsing.
    """
    digest = hashlib.sha256(f"encoderpool-hash-seed/{pool.metadata['uid']}".encode()).digest()
    return str(int.from_bytes(digest[:4], "big"))


def vllm_deployment(
    pool: EncoderPool,
    role: str,
    config: ConnectorConfig,
    component: str | None = None,
    role_spec: RoleSpec | None = None,
) -> dict[str, Any]:
    """The Deployment of one role; a producer group passes its component and pod settings
    (everything else, the connector config included, is the pool's, as for any producer)."""
    spec = pool.spec
    component = component or role
    if role_spec is None:
        role_spec = spec.producer if role == PRODUCER else spec.consumer
    pod_annotations, rdma_env, rdma_resources = _rdma_bits(pool)
    resources = _resources(role_spec.resources)
    for key in ("requests", "limits"):
        if rdma_resources:
            resources[key] = {**resources.get(key, {}), **rdma_resources}
    env = _model_env(pool)
    env += rdma_env
    if role_spec.tensor_parallel_size > 1:
        env.append({"name": "PYTHONHASHSEED", "value": hash_seed(pool)})
    env += [
        # With the guard in vllm_args, every route but /health and /metrics needs this
        # key: only the router has it (and the user's own proxy when the router is off).
        _internal_key(pool, VLLM_API_KEY_ENV, VLLM_API_KEY_KEY),
        _internal_key(pool, CHANNEL_KEY_ENV, CHANNEL_KEY_KEY),
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "DO_NOT_TRACK", "value": "1"},
        {"name": "HOME", "value": "/home/vllm"},
        # A redirect can lead a media fetch anywhere (the last value of a name wins).
        {
            "name": "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
            "value": "1" if spec.model.media.allow_redirects else "0",
        },
    ]
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "home", "mountPath": "/home/vllm"},
    ]
    shm: dict[str, Any] = {"medium": "Memory"}
    rdma = spec.connector.rdma
    if rdma is not None and rdma.shm_size:
        shm["sizeLimit"] = rdma.shm_size
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": shm},
        {"name": "home", "emptyDir": {}},
    ]
    model_volumes, model_mounts = _model_volume(pool)
    volumes += model_volumes
    mounts += model_mounts
    shared = spec.connector.shared_volume
    if shared is not None:
        claim = shared.existing_claim or name_of(pool, "cache")
        volumes.append({"name": "ec-cache", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "ec-cache", "mountPath": shared.mount_path})
    security: dict[str, Any] = copy.deepcopy(_RESTRICTED_CONTAINER)
    if rdma is not None and rdma.ipc_lock:
        # Registering memory with an RDMA NIC pins pages: the one capability RDMA needs.
        security["capabilities"] = {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.image,
        "command": ["vllm"],
        "args": vllm_args(pool, role, config),
        "env": env,
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "securityContext": security,
        # Model load can take many minutes; readiness gates traffic, liveness restarts hangs.
        "startupProbe": _http_probe(period=10, failures=180),
        "readinessProbe": _http_probe(period=5, failures=3),
        "livenessProbe": _http_probe(period=15, failures=4),
    }
    if resources:
        container["resources"] = resources
    if rdma is not None:
        container["ports"].append(
            {"name": "nixl", "containerPort": rdma.side_channel_port, "protocol": "TCP"}
        )
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": copy.deepcopy(_RESTRICTED_POD),
        "automountServiceAccountToken": False,  # vLLM never talks to the API server
        "enableServiceLinks": False,
    }
    pod_spec.update(_scheduling(role_spec))
    if role_spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(role_spec.affinity)
    if role_spec.priority_class_name:
        pod_spec["priorityClassName"] = role_spec.priority_class_name
    if role_spec.topology_spread_constraints:
        selector = selector_labels(pool, component)
        pod_spec["topologySpreadConstraints"] = [
            c.render(selector) for c in role_spec.topology_spread_constraints
        ]
    pod_spec.update(_pull_secrets(pool))
    template: dict[str, Any] = {
        "metadata": {
            "labels": {**role_spec.pod_labels, **labels(pool, component)},
            "annotations": {
                **role_spec.pod_annotations,
                **pod_annotations,
                ANNOTATION_CONFIG_HASH: config_hash(container, pod_spec),
            },
        },
        "spec": pod_spec,
    }
    if role_spec.pod_template:
        template = deep_merge(template, role_spec.pod_template)
        restrict(template["spec"], security)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(pool, name_of(pool, component), component),
        "spec": {
            "replicas": role_spec.replicas,
            "selector": {"matchLabels": selector_labels(pool, component)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": role_spec.rollout.max_surge,
                    "maxUnavailable": role_spec.rollout.max_unavailable,
                },
            },
            "template": template,
        },
    }


def _http_probe(period: int, failures: int, path: str = "/health") -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def service(
    pool: EncoderPool, name: str, component: str, port: int, headless: bool = False
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": selector_labels(pool, component),
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
    }
    if headless:
        spec["clusterIP"] = "None"  # the router talks to each producer pod directly
    elif component == ROUTER:
        spec["type"] = pool.spec.router.service_type
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, name, component),
        "spec": spec,
    }


def cache_claim(pool: EncoderPool) -> dict[str, Any] | None:
    """The ReadWriteMany PVC every vLLM pod mounts; None with an existing claim or rdma."""
    shared = pool.spec.connector.shared_volume
    if shared is None or shared.existing_claim or shared.size is None:
        return None
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": shared.size}},
    }
    if shared.storage_class_name:
        spec["storageClassName"] = shared.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(pool, name_of(pool, "cache"), "cache"),
        "spec": spec,
    }


# ----------------------------------------------------------- network policy


def _network_policy(pool: EncoderPool, component: str, ingress: list[Any]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(pool, name_of(pool, component), component),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(pool, component)},
            "policyTypes": ["Ingress"],
            # No rules: nothing gets in. (The server drops an empty list; leaving it out
            # keeps the comparison with the live object exact.)
            **({"ingress": ingress} if ingress else {}),
        },
    }


def network_policies(pool: EncoderPool) -> list[dict[str, Any]]:
    """Ingress policies, one per component: clients -> router -> producers and consumers,
    consumers -> producers (rdma: side channel and UCX, whose ports are ephemeral),
    scrapers -> the vLLM port and the router's metrics port, nothing -> the width Job.
    Egress is left open (the router watches the API server, the pods may load models
    from a hub)."""
    spec = pool.spec.network_policy
    if not spec.enabled:
        return []
    http = [{"protocol": "TCP", "port": HTTP_PORT}]
    clients = [p.render() for p in spec.clients]

    def allow(peers: list[dict[str, Any]] | None, ports: list[Any] | None = http) -> Any:
        rule: dict[str, Any] = {} if peers is None else {"from": peers}
        return {**rule, "ports": ports} if ports else rule

    def pods_of(component: str) -> dict[str, Any]:
        return {"podSelector": {"matchLabels": selector_labels(pool, component)}}

    anyone_or_clients = clients or None
    if pool.spec.router.enabled:
        vllm_port = [allow([pods_of(ROUTER)])]
    else:  # the user's own proxy reaches the vLLM pods
        vllm_port = [allow(anyone_or_clients)]
    scrapers = [p.render() for p in spec.metrics]
    if scrapers:  # vLLM serves /metrics on its API port (its /v1 needs the pool's key)
        vllm_port.append(allow(scrapers))
    producers = list(vllm_port)
    if pool.spec.connector.rdma is not None:
        producers.append(allow([pods_of(CONSUMER)], ports=None))
    out = [
        *(_network_policy(pool, c, producers) for c, _ in producer_components(pool)),
        _network_policy(pool, CONSUMER, vllm_port),
        _network_policy(pool, WIDTH_JOB, []),
    ]
    if pool.spec.router.enabled:
        router = [allow(anyone_or_clients)]
        if scrapers:  # the router's /metrics has a port of its own: clients never reach it
            router.append(allow(scrapers, ports=[{"protocol": "TCP", "port": ROUTER_METRICS_PORT}]))
        out.append(_network_policy(pool, ROUTER, router))
    return out


# -------------------------------------------------------------------- router

# The router container's resources when spec.router.resources gives none (any request
# or limit given replaces all of these: a default limit below a given request would be
# refused). Bounded by default so that one pool's router cannot take a node's memory;
# 2Gi holds a few dozen 64 MiB bodies (--max-body-bytes) in flight; one event loop uses
# about one core at most.
ROUTER_RESOURCES = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"cpu": "2", "memory": "2Gi"},
}


def router_services(pool: EncoderPool) -> list[str]:
    """The Services whose EndpointSlices the router follows: each producer one, the consumers'."""
    return [*(name_of(pool, c) for c, _ in producer_components(pool)), name_of(pool, CONSUMER)]


def router_objects(pool: EncoderPool, defaults: Defaults) -> list[dict[str, Any]]:
    """Router Deployment, its Service (the pool's endpoint) and least-privilege RBAC."""
    router = pool.spec.router
    if not router.enabled:
        return []
    name = name_of(pool, ROUTER)
    rbac_meta = _meta(pool, name, ROUTER)
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image or defaults.router_image,
        "command": ["python", "-m", "encoderpool_router"],
        "args": router_args(pool).argv(),
        # Its key toward producers and consumers; the client's Authorization never passes.
        # An env (not a flag) for the pool's uid: a router older than it ignores it.
        "env": [
            _internal_key(pool, BACKEND_API_KEY_ENV, VLLM_API_KEY_KEY),
            {"name": POOL_UID_ENV, "value": pool.metadata["uid"]},
        ],
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
        ],
        "securityContext": {**copy.deepcopy(_RESTRICTED_CONTAINER), "readOnlyRootFilesystem": True},
        # Importing the router takes ~30 s on a busy 2-core node (seen on kind): without a
        # startup probe, liveness killed it before it listened. Liveness starts after this.
        "startupProbe": _http_probe(period=2, failures=90, path="/livez"),
        # Ready while it knows a consumer; alive while it answers at all (consumers
        # rolling must not restart it).
        "readinessProbe": _http_probe(period=5, failures=3),
        "livenessProbe": _http_probe(period=15, failures=4, path="/livez"),
    }
    volumes: list[dict[str, Any]] = []
    if router.auth is not None:
        ref = router.auth.bearer_token_secret
        container["volumeMounts"] = [
            {"name": "client-tokens", "mountPath": CLIENT_TOKENS_DIR, "readOnly": True}
        ]
        volumes.append(
            {
                "name": "client-tokens",
                "secret": {
                    "secretName": ref.name,
                    "items": [{"key": ref.key, "path": CLIENT_TOKENS_FILE}],
                    "defaultMode": 0o440,  # owner and fsGroup (the router's uid and gid)
                },
            }
        )
    container["resources"] = _resources(router.resources) or copy.deepcopy(ROUTER_RESOURCES)
    if pool.spec.image_pull_policy:
        container["imagePullPolicy"] = pool.spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "containers": [container],
        "securityContext": copy.deepcopy(_RESTRICTED_POD),
        "enableServiceLinks": False,
    }
    if volumes:
        pod_spec["volumes"] = volumes
    pod_spec.update(_pull_secrets(pool))
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": rbac_meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": rbac_meta,
            # The router only follows its pool's backends; it reads its Services (only
            # those) to check they are the pool's and which slices are theirs.
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": [""],
                    "resources": ["services"],
                    "verbs": ["get"],
                    "resourceNames": router_services(pool),
                },
            ],
        },
        _role_binding(pool, name, ROUTER),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(pool, name, ROUTER),
            "spec": {
                "replicas": router.replicas,
                "selector": {"matchLabels": selector_labels(pool, ROUTER)},
                "template": {"metadata": {"labels": labels(pool, ROUTER)}, "spec": pod_spec},
            },
        },
        service(pool, pool.name, ROUTER, router.port),
    ]


def router_args(pool: EncoderPool) -> RouterArgs:
    """The router's flags, as the contract both images share (``RouterArgs``); only what
    differs from the router's own defaults is set."""
    router, model = pool.spec.router, pool.spec.model
    groups = pool.spec.producer_groups
    return RouterArgs(
        # Where it finds producers: one Service, or each modality's group's Service (a
        # modality in no group is left to the consumers).
        producer_service=None if groups else name_of(pool, PRODUCER),
        producer_services_by_modality=(
            {m: name_of(pool, group_component(g)) for g in groups for m in g.modalities}
            if groups
            else None
        ),
        consumer_service=name_of(pool, CONSUMER),
        namespace=pool.namespace,
        host="0.0.0.0",
        port=HTTP_PORT,
        metrics_port=ROUTER_METRICS_PORT,
        trust_client_media_ids=router.trust_client_media_ids or None,
        trust_request_mm_kwargs=router.trust_request_mm_kwargs or None,
        # LeastBusy is the router's own default.
        consumer_policy="media-affinity" if router.consumer_policy == "MediaAffinity" else None,
        allowed_media_domains=tuple(model.media.allowed_domains) or None,
        allow_private_media=model.media.allow_private_addresses or None,
        # Refused at the router, before any fan-out.
        limit_mm_per_prompt=dict(model.limit_mm_per_prompt) or None,
        # A file stays on the volume after a producer wrote it, so repeats of a recently
        # encoded item can skip the producer's round trip (~12 ms on a CPU); an entry
        # evicted meanwhile is only a miss: the consumer encodes. Not for rdma: consumers
        # need the producer's transfer coordinates.
        reuse_encoded_s=ROUTER_REUSE_SECONDS if pool.spec.connector.shared_volume else None,
        auth_token_file=(
            f"{CLIENT_TOKENS_DIR}/{CLIENT_TOKENS_FILE}" if router.auth is not None else None
        ),
    )


def _role_binding(pool: EncoderPool, name: str, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(pool, name, component),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
    }


def router_endpoint(pool: EncoderPool) -> str | None:
    if not pool.spec.router.enabled:
        return None
    return f"http://{pool.name}.{pool.namespace}.svc:{pool.spec.router.port}"


# ----------------------------------------------------------------- width Job


def report_owner_reference(pool: EncoderPool) -> dict[str, Any]:
    """A pool's reference on a report it uses: an owner, not the controller (reports are shared)."""
    return {**owner_reference(pool), "controller": False}


# Env the width Job's vLLM, Hugging Face hub and transformers read (what model files are
# fetched, how they load): part of the report key. Other names (labels for logs, a team
# name) would re-measure the model for nothing.
_MEASURED_ENV = ("VLLM_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_")


def report_key(pool: EncoderPool) -> str:
    """The key width reports are stored and shared under (16 hex chars): the model
    fingerprint plus everything else that can change what the width Job measures, its
    image and arguments (extra args that reach it included), the model's files and the
    env vLLM and the hub read (``_MEASURED_ENV``).

    The fingerprint alone stays what cache entries carry: a serving pod computes it
    from vLLM's config, which knows nothing of the Job. A report is shared by every
    pool with the same key, so a pool that measures in another image or with other
    arguments never reads a report measured otherwise (nor is wedged by one).
    """
    spec = pool.spec
    identity = spec.model_identity(spec.image)
    source = spec.model.source
    return config_hash(
        {
            "fingerprint": identity.fingerprint(),
            "image": spec.width_job.image or spec.image,
            "args": measure_args(identity, spec.model.extra_args),
            "env": [[e.name, e.value] for e in spec.model.env if e.name.startswith(_MEASURED_ENV)],
            "source": source.model_dump(mode="json") if source is not None else None,
        }
    )


def report_digest(key: str, data: Mapping[str, str]) -> str:
    """What ANNOTATION_REPORT_DIGEST holds: the stored report bound to its key.

    Not a secret (anyone who may write the ConfigMap can compute it): it tells a
    report this operator stored from one made or edited by hand, which the operator
    then never uses, patches or adopts.
    """
    text = data.get(CONFIGMAP_KEY, "")
    return hashlib.sha256(f"{key}\n{text}".encode()).hexdigest()[:32]


def width_report_configmap(
    pool: EncoderPool, key: str, fingerprint: str, data: dict[str, str] | None = None
) -> dict[str, Any]:
    """The report's ConfigMap, written by the operator from what the width Job reported.

    It is not controlled by one pool: every pool that uses the report adds
    itself as an owner, and the garbage collector removes it with the last. Its
    labels and, with data, its digest are how a pass tells it from a foreign one.
    """
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(key),
            "namespace": pool.namespace,
            "labels": {
                "app.kubernetes.io/name": "encoderpool",
                LABEL_COMPONENT: REPORT_COMPONENT,
                LABEL_MANAGED_BY: MANAGED_BY,
                LABEL_FINGERPRINT: fingerprint,
                LABEL_REPORT_KEY: key,
            },
            "ownerReferences": [report_owner_reference(pool)],
        },
    }
    if data is not None:
        obj["data"] = dict(data)
        obj["metadata"]["annotations"] = {ANNOTATION_REPORT_DIGEST: report_digest(key, data)}
    return obj


def measure_args(identity: ModelIdentity, extra_args: tuple[str, ...]) -> list[str]:
    """What the width Job runs: measure this identity, leave the report as termination message."""
    args = [
        "-m", MEASURE_MODULE,
        "--identity", identity.model_dump_json(),
        "--output-file", TERMINATION_LOG,
    ]  # fmt: skip
    for flag in ("--max-model-len", "--trust-remote-code"):  # what loading the model needs
        for i, arg in enumerate(extra_args):
            if arg == flag and flag == "--trust-remote-code":
                args.append(flag)
            elif arg == flag and i + 1 < len(extra_args):
                args += [flag, extra_args[i + 1]]
            elif arg.startswith(flag + "="):
                args.append(arg)
    return args


def width_job(pool: EncoderPool, identity: ModelIdentity, key: str) -> dict[str, Any]:
    """The Job measuring ``identity``: no API credentials, its report is its termination message.

    The kubelet keeps what ``measure`` writes to ``TERMINATION_LOG`` (up to 4096
    bytes) in the pod's status, where the operator reads it; so the Job needs
    no ServiceAccount token, Role or ConfigMap of its own.
    """
    spec = pool.spec
    job = spec.width_job
    name = width_job_name(pool, key)
    resources = _resources(job.resources) or _resources(spec.producer.resources)
    model_volumes, model_mounts = _model_volume(pool)
    container: dict[str, Any] = {
        "name": MEASURE_CONTAINER,
        "image": job.image or spec.image,
        "command": ["python"],
        "args": measure_args(identity, spec.model.extra_args),
        "env": [
            *_model_env(pool),
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            {"name": "HOME", "value": "/home/vllm"},
            # It measures as a TP producer does (see hash_seed).
            *(
                [{"name": "PYTHONHASHSEED", "value": hash_seed(pool)}]
                if identity.tensor_parallel_size > 1
                else []
            ),
        ],
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "home", "mountPath": "/home/vllm"},
            *model_mounts,
        ],
        "securityContext": copy.deepcopy(_RESTRICTED_CONTAINER),
        "terminationMessagePath": TERMINATION_LOG,
        # The message is the report: never the log tail instead (that is not a report).
        "terminationMessagePolicy": "File",
    }
    if resources:
        container["resources"] = resources
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # measuring needs no API access
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "home", "emptyDir": {}},
            *model_volumes,
        ],
        "securityContext": copy.deepcopy(_RESTRICTED_POD),
        "enableServiceLinks": False,
    }
    pod_spec.update(_scheduling(spec.producer))  # it runs the encoder, as producers do
    pod_spec.update(_pull_secrets(pool))
    job_labels = {
        **labels(pool, WIDTH_JOB),
        LABEL_FINGERPRINT: identity.fingerprint(),
        LABEL_REPORT_KEY: key,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**_meta(pool, name, WIDTH_JOB), "labels": job_labels},
        "spec": {
            "backoffLimit": job.backoff_limit,
            "activeDeadlineSeconds": job.active_deadline_seconds,
            "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
        },
    }


# -------------------------------------------------------------------- all


# Every kind a pool's workload can hold, (apiVersion, kind): what the reconcile lists
# (by the pool's label, kept only with the pool as controller) to prune what the spec
# no longer asks for. Width Jobs and report ConfigMaps have their own rules (widths.py).
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "PersistentVolumeClaim"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


def with_digest(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with ANNOTATION_DIGEST: a hash of the object as it is applied."""
    meta = obj["metadata"]
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k != ANNOTATION_DIGEST}
    body = {**obj, "metadata": {**meta, "annotations": annotations}}
    annotations = {**annotations, ANNOTATION_DIGEST: config_hash(body)}
    return {**obj, "metadata": {**meta, "annotations": annotations}}


def workload_objects(
    pool: EncoderPool, report: WidthReport, defaults: Defaults
) -> list[dict[str, Any]]:
    """Everything that serves traffic, for a measured model: in apply order, each with
    its digest."""
    return [with_digest(o) for o in _workload_objects(pool, report, defaults)]


def _workload_objects(
    pool: EncoderPool, report: WidthReport, defaults: Defaults
) -> list[dict[str, Any]]:
    config = pool.spec.connector_config(
        report.fingerprint, report.encoder_output_widths, report.identity
    )
    objects: list[dict[str, Any]] = []
    if claim := cache_claim(pool):
        objects.append(claim)
    producers = producer_components(pool)
    objects += [service(pool, name_of(pool, c), c, HTTP_PORT, headless=True) for c, _ in producers]
    objects.append(service(pool, name_of(pool, CONSUMER), CONSUMER, HTTP_PORT))
    # Every producer Deployment gets the one config the consumers get: entries any group
    # writes carry the pool's fingerprint and widths, so every consumer loads them.
    objects += [vllm_deployment(pool, PRODUCER, config, c, role) for c, role in producers]
    objects.append(vllm_deployment(pool, CONSUMER, config))
    objects += router_objects(pool, defaults)
    objects += network_policies(pool)
    return objects


def child_refs(pool: EncoderPool) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what ``workload_objects`` returns, without a report.

    The reconcile reads these before it knows the report; a test keeps the two in step.
    """
    refs = []
    if cache_claim(pool) is not None:
        refs.append(("v1", "PersistentVolumeClaim", name_of(pool, "cache")))
    producers = [name_of(pool, c) for c, _ in producer_components(pool)]
    refs += [("v1", "Service", name) for name in producers]
    refs.append(("v1", "Service", name_of(pool, CONSUMER)))
    refs += [("apps/v1", "Deployment", name) for name in producers]
    refs.append(("apps/v1", "Deployment", name_of(pool, CONSUMER)))
    if pool.spec.router.enabled:
        name = name_of(pool, ROUTER)
        refs += [
            ("v1", "ServiceAccount", name),
            ("rbac.authorization.k8s.io/v1", "Role", name),
            ("rbac.authorization.k8s.io/v1", "RoleBinding", name),
            ("apps/v1", "Deployment", name),
            ("v1", "Service", pool.name),
        ]
    refs += [ref_of(p) for p in network_policies(pool)]
    return refs


def ref_of(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name) of a child in the pool's namespace."""
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])

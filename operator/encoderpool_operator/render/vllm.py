"""The vLLM workloads: producer and consumer Deployments, their Services, their args.

A producer group is a producer Deployment with its own component and pod
settings; everything else (the connector config included) is the pool's, as
for any producer. What the transport adds to the pods comes from
``transport.vllm_pod``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from encoderpool_contracts import (
    API_GUARD_MIDDLEWARE,
    CHANNEL_KEY_ENV,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    VLLM_API_KEY_ENV,
    ConnectorConfig,
)
from encoderpool_contracts.pod import CONNECTOR_CLASSES, HTTP_PORT
from encoderpool_contracts.router_args import PRODUCER_TIMEOUT_S
from encoderpool_operator.api import EncoderPool, RoleSpec
from encoderpool_operator.kinds import DEPLOYMENT, SERVICE
from encoderpool_operator.naming import (
    ANNOTATION_CONFIG_HASH,
    CONSUMER,
    FIELD_MANAGER,
    PRODUCER,
    VLLM_CONTAINER,
    Ref,
    child_meta,
    config_hash,
    labels,
    name_of,
    producer_components,
    replicas_managers,
    selector_labels,
)
from encoderpool_operator.render import transport
from encoderpool_operator.render.family import Defaults, Family, Inputs
from encoderpool_operator.render.pod import (
    ALL_INTERFACES,
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    SHM_PATH,
    deep_merge,
    hash_seed,
    http_probe,
    model_env,
    model_volume,
    pull_secrets,
    resources,
    restrict,
    scheduling,
    service,
)
from encoderpool_operator.render.secret import CHANNEL_KEY_KEY, VLLM_API_KEY_KEY, internal_key_env


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
        "--host", ALL_INTERFACES,
        "--port", str(HTTP_PORT),
        "--dtype", spec.model.dtype,
        "--tensor-parallel-size", str(role_spec.tensor_parallel_size),
        # Every route but /health and /metrics needs VLLM_API_KEY (vLLM's own key check
        # leaves /invocations, /tokenize and more open).
        "--middleware", API_GUARD_MIDDLEWARE,
    ]  # fmt: skip
    for middleware in transport.vllm_pod(pool).middleware:
        args += ["--middleware", middleware]
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


def vllm_services(pool: EncoderPool) -> list[dict[str, Any]]:
    """A headless Service per producer Deployment (the router picks producer pods itself),
    then the consumers' Service."""
    producers = [
        service(pool, name_of(pool, c), c, HTTP_PORT, headless=True)
        for c, _ in producer_components(pool)
    ]
    return [*producers, service(pool, name_of(pool, CONSUMER), CONSUMER, HTTP_PORT)]


def vllm_deployments(
    pool: EncoderPool,
    config: ConnectorConfig,
    live: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Each producer Deployment, then the consumers'. Every producer gets the one config
    the consumers get: entries any group writes carry the pool's fingerprint and widths,
    so every consumer loads them. ``live``: the pool's own Deployments by name, as
    observed (``deployment_replicas`` reads them)."""
    live = live or {}
    producers = [
        vllm_deployment(pool, PRODUCER, config, c, role, live.get(name_of(pool, c)))
        for c, role in producer_components(pool)
    ]
    consumer = live.get(name_of(pool, CONSUMER))
    return [*producers, vllm_deployment(pool, CONSUMER, config, live=consumer)]


def deployment_replicas(
    role_spec: RoleSpec, live: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The Deployment's ``replicas`` field: the role's count, or while it autoscales, the
    live count until another field manager holds the field, then nothing.

    Server-side apply removes a field its only manager stops sending, and the API server
    then defaults replicas to 1: dropping it as a role starts autoscaling would take
    3 pods to 1 before the autoscaler acts. So the live count (at least minReplicas; for
    a new Deployment max(minReplicas, 1)) stays applied until the autoscaler writes it
    (the HPA controller and KEDA write through /scale, which makes them its manager),
    and only then is left out: server-side apply's transfer of ownership. Every apply in
    between sends the live value, so it never resets the autoscaler's count either.
    """
    autoscaling = role_spec.autoscaling
    if autoscaling is None:
        return {"replicas": role_spec.replicas}
    if any(m != FIELD_MANAGER for m in replicas_managers(live)):
        return {}
    current = ((live or {}).get("spec") or {}).get("replicas")
    if not isinstance(current, int):
        current = max(autoscaling.min_replicas, 1)
    return {"replicas": max(current, autoscaling.min_replicas)}


# An autoscaling producer being removed leaves its Service's EndpointSlice at once (not
# ready), and the router stops sending to it; it waits out the router's producer
# timeout (plus the watch's delay) before vLLM gets SIGTERM, so every item in flight to
# it is answered. Then vLLM has the usual time to stop.
DRAIN_SECONDS = int(PRODUCER_TIMEOUT_S) + 5
STOP_SECONDS = 30


def drain(role: str, role_spec: RoleSpec) -> dict[str, Any]:
    """The pod fields that drain an autoscaling producer (none for other roles)."""
    if role != PRODUCER or role_spec.autoscaling is None:
        return {}
    return {"terminationGracePeriodSeconds": DRAIN_SECONDS + STOP_SECONDS}


def vllm_deployment(
    pool: EncoderPool,
    role: str,
    config: ConnectorConfig,
    component: str | None = None,
    role_spec: RoleSpec | None = None,
    live: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Deployment of one role; a producer group passes its component and pod settings
    (everything else, the connector config included, is the pool's, as for any producer);
    ``live`` is the Deployment as observed (for ``deployment_replicas``)."""
    spec = pool.spec
    component = component or role
    if role_spec is None:
        role_spec = spec.producer if role == PRODUCER else spec.consumer
    wire = transport.vllm_pod(pool)
    container_resources = resources(role_spec.resources)
    if wire.extended_resources:
        for key in ("requests", "limits"):
            container_resources[key] = {
                **container_resources.get(key, {}),
                **wire.extended_resources,
            }
    env = model_env(pool)
    env += wire.env
    if role_spec.tensor_parallel_size > 1:
        env.append({"name": "PYTHONHASHSEED", "value": hash_seed(pool)})
    env += [
        # With the guard in vllm_args, every route but /health and /metrics needs this
        # key: only the router has it (and the user's own proxy when the router is off).
        internal_key_env(pool, VLLM_API_KEY_ENV, VLLM_API_KEY_KEY),
        internal_key_env(pool, CHANNEL_KEY_ENV, CHANNEL_KEY_KEY),
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "DO_NOT_TRACK", "value": "1"},
        {"name": "HOME", "value": "/home/vllm"},
        # Where the connector leaves a refusal to start (the operator reads it back).
        {"name": TERMINATION_LOG_ENV, "value": TERMINATION_LOG},
        # A redirect can lead a media fetch anywhere (the last value of a name wins).
        {
            "name": "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
            "value": "1" if spec.model.media.allow_redirects else "0",
        },
    ]
    shm: dict[str, Any] = {"medium": "Memory"}
    if wire.shm_size:
        shm["sizeLimit"] = wire.shm_size
    model_volumes, model_mounts = model_volume(pool)
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": shm},
        {"name": "home", "emptyDir": {}},
        *model_volumes,
        *wire.volumes,
    ]
    mounts = [
        {"name": "dshm", "mountPath": SHM_PATH},
        {"name": "home", "mountPath": "/home/vllm"},
        *model_mounts,
        *wire.mounts,
    ]
    security: dict[str, Any] = copy.deepcopy(RESTRICTED_CONTAINER)
    if wire.capabilities:
        security["capabilities"] = {"drop": ["ALL"], "add": list(wire.capabilities)}
    container: dict[str, Any] = {
        "name": VLLM_CONTAINER,
        "image": spec.image,
        "command": ["vllm"],
        "args": vllm_args(pool, role, config),
        "env": env,
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            *wire.ports,
        ],
        "volumeMounts": mounts,
        "securityContext": security,
        # Model load can take many minutes; readiness gates traffic, liveness restarts hangs.
        "startupProbe": http_probe(period=10, failures=180),
        "readinessProbe": http_probe(period=5, failures=3),
        "livenessProbe": http_probe(period=15, failures=4),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
    }
    if drain(role, role_spec):
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": DRAIN_SECONDS}}}
    if container_resources:
        container["resources"] = container_resources
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": copy.deepcopy(RESTRICTED_POD),
        "automountServiceAccountToken": False,  # vLLM never talks to the API server
        "enableServiceLinks": False,
    }
    pod_spec.update(scheduling(role_spec))
    pod_spec.update(drain(role, role_spec))
    if role_spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(role_spec.affinity)
    if role_spec.priority_class_name:
        pod_spec["priorityClassName"] = role_spec.priority_class_name
    if role_spec.topology_spread_constraints:
        selector = selector_labels(pool, component)
        pod_spec["topologySpreadConstraints"] = [
            c.render(selector) for c in role_spec.topology_spread_constraints
        ]
    pod_spec.update(pull_secrets(pool))
    template: dict[str, Any] = {
        "metadata": {
            "labels": {**role_spec.pod_labels, **labels(pool, component)},
            "annotations": {
                **role_spec.pod_annotations,
                **wire.annotations,
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
        "metadata": child_meta(pool, name_of(pool, component), component),
        "spec": {
            **deployment_replicas(role_spec, live),
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


def _objects(pool: EncoderPool, inputs: Inputs) -> list[dict[str, Any]]:
    report = inputs.report
    config = pool.spec.connector_config(
        report.fingerprint, report.encoder_output_widths, report.identity
    )
    return [*vllm_services(pool), *vllm_deployments(pool, config, inputs.observed.deployments)]


def _refs(pool: EncoderPool, _: Defaults | None, __: frozenset[str]) -> list[Ref]:
    names = [*(name_of(pool, c) for c, _ in producer_components(pool)), name_of(pool, CONSUMER)]
    return [*(SERVICE.ref(n) for n in names), *(DEPLOYMENT.ref(n) for n in names)]


FAMILY = Family("vllm", (SERVICE, DEPLOYMENT), _objects, _refs)

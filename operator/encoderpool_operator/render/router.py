"""The pool's router: its Deployment, its Service (the pool's endpoint), its
least-privilege RBAC, and its command line (``RouterArgs``, the contract the
router parses)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from encoderpool_contracts.pod import HTTP_PORT, ROUTER_METRICS_PORT, ROUTER_PROBE_PORT
from encoderpool_contracts.router_args import (
    BACKEND_API_KEY_ENV,
    ENCODE_SECONDS_ENV,
    MEMORY_LIMIT_ENV,
    POOL_UID_ENV,
    PROBE_PORT_ENV,
    RouterArgs,
    encode_seconds_value,
)
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kinds import (
    DEPLOYMENT,
    ROLE,
    ROLE_BINDING,
    SERVICE,
    SERVICE_ACCOUNT,
)
from encoderpool_operator.naming import (
    CONSUMER,
    PRODUCER,
    ROUTER,
    Ref,
    child_meta,
    group_component,
    labels,
    name_of,
    producer_components,
    selector_labels,
)
from encoderpool_operator.render import transport
from encoderpool_operator.render.family import Defaults, Family, Inputs
from encoderpool_operator.render.pod import (
    ALL_INTERFACES,
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    http_probe,
    pull_secrets,
    resources,
    service,
)
from encoderpool_operator.render.secret import VLLM_API_KEY_KEY, internal_key_env

# The router container's resources when spec.router.resources gives none (any request
# or limit given replaces all of these: a default limit below a given request would be
# refused). Bounded by default so that one pool's router cannot take a node's memory.
# The router sizes its connection cap and body memory budget from the limit it is given
# (MEMORY_LIMIT_ENV): with 2Gi, about 600 connections and 690 MiB of bodies, 172 MiB per
# client (docs/router.md). One event loop uses about one core at most.
ROUTER_RESOURCES = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"cpu": "2", "memory": "2Gi"},
}
# Where the router pods see the client tokens (spec.router.auth): a Secret volume, so
# Kubernetes updates the file when the Secret changes (a subPath mount would not be).
CLIENT_TOKENS_DIR = "/etc/encoderpool/client-tokens"
CLIENT_TOKENS_FILE = "tokens"


def router_services(pool: EncoderPool) -> list[str]:
    """The Services whose EndpointSlices the router follows: each producer one, the consumers'."""
    return [*(name_of(pool, c) for c, _ in producer_components(pool)), name_of(pool, CONSUMER)]


def router_refs(pool: EncoderPool) -> list[Ref]:
    """(apiVersion, kind, name) of what ``router_objects`` returns, in its order."""
    if not pool.spec.router.enabled:
        return []
    name = name_of(pool, ROUTER)
    return [
        SERVICE_ACCOUNT.ref(name),
        ROLE.ref(name),
        ROLE_BINDING.ref(name),
        DEPLOYMENT.ref(name),
        SERVICE.ref(pool.name),
    ]


def router_objects(
    pool: EncoderPool, image: str, encode_seconds: Mapping[str, float] | None = None
) -> list[dict[str, Any]]:
    """Router Deployment, its Service (the pool's endpoint) and least-privilege RBAC;
    ``image`` unless spec.router.image names another. ``encode_seconds``: the width
    report's warm encode time per modality (status.encodeSeconds), which WhenFaster
    weighs."""
    router = pool.spec.router
    if not router.enabled:
        return []
    name = name_of(pool, ROUTER)
    rbac_meta = child_meta(pool, name, ROUTER)
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image or image,
        "command": ["python", "-m", "encoderpool_router"],
        "args": router_args(pool).argv(),
        # Its key toward producers and consumers; the client's Authorization never passes.
        # An env (not a flag) for the pool's uid: a router older than it ignores it.
        "env": [
            internal_key_env(pool, BACKEND_API_KEY_ENV, VLLM_API_KEY_KEY),
            {"name": POOL_UID_ENV, "value": pool.metadata["uid"]},
            {"name": PROBE_PORT_ENV, "value": str(ROUTER_PROBE_PORT)},
            # What its connection cap and body budget are derived from.
            {
                "name": MEMORY_LIMIT_ENV,
                "valueFrom": {
                    "resourceFieldRef": {"containerName": "router", "resource": "limits.memory"}
                },
            },
            *router_timing_env(pool, encode_seconds),
        ],
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
            {"name": "probes", "containerPort": ROUTER_PROBE_PORT, "protocol": "TCP"},
        ],
        "securityContext": {**copy.deepcopy(RESTRICTED_CONTAINER), "readOnlyRootFilesystem": True},
        # Importing the router takes ~30 s on a busy 2-core node (seen on kind): without a
        # startup probe, liveness killed it before it listened. Liveness starts after this.
        # On the probe port: clients filling the API port's connections cannot fail them.
        "startupProbe": http_probe(period=2, failures=90, path="/livez", port="probes"),
        # Ready while it knows a consumer; alive while it answers at all (consumers
        # rolling must not restart it).
        "readinessProbe": http_probe(period=5, failures=3, port="probes"),
        "livenessProbe": http_probe(period=15, failures=4, path="/livez", port="probes"),
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
    container["resources"] = resources(router.resources) or copy.deepcopy(ROUTER_RESOURCES)
    if pool.spec.image_pull_policy:
        container["imagePullPolicy"] = pool.spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "containers": [container],
        "securityContext": copy.deepcopy(RESTRICTED_POD),
        "enableServiceLinks": False,
    }
    if volumes:
        pod_spec["volumes"] = volumes
    pod_spec.update(pull_secrets(pool))
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
            "metadata": child_meta(pool, name, ROUTER),
            "spec": {
                "replicas": router.replicas,
                "selector": {"matchLabels": selector_labels(pool, ROUTER)},
                "template": {"metadata": {"labels": labels(pool, ROUTER)}, "spec": pod_spec},
            },
        },
        service(pool, pool.name, ROUTER, router.port, service_type=router.service_type),
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
        host=ALL_INTERFACES,
        port=HTTP_PORT,
        metrics_port=ROUTER_METRICS_PORT,
        trust_client_media_ids=router.trust_client_media_ids or None,
        trust_request_mm_kwargs=router.trust_request_mm_kwargs or None,
        # LeastBusy is the router's own default.
        consumer_policy="media-affinity" if router.consumer_policy == "MediaAffinity" else None,
        dispatch="when-faster" if router.dispatch == "WhenFaster" else None,
        allowed_media_domains=tuple(model.media.allowed_domains) or None,
        allow_private_media=model.media.allow_private_addresses or None,
        # Refused at the router, before any fan-out.
        limit_mm_per_prompt=dict(model.limit_mm_per_prompt) or None,
        reuse_encoded_s=transport.router_reuse_encoded_s(pool),
        auth_token_file=(
            f"{CLIENT_TOKENS_DIR}/{CLIENT_TOKENS_FILE}" if router.auth is not None else None
        ),
    )


def router_timing_env(
    pool: EncoderPool, encode_seconds: Mapping[str, float] | None
) -> list[dict[str, str]]:
    """What WhenFaster prices the consumer's own encode by, and starts the producers' time
    per item from: the width Job's measured encode times. Only with WhenFaster (Always
    weighs nothing, and a new env would roll every router), and as an env, so that a
    router older than it ignores it (it then compares queue lengths)."""
    if pool.spec.router.dispatch != "WhenFaster" or not encode_seconds:
        return []
    return [{"name": ENCODE_SECONDS_ENV, "value": encode_seconds_value(encode_seconds)}]


def _role_binding(pool: EncoderPool, name: str, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_meta(pool, name, component),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
    }


def router_endpoint(pool: EncoderPool) -> str | None:
    """The pool's OpenAI endpoint inside the cluster (status.routerEndpoint); None without
    a router."""
    if not pool.spec.router.enabled:
        return None
    return f"http://{pool.name}.{pool.namespace}.svc:{pool.spec.router.port}"


def _objects(pool: EncoderPool, inputs: Inputs) -> list[dict[str, Any]]:
    return router_objects(pool, inputs.defaults.router_image, inputs.report.encode_seconds)


def _refs(pool: EncoderPool, _: Defaults | None, __: frozenset[str]) -> list[Ref]:
    return router_refs(pool)


FAMILY = Family(
    "router", (SERVICE_ACCOUNT, ROLE, ROLE_BINDING, DEPLOYMENT, SERVICE), _objects, _refs
)

"""Pod building blocks every workload shares: the restricted security settings, the
podTemplate merge, resources, scheduling, the model's volume and env, probes, and the
Service in front of a component's pods."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

from encoderpool_operator.api import HUB_TOKEN_ENV, EncoderPool, ResourceRequirements, RoleSpec
from encoderpool_operator.naming import VLLM_CONTAINER, child_meta, selector_labels

# Inside the pods, not on this host: where they listen, and their shared-memory mount.
ALL_INTERFACES = "0.0.0.0"  # noqa: S104
SHM_PATH = "/dev/shm"  # noqa: S108
RESTRICTED_CONTAINER: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_POD: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
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
    ctx.update(runAsNonRoot=True, seccompProfile=copy.deepcopy(RESTRICTED_POD["seccompProfile"]))
    for key in ("runAsUser", "runAsGroup"):
        if ctx.get(key) == 0:
            ctx[key] = RESTRICTED_POD[key]
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
            mine = vllm_security if c.get("name") == VLLM_CONTAINER else RESTRICTED_CONTAINER
            sc.update(copy.deepcopy(dict(mine)))


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


def resources(res: ResourceRequirements | None) -> dict[str, Any]:
    """A container's resources field; empty when nothing is requested or limited."""
    if res is None:
        return {}
    out: dict[str, Any] = {}
    if res.requests:
        out["requests"] = dict(res.requests)
    if res.limits:
        out["limits"] = dict(res.limits)
    return out


def scheduling(role: RoleSpec) -> dict[str, Any]:
    """A role's nodeSelector and tolerations, as pod spec fields (none when unset)."""
    out: dict[str, Any] = {}
    if role.node_selector:
        out["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        out["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in role.tolerations
        ]
    return out


def pull_secrets(pool: EncoderPool) -> dict[str, Any]:
    """The pod's imagePullSecrets field (none when the pool names none)."""
    secrets = pool.spec.image_pull_secrets
    return {"imagePullSecrets": [{"name": s.name} for s in secrets]} if secrets else {}


def model_env(pool: EncoderPool) -> list[dict[str, Any]]:
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


def model_volume(pool: EncoderPool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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


def http_probe(
    period: int, failures: int, path: str = "/health", port: str = "http"
) -> dict[str, Any]:
    """A probe on the container's port named ``port``."""
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def service(
    pool: EncoderPool,
    name: str,
    component: str,
    port: int,
    *,
    headless: bool = False,
    service_type: str | None = None,
) -> dict[str, Any]:
    """The Service in front of one component's pods, on their ``http`` port."""
    spec: dict[str, Any] = {
        "selector": selector_labels(pool, component),
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
    }
    if headless:
        spec["clusterIP"] = "None"  # the router talks to each producer pod directly
    elif service_type is not None:
        spec["type"] = service_type
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(pool, name, component),
        "spec": spec,
    }

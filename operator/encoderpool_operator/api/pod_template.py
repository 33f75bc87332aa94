"""``podTemplate``: what a pool owner may add to the pods the operator renders, and what not.

The operator's ServiceAccount creates the pool's Deployments, so whatever the
template says runs with the operator's authority, not the pool owner's. Fields
that would reach beyond the pool (another ServiceAccount's token, the node's
namespaces or files, privileged or root containers) or replace what the operator
renders (the vLLM container's image, command and arguments) are refused, twice
with one message: by CEL rules in the CRD (the API server names the field) and
by ``forbidden_fields`` (what the operator trusts). The template is a free-form
mapping, not a model, so these rules are not ``schema.Rule`` entries: the CEL sits
in the schema declared here and ``forbidden_fields`` walks the same paths, both
with the messages defined below. Everything else merges over
the rendered pod: maps key by key, named lists (containers, volumes, env, ...)
by name.

It is an allow-list. The schema declares each field a pool owner may set, and
closes the pod spec, both security contexts, volumes, projected sources and the
template's metadata: the API server prunes any other field (or refuses it under
strict field validation), and ``forbidden_fields`` refuses it naming the field.
Refused fields that pruning would drop silently (seccomp, AppArmor and SELinux
overrides, procMount, nodeName, projected service-account tokens, ...) are declared
so CEL names them. Containers stay open (every container field is allowed but the
vllm container's image, command and args), their securityContext closed. And
``render.vllm.vllm_deployment`` applies the restricted security fields again after the
merge (``render.pod.restrict``), so the operator's values win whatever the template says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from encoderpool_operator.api.schema import cel

# The one container the operator renders in producer and consumer pods.
VLLM_CONTAINER = "vllm"
MAX_LIST = 32  # containers, volumes: bounded, so CEL's cost estimate is bounded too

_POD_FIELDS = ("serviceAccountName", "serviceAccount", "automountServiceAccountToken")
_HOST_FIELDS = ("hostNetwork", "hostPID", "hostIPC")
_CONTAINER_LISTS = ("containers", "initContainers")
_OURS = ("image", "command", "args")
# Security-context fields the operator owns (pod and container level): declared so CEL
# can refuse them by name (pruning would drop them silently).
_POD_CONTEXT_OURS = (
    "seccompProfile", "appArmorProfile", "seLinuxOptions", "seLinuxChangePolicy",
    "windowsOptions", "sysctls",
)  # fmt: skip
_CONTAINER_CONTEXT_OURS = (
    "seccompProfile", "appArmorProfile", "seLinuxOptions", "windowsOptions", "procMount",
)  # fmt: skip
# What a pool owner may set in a security context (the refused values aside).
_POD_CONTEXT_ALLOWED = (
    "runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "fsGroupChangePolicy",
    "supplementalGroups", "supplementalGroupsPolicy",
)  # fmt: skip
_CONTAINER_CONTEXT_ALLOWED = (
    "runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem",
    "allowPrivilegeEscalation", "privileged", "capabilities",
)  # fmt: skip
# Volume sources a pool owner may use: those Pod Security "restricted" allows.
_VOLUME_SOURCES = (
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
)  # fmt: skip
_PROJECTED_SOURCES = ("configMap", "secret", "downwardAPI", "clusterTrustBundle")
# The pre-1.30 annotation spellings of seccomp and AppArmor profiles.
SECURITY_ANNOTATION_PREFIXES = (
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
    "container.apparmor.security.beta.kubernetes.io/",
)

_NO_ACCOUNT = (
    "cannot be set: pool pods run with no API credentials (the operator renders "
    "automountServiceAccountToken: false); give vLLM what it needs through env or volumes"
)
_NO_HOST = "cannot be true: pool pods do not share the node's namespaces"
_NO_HOST_PATH = "hostPath volumes are refused: use a PersistentVolumeClaim, configMap or secret"
_NO_ESCALATION = (
    "securityContext may not set privileged or allowPrivilegeEscalation true, add "
    "capabilities, run as root (runAsUser 0 or runAsGroup 0) or set runAsNonRoot false"
)
_NO_PROFILE = (
    "cannot be set: the operator sets the pods' seccomp profile (RuntimeDefault) and "
    "leaves AppArmor, SELinux, procMount and sysctls to the node's defaults; remove it"
)
_NO_NODE_NAME = (
    "nodeName cannot be set: it skips the scheduler and the taints that keep pods off "
    "nodes; use the role's nodeSelector, tolerations or affinity"
)
_NO_SA_PROJECTION = (
    "projected serviceAccountToken sources are refused: pool pods run with no API "
    "credentials; give vLLM what it needs through env or secret volumes"
)
_NO_PROFILE_ANNOTATION = (
    "annotations may not set seccomp or AppArmor profiles ("
    + ", ".join(f"{p}*" for p in SECURITY_ANNOTATION_PREFIXES)
    + "): the operator sets the pods' profile; remove them"
)
_NOT_ALLOWED = "is not a field podTemplate may set; allowed: "
_NEED_NAME = "every entry needs a name (entries merge with the rendered pod's by name)"
_NOT_OURS = (
    f"container {VLLM_CONTAINER!r} may not set image, command or args: use spec.image and "
    "spec.model.extraArgs"
)


def _unknown_object(description: str, **properties: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "description": description,
    }
    if properties:
        out["properties"] = properties
    return out


def _string(description: str) -> dict[str, Any]:
    return {"type": "string", "maxLength": 4096, "description": description}


def _flag(description: str) -> dict[str, Any]:
    return {"type": "boolean", "description": description}


def _strings(description: str, max_items: int = 256) -> dict[str, Any]:
    item = {"type": "string", "maxLength": 4096}
    return {"type": "array", "maxItems": max_items, "items": item, "description": description}


def _list_of(description: str, item: dict[str, Any]) -> dict[str, Any]:
    item = {k: v for k, v in item.items() if k != "description"}
    return {"type": "array", "maxItems": MAX_LIST, "items": item, "description": description}


def _closed(description: str, **properties: Any) -> dict[str, Any]:
    """An object of exactly ``properties``: the API server prunes any other field."""
    return {"type": "object", "description": description, "properties": properties}


def _integer(description: str, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": maximum, "description": description}


def _objects(description: str, max_items: int = MAX_LIST) -> dict[str, Any]:
    item = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {"type": "array", "maxItems": max_items, "items": item, "description": description}


def _string_map(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "maxProperties": 64,
        "additionalProperties": {"type": "string", "maxLength": 4096},
        "description": description,
    }


def _refused(names: tuple[str, ...]) -> dict[str, Any]:
    """Declared with the type the Pod API gives them, so CEL (not a type error) refuses them."""
    typed = {
        "procMount": _string("Refused."),
        "seLinuxChangePolicy": _string("Refused."),
        "sysctls": _objects("Refused."),
    }
    return {n: typed.get(n) or _unknown_object("Refused: the operator sets it.") for n in names}


_ID = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_CONTAINER_CONTEXT = _closed(
    "As in a container; may not escalate or change profiles (see podTemplate).",
    privileged=_flag("Refused when true."),
    allowPrivilegeEscalation=_flag("Refused when true."),
    runAsUser={**_ID, "description": "Refused when 0 (root)."},
    runAsGroup={**_ID, "description": "Refused when 0 (root's group)."},
    runAsNonRoot=_flag("Refused when false."),
    readOnlyRootFilesystem=_flag("A read-only root filesystem."),
    capabilities=_closed(
        "Capabilities may be dropped, never added.",
        add=_strings("Refused when not empty.", max_items=64),
        drop=_strings("Capabilities to drop.", max_items=64),
    ),
    **_refused(_CONTAINER_CONTEXT_OURS),
)
_POD_CONTEXT = _closed(
    "As in a Pod; may not run as root or change profiles (see podTemplate).",
    runAsUser={**_ID, "description": "Refused when 0 (root)."},
    runAsGroup={**_ID, "description": "Refused when 0 (root's group)."},
    runAsNonRoot=_flag("Refused when false."),
    fsGroup={**_ID, "description": "Group of the pod's volumes."},
    fsGroupChangePolicy=_string("OnRootMismatch or Always."),
    supplementalGroups={"type": "array", "maxItems": 64, "items": _ID, "description": "Groups."},
    supplementalGroupsPolicy=_string("Merge or Strict."),
    **_refused(_POD_CONTEXT_OURS),
)
_SAFE_IDS = (
    "(!has({s}.runAsUser) || {s}.runAsUser != 0) && "
    "(!has({s}.runAsGroup) || {s}.runAsGroup != 0) && "
    "(!has({s}.runAsNonRoot) || {s}.runAsNonRoot)"
)
_SAFE_CONTEXT = (
    "(!has({s}.privileged) || !{s}.privileged) && "
    "(!has({s}.allowPrivilegeEscalation) || !{s}.allowPrivilegeEscalation) && "
    + _SAFE_IDS
    + " && (!has({s}.capabilities) || !has({s}.capabilities.add) || "
    "size({s}.capabilities.add) == 0)"
)


def _no_fields(s: str, names: tuple[str, ...]) -> str:
    return " && ".join(f"!has({s}.{n})" for n in names)


def _container_rules(field: str) -> list[dict[str, str]]:
    each = f"!has(self.{field}) || self.{field}.all(c, "
    ctx = "c.securityContext"
    return [
        cel(each + "has(c.name))", _NEED_NAME, f".{field}"),
        cel(
            each + f"!has({ctx}) || (" + _SAFE_CONTEXT.format(s=ctx) + "))",
            _NO_ESCALATION,
            f".{field}",
        ),
        cel(
            each + f"!has({ctx}) || (" + _no_fields(ctx, _CONTAINER_CONTEXT_OURS) + "))",
            "securityContext's " + ", ".join(_CONTAINER_CONTEXT_OURS) + " " + _NO_PROFILE,
            f".{field}",
        ),
    ]


def _spec_schema() -> dict[str, Any]:
    container = _unknown_object(
        "A container: merged by name into the rendered one of that name, else added.",
        name=_string("Container name (required)."),
        image=_string(f"Refused for {VLLM_CONTAINER!r}: use spec.image."),
        command=_strings(f"Refused for {VLLM_CONTAINER!r}."),
        args=_strings(f"Refused for {VLLM_CONTAINER!r}: use spec.model.extraArgs."),
        securityContext=_CONTAINER_CONTEXT,
    )
    source = _unknown_object("A volume source, as in a Pod.")
    projected = _closed(
        "A projected volume: configMap, secret, downwardAPI and clusterTrustBundle sources.",
        defaultMode=_integer("Mode bits of the files.", 0o777),
        sources=_list_of(
            "Projected sources.",
            _closed(
                "One source.",
                serviceAccountToken=_unknown_object("Refused: no API credentials in pool pods."),
                **{n: source for n in _PROJECTED_SOURCES},
            ),
        ),
    )
    volume = _closed(
        "A volume, merged by name: " + ", ".join(_VOLUME_SOURCES) + " sources only.",
        name=_string("Volume name (required)."),
        hostPath=_unknown_object("Refused: pool pods do not read the node's files."),
        **{n: projected if n == "projected" else source for n in _VOLUME_SOURCES},
    )
    props: dict[str, Any] = {
        "serviceAccountName": _string("Refused: pool pods run with no API credentials."),
        "serviceAccount": _string("Refused (deprecated alias of serviceAccountName)."),
        "automountServiceAccountToken": _flag("Refused: the operator sets it false."),
        "nodeName": _string("Refused: pods are placed by the scheduler."),
    }
    props.update({f: _flag("Refused when true.") for f in _HOST_FIELDS})
    props["volumes"] = _list_of("Extra volumes, merged by name.", volume)
    props.update({f: _list_of(f"{f}, merged by name.", container) for f in _CONTAINER_LISTS})
    props["securityContext"] = _POD_CONTEXT
    props.update(
        affinity=_unknown_object("As in a Pod."),
        tolerations=_objects("As in a Pod."),
        nodeSelector=_string_map("As in a Pod."),
        priorityClassName=_string("As in a Pod."),
        topologySpreadConstraints=_objects("As in a Pod."),
        terminationGracePeriodSeconds=_integer("As in a Pod.", 86400),
        dnsPolicy=_string("As in a Pod."),
        dnsConfig=_unknown_object("As in a Pod."),
        hostAliases=_objects("As in a Pod."),
        imagePullSecrets=_objects("As in a Pod."),
        schedulerName=_string("As in a Pod."),
        runtimeClassName=_string("As in a Pod (e.g. nvidia)."),
        preemptionPolicy=_string("As in a Pod."),
        readinessGates=_objects("As in a Pod."),
        resourceClaims=_objects("As in a Pod (dynamic resource allocation)."),
        resources=_unknown_object("Pod-level resources, as in a Pod."),
        schedulingGates=_objects("As in a Pod."),
        os=_unknown_object("As in a Pod."),
        enableServiceLinks=_flag("As in a Pod (the operator renders false)."),
        shareProcessNamespace=_flag("As in a Pod."),
        setHostnameAsFQDN=_flag("As in a Pod."),
        hostname=_string("As in a Pod."),
        subdomain=_string("As in a Pod."),
        hostUsers=_flag("As in a Pod (false: a user namespace)."),
    )
    pod_ctx = "self.securityContext"
    rules = [cel(f"!has(self.{f})", f"{f} {_NO_ACCOUNT}", f".{f}") for f in _POD_FIELDS]
    rules += [cel(f"!has(self.{f}) || !self.{f}", f"{f} {_NO_HOST}", f".{f}") for f in _HOST_FIELDS]
    rules += [
        cel("!has(self.nodeName)", _NO_NODE_NAME, ".nodeName"),
        cel("!has(self.volumes) || self.volumes.all(v, has(v.name))", _NEED_NAME, ".volumes"),
        cel(
            "!has(self.volumes) || self.volumes.all(v, !has(v.hostPath))",
            _NO_HOST_PATH,
            ".volumes",
        ),
        cel(
            "!has(self.volumes) || self.volumes.all(v, !has(v.projected) || "
            "!has(v.projected.sources) || "
            "v.projected.sources.all(p, !has(p.serviceAccountToken)))",
            _NO_SA_PROJECTION,
            ".volumes",
        ),
        cel(
            f"!has({pod_ctx}) || (" + _SAFE_IDS.format(s=pod_ctx) + ")",
            _NO_ESCALATION,
            ".securityContext",
        ),
        cel(
            f"!has({pod_ctx}) || (" + _no_fields(pod_ctx, _POD_CONTEXT_OURS) + ")",
            "securityContext's " + ", ".join(_POD_CONTEXT_OURS) + " " + _NO_PROFILE,
            ".securityContext",
        ),
        cel(
            "!has(self.containers) || self.containers.all(c, !has(c.name) || "
            f"c.name != '{VLLM_CONTAINER}' || " + " && ".join(f"!has(c.{f})" for f in _OURS) + ")",
            _NOT_OURS,
            ".containers",
        ),
    ]
    for field in _CONTAINER_LISTS:
        rules += _container_rules(field)
    out = _closed("Partial PodSpec, merged over the rendered one.", **props)
    out["x-kubernetes-validations"] = rules
    return out


def _metadata_schema() -> dict[str, Any]:
    out = _closed(
        "Labels and annotations added to the pods.",
        labels=_string_map("Labels added to the pods."),
        annotations=_string_map("Annotations added to the pods (no seccomp/AppArmor ones)."),
    )
    prefixes = " || ".join(f"k.startsWith('{p}')" for p in SECURITY_ANNOTATION_PREFIXES)
    out["x-kubernetes-validations"] = [
        cel(
            f"!has(self.annotations) || !self.annotations.exists(k, {prefixes})",
            _NO_PROFILE_ANNOTATION,
            ".annotations",
        )
    ]
    return out


# The podTemplate field's schema extras: the guarded fields declared, CEL on `spec`.
POD_TEMPLATE_SCHEMA: dict[str, Any] = {
    "properties": {"metadata": _metadata_schema(), "spec": _spec_schema()},
}
# What forbidden_fields allows at each closed level (the schema's properties).
_POD_SPEC_ALLOWED = tuple(sorted(set(_spec_schema()["properties"]) - {*_POD_FIELDS, "nodeName"}))


def _unsafe_context(ctx: Mapping[str, Any]) -> bool:
    caps = ctx.get("capabilities")
    return bool(
        ctx.get("privileged") is True
        or ctx.get("allowPrivilegeEscalation") is True
        or ctx.get("runAsUser") == 0
        or ctx.get("runAsGroup") == 0
        or ctx.get("runAsNonRoot") is False
        or (isinstance(caps, Mapping) and caps.get("add"))
    )


def _unknown(where: str, obj: Mapping[str, Any], allowed: tuple[str, ...]) -> list[str]:
    return [f"{where}.{k}: {k} {_NOT_ALLOWED}{', '.join(allowed)}" for k in obj if k not in allowed]


def _context(where: str, ctx: Any, allowed: tuple[str, ...], ours: tuple[str, ...]) -> list[str]:
    """What is wrong with a pod's or container's securityContext."""
    if not isinstance(ctx, Mapping):
        return []
    out = [f"{where}.{k}: {k} {_NO_PROFILE}" for k in ours if k in ctx]
    out += _unknown(where, {k: v for k, v in ctx.items() if k not in ours}, allowed)
    if _unsafe_context(ctx):
        out.append(f"{where}: {_NO_ESCALATION}")
    return out


def _volume(where: str, volume: Mapping[str, Any]) -> list[str]:
    if "hostPath" in volume:
        return [f"{where}: {_NO_HOST_PATH}"]
    out = _unknown(where, volume, ("name", *_VOLUME_SOURCES))
    projected = volume.get("projected")
    if isinstance(projected, Mapping):
        for j, src in enumerate(projected.get("sources") or []):
            at = f"{where}.projected.sources[{j}]"
            if isinstance(src, Mapping) and "serviceAccountToken" in src:
                out.append(f"{at}: {_NO_SA_PROJECTION}")
            elif isinstance(src, Mapping):
                out += _unknown(at, src, _PROJECTED_SOURCES)
    return out


def forbidden_fields(template: Mapping[str, Any]) -> list[str]:
    """`<path>: <why>` for each field the template may not set (the CEL rules mirrored,
    plus the allow-list the API server applies by pruning)."""
    out = _unknown("", template, ("metadata", "spec"))
    meta = template.get("metadata")
    if isinstance(meta, Mapping):
        out += _unknown("metadata", meta, ("labels", "annotations"))
        annotations = meta.get("annotations")
        if isinstance(annotations, Mapping) and any(
            str(k).startswith(SECURITY_ANNOTATION_PREFIXES) for k in annotations
        ):
            out.append(f"metadata.annotations: {_NO_PROFILE_ANNOTATION}")
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        return [o.removeprefix(".") for o in out]
    out += [f"spec.{f}: {f} {_NO_ACCOUNT}" for f in _POD_FIELDS if f in spec]
    out += [f"spec.{f}: {f} {_NO_HOST}" for f in _HOST_FIELDS if spec.get(f) is True]
    if "nodeName" in spec:
        out.append(f"spec.nodeName: {_NO_NODE_NAME}")
    known = {*_POD_FIELDS, "nodeName"}
    out += _unknown("spec", {k: v for k, v in spec.items() if k not in known}, _POD_SPEC_ALLOWED)
    out += _context(
        "spec.securityContext", spec.get("securityContext"), _POD_CONTEXT_ALLOWED, _POD_CONTEXT_OURS
    )
    for i, volume in enumerate(spec.get("volumes") or []):
        if not isinstance(volume, Mapping) or "name" not in volume:
            out.append(f"spec.volumes[{i}]: {_NEED_NAME}")
        else:
            out += _volume(f"spec.volumes[{i}]", volume)
    for field in _CONTAINER_LISTS:
        for i, c in enumerate(spec.get(field) or []):
            where = f"spec.{field}[{i}]"
            if not isinstance(c, Mapping) or "name" not in c:
                out.append(f"{where}: {_NEED_NAME}")
                continue
            out += _context(
                f"{where}.securityContext",
                c.get("securityContext"),
                _CONTAINER_CONTEXT_ALLOWED,
                _CONTAINER_CONTEXT_OURS,
            )
            if field == "containers" and c["name"] == VLLM_CONTAINER:
                out += [f"{where}.{f}: {_NOT_OURS}" for f in _OURS if f in c]
    return [o.removeprefix(".") for o in out]

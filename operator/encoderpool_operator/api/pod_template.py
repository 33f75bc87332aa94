"""``podTemplate``: what a pool owner may add to the pods the operator renders, and what not.

The operator's ServiceAccount creates the pool's Deployments, so whatever the
template says runs with the operator's authority, not the pool owner's. Fields
that would reach beyond the pool (another ServiceAccount's token, the node's
namespaces or files, privileged or root containers) or replace what the operator
renders (the vLLM container's image, command and arguments) are refused, twice
with one message: by CEL rules in the CRD (the API server names the field) and
by ``forbidden_fields`` (what the operator trusts). Everything else merges over
the rendered pod: maps key by key, named lists (containers, volumes, env, ...)
by name.

The schema declares just the guarded fields, so CEL can see them; the rest of
the template stays free-form (``x-kubernetes-preserve-unknown-fields``).
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

_NO_ACCOUNT = (
    "cannot be set: pool pods run with no API credentials (the operator renders "
    "automountServiceAccountToken: false); give vLLM what it needs through env or volumes"
)
_NO_HOST = "cannot be true: pool pods do not share the node's namespaces"
_NO_HOST_PATH = "hostPath volumes are refused: use a PersistentVolumeClaim, configMap or secret"
_NO_ESCALATION = (
    "securityContext may not set privileged or allowPrivilegeEscalation true, add "
    "capabilities, run as root (runAsUser 0) or set runAsNonRoot false"
)
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


_SECURITY_CONTEXT = _unknown_object(
    "As in a Pod; may not escalate (see podTemplate).",
    privileged=_flag("Refused when true."),
    allowPrivilegeEscalation=_flag("Refused when true."),
    runAsUser={
        "type": "integer",
        "minimum": 0,
        "maximum": 2**31 - 1,
        "description": "Refused when 0 (root).",
    },
    runAsNonRoot=_flag("Refused when false."),
    capabilities=_unknown_object(
        "Capabilities may be dropped, never added.",
        add=_strings("Refused when not empty.", max_items=64),
    ),
)
_SAFE_CONTEXT = (
    "(!has({s}.privileged) || !{s}.privileged) && "
    "(!has({s}.allowPrivilegeEscalation) || !{s}.allowPrivilegeEscalation) && "
    "(!has({s}.runAsUser) || {s}.runAsUser != 0) && "
    "(!has({s}.runAsNonRoot) || {s}.runAsNonRoot) && "
    "(!has({s}.capabilities) || !has({s}.capabilities.add) || size({s}.capabilities.add) == 0)"
)


def _container_rules(field: str) -> list[dict[str, str]]:
    each = f"!has(self.{field}) || self.{field}.all(c, "
    return [
        cel(each + "has(c.name))", _NEED_NAME, f".{field}"),
        cel(
            each
            + "!has(c.securityContext) || ("
            + _SAFE_CONTEXT.format(s="c.securityContext")
            + "))",
            _NO_ESCALATION,
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
        securityContext=_SECURITY_CONTEXT,
    )
    volume = _unknown_object(
        "A volume, merged by name.",
        name=_string("Volume name (required)."),
        hostPath=_unknown_object("Refused: pool pods do not read the node's files."),
    )
    props: dict[str, Any] = {
        "serviceAccountName": _string("Refused: pool pods run with no API credentials."),
        "serviceAccount": _string("Refused (deprecated alias of serviceAccountName)."),
        "automountServiceAccountToken": _flag("Refused: the operator sets it false."),
    }
    props.update({f: _flag("Refused when true.") for f in _HOST_FIELDS})
    props["volumes"] = _list_of("Extra volumes, merged by name.", volume)
    props.update({f: _list_of(f"{f}, merged by name.", container) for f in _CONTAINER_LISTS})
    props["securityContext"] = _SECURITY_CONTEXT
    rules = [cel(f"!has(self.{f})", f"{f} {_NO_ACCOUNT}", f".{f}") for f in _POD_FIELDS]
    rules += [cel(f"!has(self.{f}) || !self.{f}", f"{f} {_NO_HOST}", f".{f}") for f in _HOST_FIELDS]
    rules += [
        cel("!has(self.volumes) || self.volumes.all(v, has(v.name))", _NEED_NAME, ".volumes"),
        cel(
            "!has(self.volumes) || self.volumes.all(v, !has(v.hostPath))",
            _NO_HOST_PATH,
            ".volumes",
        ),
        cel(
            "!has(self.securityContext) || ("
            + _SAFE_CONTEXT.format(s="self.securityContext")
            + ")",
            _NO_ESCALATION,
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
    out = _unknown_object("Partial PodSpec, merged over the rendered one.", **props)
    out["x-kubernetes-validations"] = rules
    return out


# The podTemplate field's schema extras: the guarded fields declared, CEL on `spec`.
POD_TEMPLATE_SCHEMA: dict[str, Any] = {
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "metadata": _unknown_object("Labels and annotations added to the pods."),
        "spec": _spec_schema(),
    },
}


def _unsafe_context(ctx: Any) -> bool:
    if not isinstance(ctx, Mapping):
        return False
    caps = ctx.get("capabilities")
    return bool(
        ctx.get("privileged") is True
        or ctx.get("allowPrivilegeEscalation") is True
        or ctx.get("runAsUser") == 0
        or ctx.get("runAsNonRoot") is False
        or (isinstance(caps, Mapping) and caps.get("add"))
    )


def forbidden_fields(template: Mapping[str, Any]) -> list[str]:
    """`<path>: <why>` for each field the template may not set (the CEL rules, mirrored)."""
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        return []
    out = [f"spec.{f}: {f} {_NO_ACCOUNT}" for f in _POD_FIELDS if f in spec]
    out += [f"spec.{f}: {f} {_NO_HOST}" for f in _HOST_FIELDS if spec.get(f) is True]
    if _unsafe_context(spec.get("securityContext")):
        out.append(f"spec.securityContext: {_NO_ESCALATION}")
    for i, volume in enumerate(spec.get("volumes") or []):
        if not isinstance(volume, Mapping) or "name" not in volume:
            out.append(f"spec.volumes[{i}]: {_NEED_NAME}")
        elif "hostPath" in volume:
            out.append(f"spec.volumes[{i}]: {_NO_HOST_PATH}")
    for field in _CONTAINER_LISTS:
        for i, c in enumerate(spec.get(field) or []):
            where = f"spec.{field}[{i}]"
            if not isinstance(c, Mapping) or "name" not in c:
                out.append(f"{where}: {_NEED_NAME}")
                continue
            if _unsafe_context(c.get("securityContext")):
                out.append(f"{where}.securityContext: {_NO_ESCALATION}")
            if field == "containers" and c["name"] == VLLM_CONTAINER:
                out += [f"{where}.{f}: {_NOT_OURS}" for f in _OURS if f in c]
    return out

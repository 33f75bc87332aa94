"""Generate the reference parts of docs/api.md from the API models and the CRD they make.

    python -m encoderpool_codegen.apidoc docs/api.md           # rewrite the blocks (make crds)
    python -m encoderpool_codegen.apidoc --check docs/api.md   # exit 1 with a diff if stale

Field tables (one per model type) and the validation rules table are written between
``<!-- generated: NAME begin -->`` and ``<!-- generated: NAME end -->`` comments; the
prose around them is the page's own. Types, bounds and defaults are read from the
generated CRD schema, so the page states what the API server applies; type names and
the rules without CEL come from the models, so nothing is listed twice by hand.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from encoderpool_codegen import crd as codegen_crd
from encoderpool_codegen.generated import write_or_check
from encoderpool_operator import api
from encoderpool_operator.api.schema import ApiModel, Rule

# CEL longer than this goes into a collapsed <details> cell: the rules stay readable.
_INLINE_CEL = 160
_BEGIN = "<!-- generated: {} begin (python -m encoderpool_codegen.apidoc; do not edit) -->"
_END = "<!-- generated: {} end -->"


@dataclass
class _Type:
    """One model type: where it sits in a pool, and the schema node of its first place."""

    model: type[ApiModel]
    paths: list[str] = field(default_factory=list)
    node: dict[str, Any] = field(default_factory=dict)


def _models_in(annotation: Any) -> Iterator[type[ApiModel]]:
    if isinstance(annotation, type) and issubclass(annotation, ApiModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def _child(node: dict[str, Any], name: str) -> tuple[dict[str, Any], str]:
    """The schema node of a property holding a model, and its path suffix (`[]`, `{}`)."""
    child: dict[str, Any] = node["properties"][name]
    suffix = ""
    while "properties" not in child:
        if isinstance(child.get("items"), dict):
            child, suffix = child["items"], suffix + "[]"
        elif isinstance(child.get("additionalProperties"), dict):
            child, suffix = child["additionalProperties"], suffix + "{}"
        else:
            break
    return child, suffix


def _types(schema: dict[str, Any]) -> dict[type[ApiModel], _Type]:
    """Every model type below the pool's spec and status, in the order a reader meets them."""
    found: dict[type[ApiModel], _Type] = {}

    def walk(model: type[ApiModel], path: str, node: dict[str, Any]) -> None:
        entry = found.get(model)
        if entry is None:
            entry = found[model] = _Type(model, node=node)
        entry.paths.append(path)
        for name, info in model.model_fields.items():
            alias = info.alias or name
            for inner in _models_in(info.annotation):
                child, suffix = _child(node, alias)
                walk(inner, f"{path}.{alias}{suffix}", child)

    props = schema["properties"]
    walk(api.EncoderPoolSpec, "spec", props["spec"])
    walk(api.EncoderPoolStatus, "status", props["status"])
    return found


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def _code(text: str) -> str:
    """Inline code in a table cell: GitHub splits cells at `|` even inside backticks."""
    return "`" + text.replace("|", "\\|") + "`"


def _cell(text: str) -> str:
    """Prose in a table cell: one line, `<pool>` shown rather than read as an HTML tag."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # outside code spans (which show `<` as it is)
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def _bounds(node: dict[str, Any]) -> str:
    low, high = node.get("minimum"), node.get("maximum")
    if low is None and high is None:
        return ""
    left = "" if low is None else f"{low} <{'' if node.get('exclusiveMinimum') else '='} "
    right = "" if high is None else f" <= {high}"
    return f", {left}x{right}"


def _type(node: dict[str, Any], models: list[type[ApiModel]]) -> str:
    """What a field holds, as a reader needs it: kind, bounds, the model it links to."""
    if node.get("x-kubernetes-int-or-string"):
        return "quantity (e.g. `1Gi`)"
    if "enum" in node:
        return " \\| ".join(_code(json.dumps(v)) for v in node["enum"])
    kind = node.get("type")
    if kind == "array":
        items = node.get("items", {})
        listed = node.get("x-kubernetes-list-type")
        shape = {"set": "set", "map": "list map"}.get(listed or "", "list")
        keys = node.get("x-kubernetes-list-map-keys")
        keyed = f" keyed by {', '.join(keys)}" if keys else ""
        most = f", at most {node['maxItems']}" if "maxItems" in node else ""
        return f"{shape} of {_type(items, models)}{keyed}{most}"
    if kind == "object":
        if "properties" in node and models:
            model = models[0]
            return f"[{model.__name__}](#{_anchor(model)})"
        if isinstance(node.get("additionalProperties"), dict):
            most = f", at most {node['maxProperties']}" if "maxProperties" in node else ""
            return f"map of string to {_type(node['additionalProperties'], models)}{most}"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return "object (free-form)"
        return "object"
    if kind == "string" and node.get("format") == "date-time":
        return "timestamp"
    return f"{kind}{_bounds(node)}"


def _default(info: FieldInfo, node: dict[str, Any], required: bool) -> str:
    """What an omitted field means: the API server's default, or the model's."""
    if "default" in node:
        return _code(json.dumps(node["default"]))
    if required:
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            if not value.model_dump(exclude_defaults=True):
                return "its own defaults"
            return _code(json.dumps(value.model_dump(mode="json", exclude_none=True)))
    return ""


def _table(entry: _Type) -> list[str]:
    model, node = entry.model, entry.node
    summary = (model.__doc__ or "").strip().split("\n\n")[0]
    where = ", ".join(_code(p) for p in entry.paths)
    lines = [
        f"### {model.__name__}",
        "",
        f"{_cell(summary)} At {where}.",
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    required = set(node.get("required", []))
    for name, info in model.model_fields.items():
        alias = info.alias or name
        prop = node["properties"][alias]
        models = list(_models_in(info.annotation))
        lines.append(
            f"| `{alias}` | {_type(prop, models)} | {_default(info, prop, alias in required)} "
            f"| {_cell(prop.get('description', ''))} |"
        )
    return [*lines, ""]


def fields_block() -> str:
    """A field table per model type, spec's first, then status'."""
    types = _types(codegen_crd.openapi_schema())
    return "\n".join(line for entry in types.values() for line in _table(entry)).rstrip() + "\n"


# ----------------------------------------------------------------------------- rules


def _validations(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Every x-kubernetes-validations entry with the path of the node that holds it."""
    for entry in node.get("x-kubernetes-validations", []):
        yield path, entry
    for name, child in node.get("properties", {}).items():
        yield from _validations(child, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        yield from _validations(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _validations(node["additionalProperties"], f"{path}{{}}")


def _where(paths: list[str]) -> str:
    """Paths that differ in one segment as one: `spec.{producer,consumer}.rollout`."""
    split = [re.split(r"\.(?![^{]*})", p) for p in paths]
    if len(split) > 1 and len({len(s) for s in split}) == 1:
        differing = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
        if len(differing) == 1:
            (i,) = differing
            merged = list(split[0])
            merged[i] = "{" + ",".join(dict.fromkeys(s[i] for s in split)) + "}"
            return _code(".".join(merged))
    return ", ".join(_code(p) for p in paths)


def _cel_cell(rule: str) -> str:
    if len(rule) <= _INLINE_CEL:
        return _code(rule)
    body = html.escape(rule).replace("|", "&#124;")
    return f"<details><summary>CEL ({len(rule)} characters)</summary><code>{body}</code></details>"


def _rule_paths(schema: dict[str, Any]) -> dict[str, list[tuple[str, Rule[Any]]]]:
    """The models' rules that have no CEL, by message, with where each model sits."""
    out: dict[str, list[tuple[str, Rule[Any]]]] = {}
    for entry in _types(schema).values():
        for rule in entry.model.rules:
            if rule.cel is None:
                out.setdefault(rule.message, []).extend(
                    (path + rule.field_path, rule) for path in entry.paths
                )
    return out


def _node_at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    node = schema
    for part in re.findall(r"\w+|\[\]", path):
        node = node["items"] if part == "[]" else node["properties"][part]
    return node


def rules_block() -> str:
    """Every rule: the CEL the API server runs (once per distinct rule), then the
    operator's rules that the schema states by a list type instead."""
    schema = codegen_crd.openapi_schema()
    transitions = {
        (r.cel, r.message)
        for entry in _types(schema).values()
        for r in entry.model.rules
        if r.check is None
    }
    grouped: dict[tuple[str, str], list[str]] = {}
    for path, entry in _validations(schema, ""):
        key = (entry["rule"], entry["message"])
        grouped.setdefault(key, []).append(path + entry.get("fieldPath", ""))
    lines = ["| where | rule | message |", "|---|---|---|"]
    for (rule, message), paths in grouped.items():
        cel_text = _cel_cell(rule)
        if (rule, message) in transitions:
            cel_text += " (on updates; the API server only)"
        lines.append(f"| {_where(paths)} | {cel_text} | {_cell(message)} |")
    for message, located in _rule_paths(schema).items():
        paths = [p for p, _ in located]
        listed = _node_at(schema, paths[0])
        kind = listed.get("x-kubernetes-list-type")
        if kind == "map":
            keys = ", ".join(listed.get("x-kubernetes-list-map-keys", []))
            words = f"list map keyed by {keys}: unique keys"
        elif kind == "set":
            words = "set: unique items"
        else:
            words = "checked by the operator only"
        lines.append(f"| {_where(paths)} | {words} | {_cell(message)} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the page

BLOCKS = {"fields": fields_block, "rules": rules_block}


def render(text: str) -> str:
    """``text`` with every generated block rewritten; a missing marker is an error."""
    for name, make in BLOCKS.items():
        begin, end = _BEGIN.format(name), _END.format(name)
        start, stop = text.find(begin), text.find(end)
        if start < 0 or stop < start:
            raise ValueError(f"docs/api.md lacks the markers {begin!r} ... {end!r}")
        text = text[: start + len(begin)] + "\n" + make() + text[stop:]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m encoderpool_codegen.apidoc")
    parser.add_argument("page", type=Path, help="the API reference page (docs/api.md)")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 with a diff if stale"
    )
    args = parser.parse_args(argv)
    path: Path = args.page
    return write_or_check(path, render(path.read_text()), args.check)


if __name__ == "__main__":
    sys.exit(main())

"""The committed CRD is what the models generate, and its schema is one the API server
accepts as structural, documented and bounded (so CEL rules stay within cost limits)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from encoderpool_codegen import crd as codegen_crd
from encoderpool_operator import api
from tests.operator.api_cases import rules

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / codegen_crd.FILENAME

# What pydantic emits and a structural schema must not carry.
FORBIDDEN_KEYS = {"$ref", "$defs", "title", "const", "patternProperties", "propertyNames"}
# Root fields the API server itself validates.
SERVER_CHECKED = {".apiVersion", ".kind", ".metadata", ".metadata.name"}


def _schema() -> dict[str, Any]:
    version = yaml.safe_load(COMMITTED.read_text())["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its dotted path (`[]` for list items, `{}` for map values)."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


NODES = list(_nodes(_schema()))


def test_committed_crd_equals_a_regeneration() -> None:
    assert COMMITTED.read_text() == codegen_crd.render(), "stale CRD: run `make crds` and commit it"


def test_check_mode_reports_a_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert codegen_crd.main([str(tmp_path)]) == 0
    assert codegen_crd.main(["--check", str(tmp_path)]) == 0
    stale = tmp_path / codegen_crd.FILENAME
    stale.write_text(stale.read_text().replace("epool", "ep"))
    assert codegen_crd.main(["--check", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "-    - ep\n" in out.out
    assert "+    - epool\n" in out.out
    assert "make crds" in out.err


def test_header_and_names() -> None:
    text = COMMITTED.read_text()
    assert text.startswith("# Generated")
    assert "do not edit" in text.splitlines()[1]
    crd = yaml.safe_load(text)
    assert crd["metadata"]["name"] == "encoderpools.encoderpool.io"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "EncoderPool",
        "encoderpools",
        ["epool"],
    )
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1"
    assert version["served"]
    assert version["storage"]
    assert version["subresources"] == {"status": {}}


def test_printer_columns_point_at_fields_that_exist() -> None:
    crd = yaml.safe_load(COMMITTED.read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == [
        "Model",
        "Connector",
        "Producers",
        "Consumers",
        "Ready",
        "Age",
        "Groups",
        "Router",
        "Autoscaling",
    ]
    # The first six by default; the rest with -o wide.
    assert [c.get("priority", 0) for c in columns] == [0] * 6 + [1] * 3
    paths = {p for p, _ in NODES}
    for column in columns:
        path = re.sub(r"\[\?.*\]", "[]", column["jsonPath"]).removesuffix("[].status")
        if path.startswith(".metadata"):
            continue
        assert path in paths, column


@pytest.mark.parametrize(("path", "node"), NODES, ids=[p or "<root>" for p, _ in NODES])
def test_node_is_structural(path: str, node: dict[str, Any]) -> None:
    assert not FORBIDDEN_KEYS & node.keys(), path
    assert "nullable" not in node, f"{path}: optional fields are omitted, never null"
    if "anyOf" in node:
        assert node.get("x-kubernetes-int-or-string") is True, path
        assert all(set(b) == {"type"} for b in node["anyOf"]), path
    else:
        assert "type" in node, path
    if "properties" in node:
        assert "additionalProperties" not in node, path
    if "default" in node:
        assert node["default"] not in (None, [], {}), path
    for key in ("minimum", "maximum"):
        if key in node:  # the API server checks bounds as float64
            assert abs(node[key]) <= 2**53, path


@pytest.mark.parametrize(("path", "node"), NODES, ids=[p or "<root>" for p, _ in NODES])
def test_node_is_documented_and_bounded(path: str, node: dict[str, Any]) -> None:
    is_property = not path.endswith(("[]", "}")) and not path.startswith(".metadata")
    if path in SERVER_CHECKED:
        return
    if is_property:
        assert node.get("description"), f"{path} has no description for kubectl explain"
    kind = node.get("type")
    if node.get("x-kubernetes-int-or-string"):
        assert {"maxLength", "pattern"} <= node.keys(), path
        assert node.get("minimum") == 0, path
    elif kind == "string" and path not in SERVER_CHECKED:
        assert "maxLength" in node or "enum" in node or node.get("format") == "date-time", path
    elif kind == "integer":
        assert {"minimum", "maximum"} <= node.keys(), path
    elif kind == "array":
        assert "maxItems" in node, path
    elif kind == "object" and "additionalProperties" in node:
        assert "maxProperties" in node, path


def test_free_form_fields_are_only_the_pod_overrides() -> None:
    free = {p for p, n in NODES if n.get("x-kubernetes-preserve-unknown-fields")}
    overrides = {
        f".spec.{role}.{field}"
        for role in ("producer", "consumer")
        for field in ("affinity", "podTemplate")
    }
    assert overrides <= free
    # Inside podTemplate, only the nodes declared so CEL can guard them (api/pod_template.py).
    assert all(any(p.startswith(o) for o in overrides) for p in free)


def test_cel_rules_have_messages_and_name_real_fields() -> None:
    rules = [(p, n, r) for p, n in NODES for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 8
    for path, node, rule in rules:
        assert all(rule.get(k) for k in ("rule", "message")), path
        names = set(re.findall(r"has\((?:self|oldSelf)\.(\w+)\)", rule["rule"]))
        assert names <= node.get("properties", {}).keys(), (path, rule)
        if "fieldPath" in rule:
            assert rule["fieldPath"].lstrip(".") in node["properties"], (path, rule)


def test_every_rule_of_the_models_is_in_the_crd() -> None:
    """Each Rule's CEL, message and fieldPath reach x-kubernetes-validations unchanged."""
    entries = [r for _, n in NODES for r in n.get("x-kubernetes-validations", [])]
    for path, rule in rules():
        if rule.cel is not None:
            assert rule.entry() in entries, (path, rule.message)


def test_conditions_are_a_map_keyed_by_type() -> None:
    conditions = dict(NODES)[".status.conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) >= {"type", "status", "lastTransitionTime"}


def test_defaults_agree_with_the_models() -> None:
    """What the API server fills in is what pydantic would assume when it is absent."""
    spec = dict(NODES)[".spec"]
    parsed = api.EncoderPoolSpec.model_validate(
        {
            "model": {"name": "m"},
            "image": "i",
            "producer": {},
            "consumer": {},
            "connector": {"rdma": {"networks": ["n"]}},  # the defaults of all but networks
        }
    ).model_dump(mode="json")
    for section in ("router", "widthJob"):
        for name, prop in spec["properties"][section]["properties"].items():
            if "default" in prop:
                assert parsed[section][name] == prop["default"], (section, name)
    rdma = spec["properties"]["connector"]["properties"]["rdma"]["properties"]
    for name, prop in rdma.items():
        if "default" in prop:
            assert parsed["connector"]["rdma"][name] == prop["default"], name

"""The registry of children is complete: every object a family renders is of a kind it
names, each family's refs name what it renders (the reconcile reads them before it knows
the report), and every kind the operator declares is a family's or its own."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from encoderpool_operator import kinds, kube, rbac, render
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.cache import CACHED_KINDS
from encoderpool_operator.naming import ref_of
from encoderpool_operator.render import secret, widths
from encoderpool_operator.render.family import Inputs, Observed
from tests.operator.fixtures import DEFAULTS, GROUPS, HPA, KEDA, REPO, report_for

EXAMPLES = sorted(
    p.name
    for p in (REPO / "examples").glob("*.yaml")
    if any(d and d.get("kind") == "EncoderPool" for d in yaml.safe_load_all(p.read_text()))
)
SETTINGS = {"defaults": DEFAULTS, "keda": KEDA, "hpa": HPA}


def _raw(example: str) -> dict[str, Any]:
    obj = yaml.safe_load((REPO / "examples" / example).read_text())
    obj["metadata"] = {"name": "pool", "namespace": "ml", "uid": "u-1", "generation": 1}
    return dict(obj)


def variants(example: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The example, and with each switch that changes which children exist flipped."""
    base = _raw(example)
    yield "as-is", base
    for name, change in {
        "no-router": {"router": {**base["spec"].get("router", {}), "enabled": False}},
        "no-network-policy": {"networkPolicy": {"enabled": False}},
        "groups": {
            "producerGroups": GROUPS,
            "model": {**base["spec"]["model"], "limitMmPerPrompt": {"image": 1, "video": 1}},
        },
        "autoscaled": {
            "producer": {
                **base["spec"].get("producer", {}),
                "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
            },
            "consumer": {
                **base["spec"].get("consumer", {}),
                "autoscaling": {"minReplicas": 1, "maxReplicas": 3},
            },
        },
    }.items():
        obj = copy.deepcopy(base)
        obj["spec"].update(copy.deepcopy(change))
        yield name, obj


CASES = {
    f"{example}-{name}-{sname}": (obj, settings)
    for example in EXAMPLES
    for name, obj in variants(example)
    for sname, settings in SETTINGS.items()
}


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return (obj["apiVersion"], obj["kind"])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("withheld", [frozenset(), frozenset({"consumer"})])
def test_each_family_renders_only_its_kinds_and_its_refs_name_them(
    case: str, withheld: frozenset[str]
) -> None:
    obj, settings = CASES[case]
    pool = EncoderPool.from_object(obj)
    report = report_for(obj)
    inputs = Inputs(report, settings, Observed(withheld=withheld))
    for family in render.FAMILIES:
        if family.objects is None or family.refs is None:
            continue
        objects = family.objects(pool, inputs)
        assert {_key(o) for o in objects} <= {k.key for k in family.kinds}, family.name
        assert family.refs(pool, settings, withheld) == [ref_of(o) for o in objects], family.name
    rendered = render.workload_objects(pool, report, settings, Observed(withheld=withheld))
    assert render.child_refs(pool, settings, withheld) == [ref_of(o) for o in rendered]
    assert {_key(o) for o in rendered} <= set(render.WORKLOAD_KINDS)


@pytest.mark.parametrize("example", EXAMPLES)
def test_what_the_reconcile_renders_itself_is_of_its_family_s_kinds(example: str) -> None:
    pool = EncoderPool.from_object(_raw(example))
    identity = pool.spec.model_identity(pool.spec.image)
    key = widths.report_key(pool)
    report = report_for(_raw(example))
    made = {
        widths.FAMILY.name: [
            widths.width_job(pool, identity, key),
            widths.width_report_configmap(
                pool, key, report.fingerprint, report.to_configmap_data()
            ),
        ],
        secret.FAMILY.name: [secret.internal_secret(pool)],
    }
    for family in (widths.FAMILY, secret.FAMILY):
        assert {_key(o) for o in made[family.name]} <= {k.key for k in family.kinds}


def test_every_kind_a_family_names_is_rendered_by_some_pool() -> None:
    """No family names a kind it never renders (a kind left behind when a child went)."""
    seen: set[tuple[str, str]] = set()
    for obj, settings in CASES.values():
        pool = EncoderPool.from_object(obj)
        seen |= {_key(o) for o in render.workload_objects(pool, report_for(obj), settings)}
    assert seen == set(render.WORKLOAD_KINDS)


def test_every_declared_kind_is_a_family_s_or_the_operator_s() -> None:
    assert set(kinds.CHILD_KINDS) == set(render.FAMILY_KINDS)
    assert not set(kinds.CHILD_KINDS) & set(kinds.OPERATOR_KINDS)
    assert len({k.key for k in kinds.KINDS}) == len(kinds.KINDS)  # each declared once


def test_the_tables_derive_from_the_registry() -> None:
    """The API client's paths, the read cache and the chart's RBAC know every kind."""
    assert set(kube.PLURALS) == {k.key for k in kinds.KINDS}
    assert set(render.WORKLOAD_KINDS) <= set(CACHED_KINDS)
    assert {k.key for k in render.FAMILY_KINDS if k.cached} == set(CACHED_KINDS)
    resources = {(p.group, p.resource) for p in rbac.PERMISSIONS}
    for k in kinds.KINDS:
        assert (k.group, k.plural) in resources, k.kind


def test_a_path_per_kind() -> None:
    assert kube.path("apps/v1", "Deployment", "ml", "d") == (
        "/apis/apps/v1/namespaces/ml/deployments/d"
    )
    assert kube.path("v1", "Pod", "ml") == "/api/v1/namespaces/ml/pods"
    assert kube.path(*kinds.POOL.key, "ml", "p", "status") == (
        "/apis/encoderpool.io/v1alpha1/namespaces/ml/encoderpools/p/status"
    )


def test_examples_are_found() -> None:
    assert {"pool-shared-volume.yaml", "pool-rdma.yaml"} <= set(EXAMPLES)
    assert Path(REPO / "examples").is_dir()

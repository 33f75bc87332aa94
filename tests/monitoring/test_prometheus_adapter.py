"""examples/prometheus-adapter.yaml serves the External metrics the operator's HPA engine
asks for, computed from the series the KEDA engine's queries read.

Each rule is expanded as prometheus-adapter expands an external rule for one
HorizontalPodAutoscaler (``<<.Series>>``; ``<<.LabelMatchers>>``: the HPA's selector,
sorted by label, then the HPA's namespace) and compared with the KEDA trigger of the same
signal: the same series, selected by the same labels, over the same windows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from encoderpool_contracts.signals import (
    ENCODER_UNSERVED_ITEMS,
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_NAMESPACE,
    LABEL_POOL,
)
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.render.autoscaling import Trigger, horizontal_pod_autoscaler, scalers

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "prometheus-adapter.yaml"
DOC = REPO / "docs" / "autoscaling.md"
# One selector in a query: a series name, its label matchers, an optional range.
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}(\[[^\]]+\])?")


def rules() -> list[dict[str, Any]]:
    return list(yaml.safe_load(EXAMPLE.read_text())["externalRules"])


def rule_for(metric: str) -> dict[str, Any]:
    [rule] = [r for r in rules() if r["name"]["as"] == metric]
    return rule


def pool(namespace: str = "ml") -> EncoderPool:
    """A pool with producer groups where every role autoscales, on every signal."""
    obj = yaml.safe_load((REPO / "examples" / "pool-producer-groups.yaml").read_text())
    obj["metadata"] = {"name": "tiny", "namespace": namespace, "uid": "u-1", "generation": 1}
    scaling = {"minReplicas": 1, "maxReplicas": 4}
    for group in obj["spec"]["producerGroups"]:
        group["autoscaling"] = scaling
    obj["spec"]["consumer"]["autoscaling"] = {**scaling, "targetKvCacheUsage": 0.8}
    return EncoderPool.from_object(obj)


def expand(rule: dict[str, Any], namespace: str, selector: dict[str, str]) -> str:
    """The query prometheus-adapter sends for an HPA in ``namespace`` with ``selector``."""
    series = rule["name"]["matches"].strip("^$")
    matchers = [f'{k}="{v}"' for k, v in sorted(selector.items())]
    matchers.append(f'namespace="{namespace}"')  # resources.namespaced: the default, true
    return str(
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", ",".join(matchers))
    )


def selectors(query: str) -> set[tuple[str, frozenset[str], str]]:
    """The series a query reads: (name, label matchers, range) of each selector."""
    return {
        (name, frozenset(m.strip() for m in matchers.split(",") if m.strip()), window or "")
        for name, matchers, window in SELECTOR.findall(query)
    }


def hpa_triggers() -> list[tuple[Trigger, str, dict[str, str]]]:
    """Each trigger of each role, with the External metric and selector its HPA names."""
    p = pool()
    out = []
    for scaler in scalers(p):
        hpa = horizontal_pod_autoscaler(p, scaler)
        metrics = {m["external"]["metric"]["name"]: m for m in hpa["spec"]["metrics"]}
        for t in scaler.triggers:
            selector = metrics[t.hpa_metric]["external"]["metric"]["selector"]["matchLabels"]
            out.append((t, hpa["metadata"]["namespace"], dict(selector)))
    return out


def test_a_rule_for_every_external_metric_the_hpas_name() -> None:
    names = [r["name"]["as"] for r in rules()]
    assert len(names) == len(set(names))
    assert {t.hpa_metric for t, _, _ in hpa_triggers()} == set(names)
    for rule in rules():
        # The adapter adds the HPA's namespace itself: never switched off.
        assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}


@pytest.mark.parametrize("index", range(len(hpa_triggers())))
def test_each_rule_reads_what_the_keda_trigger_reads(index: int) -> None:
    trigger, namespace, selector = hpa_triggers()[index]
    query = expand(rule_for(trigger.hpa_metric), namespace, selector)
    assert selectors(query) == selectors(trigger.query), (query, trigger.query)
    # Every series is selected by namespace, pool, component and, for a group, group.
    want = {LABEL_NAMESPACE, LABEL_POOL, LABEL_COMPONENT}
    if LABEL_GROUP in selector:
        want.add(LABEL_GROUP)
    for _, matchers, _ in selectors(query):
        equal = {m.split("=", 1)[0] for m in matchers if re.fullmatch(r'\w+="[^"]+"', m)}
        assert want <= equal, matchers


def test_another_namespaces_hpa_reads_nothing_of_the_pool() -> None:
    """An HPA in namespace b naming pool ml/tiny: the adapter's namespace contradicts it."""
    trigger, _, selector = hpa_triggers()[0]
    query = expand(rule_for(trigger.hpa_metric), "b", {**selector, LABEL_NAMESPACE: "ml"})
    for _, matchers, _ in selectors(query):
        assert {'namespace="ml"', 'namespace="b"'} <= matchers


def test_each_rule_discovers_only_series_labelled_for_a_pool() -> None:
    for rule in rules():
        series = rule["name"]["matches"].strip("^$")
        matchers = set(rule["seriesQuery"].strip("{}").split(","))
        assert f'__name__="{series}"' in matchers
        assert {'namespace!=""', 'pool!=""'} <= matchers
        assert any(m.startswith('component="') for m in matchers)


def test_the_wake_signal_asks_for_one_pod_at_most() -> None:
    query = rule_for("encoderpool_encoder_unserved")["metricsQuery"]
    assert ENCODER_UNSERVED_ITEMS in rule_for("encoderpool_encoder_unserved")["seriesQuery"]
    assert query.startswith("clamp_max(")
    assert query.endswith("), 1) or vector(0)")


def test_the_docs_rule_is_the_examples() -> None:
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)]
    [doc] = [b for b in blocks if isinstance(b, dict) and "externalRules" in b]
    for rule in doc["externalRules"]:
        assert rule == rule_for(rule["name"]["as"])

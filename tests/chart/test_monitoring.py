"""The chart's dashboard and alerts on a real Prometheus (the test bed's build), quickly:
every panel query and alert expression parses and runs, and the rule file loads.
The kind test bed runs them again after traffic (tests/kind/test_autoscaling.py)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.kind.monitoring import local_prometheus
from encoderpool_codegen.monitoring import ALERTS, PANELS
from tests.chart.fixtures import CHART
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("prometheus")
    (work / "alerts.yml").write_text((CHART / "files" / "alerts.json").read_text())
    config = {"global": {"evaluation_interval": "1s"}, "rule_files": [str(work / "alerts.yml")]}
    with local_prometheus(config, work) as url:
        yield url


def _get(url: str, path: str, **query: str) -> Any:
    q = urllib.parse.urlencode(query)
    with urllib.request.urlopen(f"{url}{path}?{q}", timeout=10) as r:
        return json.load(r)


@pytest.mark.parametrize(
    "expr",
    [e for p in PANELS for e, _ in p.targets],
    ids=[f"{p.title}:{legend}" for p in PANELS for _, legend in p.targets],
)
def test_every_panel_query_runs(prometheus: str, expr: str) -> None:
    expr = expr.replace("$namespace", "ns").replace("$pool", "pool")
    assert _get(prometheus, "/api/v1/query", query=expr)["status"] == "success"


def test_every_alert_loads_healthy(prometheus: str) -> None:
    def evaluated() -> list[dict[str, Any]] | None:
        groups = _get(prometheus, "/api/v1/rules", type="alert")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return (
            rules
            if rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules)
            else None
        )

    rules = wait_until("the rules evaluated", evaluated, timeout=30)
    assert sorted(r["name"] for r in rules) == sorted(a.name for a in ALERTS)
    for r in rules:
        assert r["health"] == "ok", (r["name"], r.get("lastError"))
        assert r["state"] == "inactive", r["name"]

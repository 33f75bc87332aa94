"""benchmarks/reconcile_scale.py in small: 20 pools at once, on the real control plane.

What must not regress as pools grow: a pass reads the cache (no API reads), creation
costs about one write per child, and a full resync with nothing changed writes nothing
(the API server's audit log, the operator's own user).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections import Counter

import pytest

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from encoderpool_operator import render
from encoderpool_operator.api import EncoderPool
from tests.operator.fixtures import sample_pool, seed_report
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster
POOLS = 20


def _metric(operator: OperatorProcess, name: str, label: str = "") -> float:
    with urllib.request.urlopen(operator.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if re.match(rf"{name}(\{{|\s)", line) and label in line
    )


def _ready(cluster: LocalCluster, namespace: str) -> int:
    pools = json.loads(cluster.kubectl("get", "epool", "-n", namespace, "-o", "json"))["items"]
    return sum(
        1
        for p in pools
        for c in p.get("status", {}).get("conditions", [])
        if c["type"] == "Ready" and c["status"] == "True"
    )


def test_twenty_pools_converge_with_a_write_per_child_and_resync_without_writes(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    seed_report(cluster, namespace, sample_pool())
    pools = [sample_pool(name=f"pool-{i:02d}") for i in range(POOLS)]
    before = len(cluster.audit_events(namespace=namespace))
    items = {"apiVersion": "v1", "kind": "List", "items": pools}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(items))
    wait_until(f"{POOLS} pools Ready", lambda: _ready(cluster, namespace) == POOLS, timeout=180)

    # Creation: each child once, its internal Secret, its share of the report, and a few
    # status writes (created, Ready; progress at most every 30 s). No Events: nothing failed.
    time.sleep(3)
    created = cluster.audit_events(namespace=namespace)[before:]
    one = {**pools[0], "metadata": {**pools[0]["metadata"], "uid": "u", "namespace": "n"}}
    children = len(render.child_refs(EncoderPool.from_object(one))) + 2
    per_pool = len(created) / POOLS
    by_resource = Counter(e["objectRef"].get("resource") for e in created)
    assert per_pool <= children + 2, (per_pool, children, by_resource)
    assert by_resource["events"] == 0

    # Steady state: passes read no API and write nothing, over two full resyncs.
    reads = _metric(operator, "encoderpool_operator_api_reads")
    quiet = len(cluster.audit_events(namespace=namespace))
    resyncs = _metric(operator, "encoderpool_operator_reconciles_total", 'trigger="resync"')
    wait_until(
        "two full resyncs",
        lambda: (
            _metric(operator, "encoderpool_operator_reconciles_total", 'trigger="resync"')
            >= resyncs + 2 * POOLS
        ),
        timeout=60,
    )
    noop = cluster.audit_events(namespace=namespace)[quiet:]
    assert [(e["verb"], e["objectRef"].get("resource")) for e in noop] == []
    assert _metric(operator, "encoderpool_operator_api_reads") == reads

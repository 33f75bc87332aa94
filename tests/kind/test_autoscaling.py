"""Autoscaling on the real engine: Prometheus scrapes the pool, KEDA drives the producers
through the real HPA controller, to zero and back.

Prometheus and KEDA are built here from their Go modules (e2e/monitoring) and installed
as a platform team would, the chart is told where Prometheus is, and one pool whose
producers autoscale between 0 and 1 (a short scale-down window) is driven through:
asleep at zero while idle, a request answered by the consumer encoding it itself, the
producers woken by that demand, the next items encoded by the producer, back to zero
when the traffic stops. The consumers' autoscaler reads vLLM's own gauges.

The same Prometheus then runs the chart's dashboard and alerts: every panel returns data
(and is drawn, e2e/kind/dashboard_png.py), every alert is silent while the pool is
healthy, and faults induced on the real pods fire theirs: items at zero producers, a
second pool whose model is missing, the cache volume (a 64 MiB tmpfs) filled by another
writer, the consumer's pod lost.
"""

from __future__ import annotations

import copy
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.kind import dashboard_png, monitoring
from e2e.kind.cluster import Engine, Images, KindCluster
from e2e.kind.pool import (
    MODEL_CLAIM,
    cache_dir_on_node,
    cache_volume,
    chat,
    condition,
    encoded,
    example,
    for_kind,
    model_volume,
    release_cache_volume,
    wait_ready,
)
from e2e.media import chat_request, image
from encoderpool_codegen.monitoring import ALERTS, PANELS
from encoderpool_contracts.signals import (
    DISPATCH_DECISIONS,
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    VLLM_REQUESTS_RUNNING,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.kind

NS = "kind-auto"
POOL = "auto"
PRODUCERS = f"{POOL}-producer"
CACHE_TMPFS_MIB = 64


@pytest.fixture(scope="module")
def prometheus_address(kind: KindCluster, engine: Engine, operator: str, images: Images) -> str:
    """Prometheus and KEDA in the cluster; the operator told where Prometheus is."""
    image = kind.push(monitoring.build_image({**kind.env, "DOCKER_HOST": engine.host}))
    monitoring.install(kind, image)
    kind.install_operator(images, f"autoscaling.prometheus.address={monitoring.PROMETHEUS_ADDRESS}")
    return monitoring.PROMETHEUS_ADDRESS


@pytest.fixture(scope="module")
def pool(
    kind: KindCluster, prometheus_address: str, images: Images, tiny_model_dir: Path
) -> Iterator[dict[str, Any]]:
    kind.namespace(NS)
    model_volume(kind, NS, tiny_model_dir)
    # A small tmpfs under the 1Gi the volume claims: the alerts' test fills it.
    cache_volume(kind, NS, tmpfs_mib=CACHE_TMPFS_MIB)
    spec = for_kind(example("pool-shared-volume.yaml"), images.vllm)
    spec["metadata"] = {"name": POOL, "namespace": NS}
    spec["spec"]["producer"]["autoscaling"] = {
        "minReplicas": 0,
        "maxReplicas": 1,
        "scaleDown": {"stabilizationWindowSeconds": 20},
    }
    spec["spec"]["consumer"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1}
    spec["spec"]["networkPolicy"] = {
        "metrics": [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": monitoring.PROMETHEUS_NS}
                }
            }
        ]
    }
    kind.apply(spec)
    yield spec
    kind.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    release_cache_volume(kind, NS)


def replicas(kind: KindCluster) -> int:
    return int(kind.get("deployment", "-n", NS, PRODUCERS)["spec"].get("replicas", 1))


def ready_producers(kind: KindCluster) -> int:
    return int(
        kind.get("deployment", "-n", NS, PRODUCERS).get("status", {}).get("readyReplicas", 0)
    )


def test_the_pool_is_ready_and_its_producers_sleep_at_zero(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    wait_ready(kind, NS, POOL)
    objs = kind.get("scaledobjects", "-n", NS)["items"]
    assert sorted(o["metadata"]["name"] for o in objs) == [f"{POOL}-consumer", PRODUCERS]
    # No encoder demand: KEDA takes the producers to zero after the cooldown.
    wait_until("the producers at zero", lambda: replicas(kind) == 0, timeout=600)
    wait_until("no producer pod ready", lambda: ready_producers(kind) == 0, timeout=300)
    assert condition(kind, NS, POOL, "Ready").get("status") == "True"
    status = kind.get("epool", "-n", NS, POOL)["status"]
    assert status["producers"]["desired"] == 0


def test_an_item_at_zero_is_encoded_by_the_consumer_and_wakes_the_producers(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    consumer_before = encoded(kind, NS, POOL, "consumer")
    with kind.port_forward(NS, f"service/{POOL}", 8000) as url:
        answer = chat(url, chat_request(image(1), max_tokens=4))
    assert answer["choices"][0]["message"]["content"] is not None
    assert encoded(kind, NS, POOL, "consumer") == consumer_before + 1
    with monitoring.prometheus(kind) as prom:
        sel = f'namespace="{NS}",pool="{POOL}",group="{PRODUCERS}"'
        wait_until(
            "Prometheus to see the unserved item",
            lambda: (prom.value(f"sum({ENCODER_UNSERVED_ITEMS}{{{sel}}})") or 0) >= 1,
            timeout=120,
        )
        decisions = prom.value(f'sum({DISPATCH_DECISIONS}{{{sel},reason="no_producer"}})')
        assert decisions is not None
        assert decisions >= 1
        # Every item so far found no producer: the fallback alert's fault, induced.
        wait_until(
            "EncoderPoolLocalEncodeFallbackHigh to fire",
            lambda: prom.firing("EncoderPoolLocalEncodeFallbackHigh", NS, POOL),
            timeout=120,
        )
    # KEDA's activation: the unserved demand wakes the producers.
    wait_until("the producers woken", lambda: replicas(kind) == 1, timeout=300)
    wait_until("a producer ready", lambda: ready_producers(kind) == 1, timeout=600)


def test_awake_producers_encode_and_their_demand_is_measured(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    wait_ready(kind, NS, POOL)
    with kind.port_forward(NS, f"service/{POOL}", 8000) as url:
        wait_until(
            "the router to see the producer",
            lambda: (
                chat(url, chat_request(image(2), max_tokens=2)) is not None
                and encoded(kind, NS, POOL, "producer") >= 1
            ),
            timeout=120,
        )
        for i in range(3, 6):
            chat(url, chat_request(image(i), max_tokens=2))
    assert encoded(kind, NS, POOL, "producer") >= 3
    with monitoring.prometheus(kind) as prom:
        sel = f'namespace="{NS}",pool="{POOL}",group="{PRODUCERS}"'
        wait_until(
            "the encoder-demand integral in Prometheus",
            lambda: (prom.value(f"sum({ENCODER_INFLIGHT_SECONDS}{{{sel}}})") or 0) > 0,
            timeout=120,
        )
        # The consumers' signal is vLLM's own gauge, scraped from the consumer pod.
        running = prom.query(f'{VLLM_REQUESTS_RUNNING}{{namespace="{NS}",component="consumer"}}')
        assert running, "vLLM's gauges are not scraped from the consumer"

    # The HPA KEDA made reads the consumers' query through KEDA's metrics API.
    def consumer_metric() -> bool:
        hpa = kind.get("hpa", "-n", NS, f"{POOL}-consumer")
        return bool(hpa.get("status", {}).get("currentMetrics"))

    wait_until("the consumers' HPA to read its metric", consumer_metric, timeout=180)


def test_idle_producers_go_back_to_zero(kind: KindCluster, pool: dict[str, Any]) -> None:
    wait_until("the producers back at zero", lambda: replicas(kind) == 0, timeout=600)
    wait_ready(kind, NS, POOL)


def test_every_dashboard_panel_returns_data_after_traffic(
    kind: KindCluster, pool: dict[str, Any], tmp_path: Path
) -> None:
    """The chart's dashboard, panel by panel, on the test bed's Prometheus; then drawn
    (docs/operations.md's picture: ``ENCODERPOOL_DASHBOARD_PNG=path`` keeps a copy)."""
    empty = []
    with monitoring.prometheus(kind) as prom:
        for panel in PANELS:
            for expr, legend in panel.targets:
                expr = expr.replace("$namespace", NS).replace("$pool", POOL)
                # The panels' 5m windows have seen the traffic above.
                if not prom.query(expr):
                    empty.append(f"{panel.title}: {legend}")
        assert empty == [], f"panels without data: {empty}"
        path = Path(os.environ.get("ENCODERPOOL_DASHBOARD_PNG") or tmp_path / "dashboard.png")
        assert dashboard_png.render(prom.url, NS, POOL, path) == len(PANELS)
    assert path.stat().st_size > 10_000


def test_the_alerts_load_and_are_silent_while_the_pool_is_healthy(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    with monitoring.prometheus(kind) as prom:
        rules = {r["name"]: r for r in prom.rules()}
        assert sorted(rules) == sorted(a.name for a in ALERTS)
        for name, rule in rules.items():
            assert rule["health"] == "ok", (name, rule.get("lastError"))
            if name == "EncoderPoolLocalEncodeFallbackHigh":
                continue  # this pool's producers sleep at zero by design: its fault, above
            assert rule["state"] == "inactive", name
            assert prom.query(rule["query"]) == [], name


# --- induced faults: each fires its alert (the test bed's `for` is TEST_BED_FOR) ------------


def test_a_width_job_that_cannot_load_its_model_fires_its_alert(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    """A second pool whose model folder does not exist: its width Job fails."""
    name = "nomodel"
    [claim] = [
        c["metadata"]["name"]
        for c in kind.get("pvc", "-n", NS)["items"]
        if c["metadata"]["name"] != MODEL_CLAIM
    ]
    bad = copy.deepcopy(pool)
    bad["metadata"] = {"name": name, "namespace": NS}
    bad["spec"]["model"]["name"] = "no-such-model"
    bad["spec"]["widthJob"] = {"backoffLimit": 0, "activeDeadlineSeconds": 300}
    bad["spec"]["connector"] = {
        "sharedVolume": {"existingClaim": claim, "capacity": "32Mi", "mountPath": "/cache"}
    }
    kind.apply(bad)
    try:
        wait_until(
            "the width Job to fail",
            lambda: condition(kind, NS, name, "WidthsMeasured").get("reason") == "WidthJobFailed",
            timeout=600,
        )
        with monitoring.prometheus(kind) as prom:
            wait_until(
                "EncoderPoolWidthMeasurementFailing to fire",
                lambda: prom.firing("EncoderPoolWidthMeasurementFailing", NS, name),
                timeout=240,  # each back-off (30 s, then 60 s) outlasts the test bed's `for`
            )
            assert not prom.firing("EncoderPoolStalled", NS, name)  # said once, not twice
    finally:
        kind.kubectl("delete", "epool", "-n", NS, name, "--wait=true", timeout=300)


def test_a_nearly_full_cache_volume_fires_its_alert(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    """A file of another writer fills the volume past 90%; removed, the alert clears."""
    filler = f"{cache_dir_on_node(NS)}/someone-else-s-file"
    fill = CACHE_TMPFS_MIB - 4
    kind.node_exec("dd", "if=/dev/zero", f"of={filler}", "bs=1M", f"count={fill}", "status=none")
    query = next(a.expr for a in ALERTS if a.name == "EncoderPoolCacheVolumeNearlyFull")
    try:
        with monitoring.prometheus(kind) as prom:
            wait_until(
                "EncoderPoolCacheVolumeNearlyFull to fire",
                lambda: prom.firing("EncoderPoolCacheVolumeNearlyFull", NS, POOL),
                timeout=120,
            )
            kind.node_exec("rm", "-f", filler)
            wait_until("the volume's alert to clear", lambda: prom.query(query) == [], timeout=60)
    finally:
        kind.node_exec("rm", "-f", filler)


def test_a_pool_without_a_ready_consumer_fires_its_alerts(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    """The consumer's pod is lost (deleted; its replacement starts vLLM again): the router
    answers 503 meanwhile. Last in the module: the pool is not waited back."""
    kind.kubectl(
        "delete", "pod", "-n", NS, "-l", "app.kubernetes.io/component=consumer", "--wait=false"
    )
    with monitoring.prometheus(kind) as prom, kind.port_forward(NS, f"service/{POOL}", 8000) as url:
        body = chat_request(image(900), max_tokens=2)
        # While vLLM starts again in the new pod, the router has no consumer to send to;
        # clients keep asking meanwhile, one request every two seconds.
        wait_until("the router to answer 503", lambda: status_of(url, body) == 503, timeout=120)
        alerts = ("EncoderPoolNoConsumerReady", "EncoderPoolRouter5xx")

        def not_yet_firing() -> list[str]:
            code = status_of(url, body)
            assert code == 503, f"{code}: the consumer came back before the alerts fired"
            return [a for a in alerts if not prom.firing(a, NS, POOL)]

        wait_until("both alerts to fire", lambda: not not_yet_firing(), interval=2)


def status_of(url: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)

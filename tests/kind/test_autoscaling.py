"""Autoscaling on the real engine: Prometheus scrapes the pool, KEDA drives the producers
through the real HPA controller, to zero and back.

Prometheus and KEDA are built here from their Go modules (e2e/monitoring) and installed
as a platform team would, the chart is told where Prometheus is, and one pool whose
producers autoscale between 0 and 1 (a short scale-down window) is driven through:
asleep at zero while idle, a request answered by the consumer encoding it itself, the
producers woken by that demand, the next items encoded by the producer, back to zero
when the traffic stops. The consumers' autoscaler reads vLLM's own gauges.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.kind import monitoring
from e2e.kind.cluster import Engine, Images, KindCluster
from e2e.kind.pool import (
    cache_volume,
    chat,
    condition,
    encoded,
    example,
    for_kind,
    model_volume,
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
    cache_volume(kind, NS)
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
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    """The chart's dashboard, panel by panel, on the test bed's Prometheus."""
    empty = []
    with monitoring.prometheus(kind) as prom:
        for panel in PANELS:
            for expr, legend in panel.targets:
                expr = expr.replace("$namespace", NS).replace("$pool", POOL)
                # The panels' 5m windows have seen the traffic above.
                if not prom.query(expr):
                    empty.append(f"{panel.title}: {legend}")
    assert empty == [], f"panels without data: {empty}"


def test_the_alerts_load_and_are_silent_while_the_pool_is_healthy(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    with monitoring.prometheus(kind) as prom:
        rules = {r["name"]: r for r in prom.rules()}
        assert sorted(rules) == sorted(a.name for a in ALERTS)
        for name, rule in rules.items():
            assert rule["health"] == "ok", (name, rule.get("lastError"))
            assert rule["state"] != "firing", name
            assert prom.query(rule["query"]) == [] or name == "EncoderPoolLocalEncodeFallbackHigh"

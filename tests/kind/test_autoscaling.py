"""Autoscaling on the real engine: Prometheus scrapes the pool, KEDA drives the producers
through the real HPA controller, to zero and back.

Prometheus and KEDA are built here from their Go modules (e2e/monitoring) and installed
as a platform team would, the chart is told where Prometheus is, and one pool whose
producers autoscale between 0 and 2 and consumers between 1 and 2 (small targets,
short scale-down windows) is driven through: asleep at zero while idle, a request
answered by the consumer encoding it itself, the producers woken by that demand, the
next items encoded by the producer; image-heavy load taking the producers to 2 with the
consumers at 1, a producer removed while items are in flight, back to zero when the
traffic stops; a tenant in another namespace forging the pool's series, which moves
nothing; text-only load making the consumers' autoscaler ask for 2 and hold them with
the producers asleep; two consumers (KEDA's minimum raised) both serving, handed to a
fixed count and back to KEDA without losing a pod. Every answer
of a load phase equals a monolithic vLLM pod's, token by token.

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
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from e2e.kind import dashboard_png, forger, monitoring
from e2e.kind.cluster import Engine, Images, KindCluster
from e2e.kind.load import Answer, Load, ReplicaSampler, failures, mismatches, monolithic_answers
from e2e.kind.pool import (
    MODEL_CLAIM,
    cache_dir_on_node,
    chat,
    condition,
    encoded,
    monolithic,
    patch_spec,
    release_cache_volume,
    sample_pool,
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
from encoderpool_operator.naming import FIELD_MANAGER, LABEL_COMPONENT, replicas_managers
from tests.waiting import wait_until

pytestmark = pytest.mark.kind

NS = "kind-auto"
POOL = "auto"
PRODUCERS = f"{POOL}-producer"
CONSUMERS = f"{POOL}-consumer"
CACHE_TMPFS_MIB = 64
# Small targets and short scale-down windows, so that a few clients move each role on a
# 2-core node: four clients of image requests (the tiny model takes one image per
# request) keep up to 4 items in flight (producers to 2, their maximum) while at most 4
# requests reach the LM (consumers stay at 1); sixteen text-only clients keep up to 16
# requests on the LM (consumers to 2: past 10 on the mean, with room for the time each
# client spends outside vLLM) and no item anywhere.
PRODUCER_AUTOSCALING = {
    "minReplicas": 0,
    "maxReplicas": 2,
    "target": 1,
    "scaleDown": {"stabilizationWindowSeconds": 20},
}
CONSUMER_AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "target": 5,
    "scaleDown": {"stabilizationWindowSeconds": 20},
}
IMAGE_CLIENTS = 4
TEXT_CLIENTS = 16
# A load one test starts and the next one ends.
LOADS: dict[str, Load] = {}


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
    # A small tmpfs under the 1Gi the volume claims: the alerts' test fills it.
    spec = sample_pool(kind, NS, POOL, tiny_model_dir, images.vllm, cache_tmpfs_mib=CACHE_TMPFS_MIB)
    spec["spec"]["producer"]["autoscaling"] = PRODUCER_AUTOSCALING
    spec["spec"]["consumer"]["autoscaling"] = CONSUMER_AUTOSCALING
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


def at(kind: KindCluster, deployment: str, n: int) -> bool:
    """The Deployment asks for ``n`` pods and all of them are ready (and no other exists)."""
    d = kind.get("deployment", "-n", NS, deployment)
    st = d.get("status", {})
    return bool(
        d["spec"].get("replicas") == n
        and st.get("readyReplicas", 0) == n
        and st.get("replicas", 0) == n
    )


@pytest.fixture(scope="module")
def router(kind: KindCluster, pool: dict[str, Any]) -> Iterator[str]:
    """The pool's router through one port-forward for the module's loads."""
    wait_ready(kind, NS, POOL)
    with kind.port_forward(NS, f"service/{POOL}", 8000) as url:
        yield url


@pytest.fixture(scope="module")
def sampler(kind: KindCluster, pool: dict[str, Any]) -> Iterator[ReplicaSampler]:
    """The pool's Deployments read every 2 s from the pool's start to the module's end."""
    with ReplicaSampler(kind, NS, interval=2.0) as s:
        yield s


def wait_serving(kind: KindCluster, what: str, load: Load, ok: Callable[[], bool]) -> None:
    """``wait_until(what, ok)`` while ``load`` runs: a failed request ends the wait at
    once, and a wait that times out says how far the load got and what the autoscalers
    saw."""

    def check() -> bool:
        failed = load.failed()
        assert failed == [], failed[:3]
        return ok()

    try:
        wait_until(what, check, timeout=600)
    except AssertionError as e:
        hpas = {
            h["metadata"]["name"]: h.get("status", {}) for h in kind.get("hpa", "-n", NS)["items"]
        }
        raise AssertionError(f"{e}; {len(load.answers)} answers so far; HPAs: {hpas}") from None


@pytest.fixture(scope="module")
def mono(kind: KindCluster, pool: dict[str, Any]) -> Iterator[str]:
    """A monolithic vLLM pod beside the pool (its consumer's template, less the connector),
    started now and ready by the time a phase's answers are compared with it."""
    wait_ready(kind, NS, POOL)
    kind.apply(monolithic(kind, NS, POOL))
    yield f"deployment/{POOL}-mono"
    kind.kubectl("delete", "deployment", "-n", NS, f"{POOL}-mono", "--wait=false", check=False)


def expect_monolithic(kind: KindCluster, mono: str, answers: list[Answer]) -> None:
    """Every answer a 200 whose tokens equal the monolithic server's for the same body."""
    assert answers, "the load sent nothing"
    assert failures(answers) == []
    kind.kubectl("rollout", "status", "-n", NS, mono, "--timeout=600s", timeout=630)
    with kind.port_forward(NS, mono, 8000) as url:
        expected = monolithic_answers(url, (a.key for a in answers))
    assert mismatches(answers, expected) == []


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


def test_image_heavy_load_scales_producers_while_consumers_stay_at_their_minimum(
    kind: KindCluster, router: str, sampler: ReplicaSampler, mono: str
) -> None:
    """Four clients of image requests: the encoder demand takes the producers from 1 to 2;
    the LM sees at most four requests, under one consumer's target. The load then drops
    to one client at once (the next test's), which leaves the demand of one pod."""
    wait_until("one producer ready", lambda: at(kind, PRODUCERS, 1), timeout=600)
    start = time.monotonic()
    load = Load(router, "image", IMAGE_CLIENTS).start()
    try:
        wait_serving(kind, "two producers ready", load, lambda: at(kind, PRODUCERS, 2))
        time.sleep(20)  # the second producer serves items of the load too
    finally:
        # Started before the heavy load stops, so it runs while the autoscaler scales down.
        LOADS["trickle"] = Load(router, "image", 1, first=100_000).start()
        answers = load.stop()
    consumers = {s.replicas for s in sampler.of(CONSUMERS, since=start)}
    assert consumers == {1}, f"the consumers moved under image-heavy load: {consumers}"
    expect_monolithic(kind, mono, answers)


def test_a_producer_removed_while_items_are_in_flight_loses_none(
    kind: KindCluster, sampler: ReplicaSampler, mono: str
) -> None:
    """One client of image requests keeps items going to the producers while their
    demand falls under two pods' target: the autoscaler removes one (it leaves the
    router's view first and drains, docs/autoscaling.md); every request is answered."""
    load = LOADS.pop("trickle")
    try:
        wait_serving(kind, "the producers down to 1", load, lambda: at(kind, PRODUCERS, 1))
        time.sleep(5)
    finally:
        answers = load.stop()
    seen = sampler.of(PRODUCERS, since=answers[0].started)
    assert (seen[0].existing, seen[-1].existing) == (2, 1), seen
    removed_at = next(s.at for s in seen if s.replicas == 1)
    assert removed_at < answers[-1].started
    expect_monolithic(kind, mono, answers)


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


def test_a_tenant_in_another_namespace_cannot_forge_the_pools_signals(
    kind: KindCluster, pool: dict[str, Any], images: Images, sampler: ReplicaSampler
) -> None:
    """Pods of another namespace labelled like the pool's consumer, router and operator
    export the pool's series (1000 requests running, unserved items growing by 1000 a
    second). Prometheus keeps them under the tenant's namespace, or drops them; every
    query the pool's ScaledObjects run stays at the pool's own (idle) values, and
    neither role moves."""
    tenant = "kind-forger"
    kind.namespace(tenant)
    try:
        kind.apply(forger.pods(tenant, images.operator, NS, POOL, PRODUCERS))
        kind.kubectl(
            "wait", "-n", tenant, "--for=condition=Ready", "pod", "--all", "--timeout=300s",
            timeout=330,
        )  # fmt: skip
        queries = [
            t["metadata"]["query"]
            for o in kind.get("scaledobjects", "-n", NS)["items"]
            for t in o["spec"]["triggers"]
        ]
        assert len(queries) == 3, queries  # encoder demand, wake, LM demand
        with monitoring.prometheus(kind) as prom:
            wait_until(
                "Prometheus to store the forged consumer's series, as the tenant's",
                lambda: (
                    prom.value(
                        f'sum({VLLM_REQUESTS_RUNNING}{{namespace="{tenant}",exported_namespace="{NS}"}})'
                    )
                    == 1000
                ),
                timeout=120,
            )
            wait_until(
                "the forged router's counters to grow, as the tenant's",
                lambda: (
                    (
                        prom.value(
                            f'sum(rate({ENCODER_UNSERVED_ITEMS}{{namespace="{tenant}"}}[1m]))'
                        )
                        or 0
                    )
                    > 100
                ),
                timeout=120,
            )
            start = time.monotonic()
            for _ in range(6):  # 30 s: six scrapes, three KEDA polls
                values = {q: prom.value(q) for q in queries}
                assert all(v is not None and v < 1 for v in values.values()), values
                time.sleep(5)
            assert prom.query(f'{{namespace="{tenant}",pod="forged-operator"}}') == []
            assert prom.query(f'{{namespace="{NS}",pod=~"forged-.+"}}') == []
        assert {s.replicas for s in sampler.of(PRODUCERS, since=start)} == {0}
        assert {s.replicas for s in sampler.of(CONSUMERS, since=start)} == {1}
    finally:
        kind.kubectl("delete", "namespace", tenant, "--wait=false", check=False)


def test_text_only_load_scales_consumers_while_producers_sleep(
    kind: KindCluster, router: str, sampler: ReplicaSampler, mono: str
) -> None:
    """Sixteen clients of text-only requests with long answers: the LM demand makes the
    consumers' autoscaler ask for a second consumer and hold it while the load lasts; no
    item is asked of an encoder, the producers stay at zero.

    What is asserted is the autoscaler's decision, not the new pod's readiness: vLLM
    starting on two cores that the load (and, in make test, the other suite) keeps busy
    took more than ten minutes, which says nothing about the autoscaler. The next test
    brings a second consumer up without load and checks it serves."""
    wait_until("the producers at zero", lambda: at(kind, PRODUCERS, 0), timeout=600)
    start = time.monotonic()
    load = Load(router, "text", TEXT_CLIENTS).start()
    try:
        wait_serving(kind, "the autoscaler to ask for two consumers", load, lambda: asks(kind, 2))
        decided = time.monotonic()
        time.sleep(45)  # nine KEDA polls and twice the test's scale-down window
    finally:
        answers = load.stop()
    held = {s.replicas for s in sampler.of(CONSUMERS, since=decided + 2, until=decided + 45)}
    assert held == {2}, f"the second consumer was not held while the load lasted: {held}"
    producers = {s.replicas for s in sampler.of(PRODUCERS, since=start)}
    assert producers == {0}, f"the producers woke under text-only load: {producers}"
    expect_monolithic(kind, mono, answers)


def asks(kind: KindCluster, n: int) -> bool:
    """The consumers' Deployment asks for ``n`` pods, its count written by the autoscaler."""
    d = kind.get("deployment", "-n", NS, CONSUMERS, "--show-managed-fields")
    return d["spec"].get("replicas") == n and FIELD_MANAGER not in replicas_managers(d)


def test_switching_consumers_to_a_fixed_count_and_back_keeps_their_pods(
    kind: KindCluster, pool: dict[str, Any], router: str
) -> None:
    """Two consumers, KEDA's (its minimum raised to 2, so they are up without load): a
    fixed ``replicas: 2`` takes the field back (the autoscaler removed, the count kept);
    autoscaling again (minimum 1) keeps both pods until the HPA that KEDA made lowers the
    count itself, there being no load (server-side apply never drops the field to the
    API server's default of 1). The second consumer serves: the router sends to both."""
    two = {**CONSUMER_AUTOSCALING, "minReplicas": 2}
    patch_spec(kind, NS, POOL, {"consumer": {"autoscaling": two}})
    # The operator itself raises the live count to a new minimum (it holds the field
    # until the HPA writes it, and the HPA, finding 2 already, writes nothing).
    wait_until("two consumers at KEDA's minimum", lambda: at(kind, CONSUMERS, 2), timeout=900)
    served_by = consumers_serving(kind, router)
    assert len(served_by) == 2, f"the router sent to {served_by}, not to both consumers"

    def fixed_by_the_operator() -> bool:
        """The operator applies the count (it may share the field with the HPA's stale
        manager entry: server-side apply co-owns a field two managers set alike) and the
        consumers' ScaledObject is gone."""
        s = fast.latest(CONSUMERS)
        autoscalers = kind.get("scaledobjects", "-n", NS)["items"]
        return (
            s is not None
            and FIELD_MANAGER in s.managers
            and s.replicas == 2
            and CONSUMERS not in {o["metadata"]["name"] for o in autoscalers}
        )

    with ReplicaSampler(kind, NS, interval=0.5) as fast:
        patch_spec(kind, NS, POOL, {"consumer": {"replicas": 2, "autoscaling": None}})
        wait_until("the operator to hold the consumers' count", fixed_by_the_operator, timeout=180)
        held = time.monotonic()
        time.sleep(5)
        switched, switched_at = time.monotonic(), datetime.now(timezone.utc)
        patch_spec(kind, NS, POOL, {"consumer": {"autoscaling": CONSUMER_AUTOSCALING}})
        wait_until("the autoscaler to lower the count", lambda: at(kind, CONSUMERS, 1), timeout=300)
    seen = fast.of(CONSUMERS)
    fixed = [s for s in seen if held <= s.at < switched]
    assert fixed, "no sample while the count was fixed"
    assert {(s.replicas, s.existing) for s in fixed} == {(2, 2)}, fixed
    lowered = next(s.at for s in seen if s.at >= switched and s.replicas != 2)
    meanwhile = [s for s in seen if switched <= s.at < lowered]
    assert meanwhile, "no sample between the switch and the lowering"
    assert {(s.replicas, s.existing) for s in meanwhile} == {(2, 2)}, meanwhile
    # Lowered by the HPA, not by the API server defaulting a dropped field to 1 (which
    # the HPA would then see as its own wish, with no rescale of its own).
    assert hpa_rescaled_to(kind, CONSUMERS, 1, since=switched_at), "the HPA did not lower it"


def hpa_rescaled_to(kind: KindCluster, hpa: str, size: int, since: datetime) -> bool:
    """The HPA ``hpa`` posted a rescale to ``size`` at or after ``since`` (events carry
    whole seconds)."""
    events = kind.get(
        "events",
        "-n",
        NS,
        "--field-selector",
        f"involvedObject.name={hpa},reason=SuccessfulRescale",
    )["items"]
    floor = since.replace(microsecond=0)
    for e in events:
        when = e.get("lastTimestamp") or e.get("eventTime") or ""
        if not when or not e.get("message", "").startswith(f"New size: {size};"):
            continue
        stamp = datetime.fromisoformat(when.replace("Z", "+00:00"))
        if stamp >= floor:
            return True
    return False


def consumers_serving(kind: KindCluster, router: str) -> set[str]:
    """The consumer pods that answered chat requests (their access logs) while four
    clients of text requests used the router for 20 s, each answer a 200 with tokens."""
    load = Load(router, "text", 4).start()
    time.sleep(20)
    assert failures(load.stop()) == []
    pods = kind.get("pods", "-n", NS, "-l", f"{LABEL_COMPONENT}=consumer")["items"]
    return {
        p["metadata"]["name"]
        for p in pods
        if '"POST /v1/chat/completions HTTP/1.1" 200'
        in kind.kubectl("logs", "-n", NS, p["metadata"]["name"], "--since=60s")
    }


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
    # The load phases left entries of the pool's own: fill what is free, less 2 MiB (the
    # volume then stands at least 96% full).
    free = kind.node_exec("df", "-B1M", "--output=avail", cache_dir_on_node(NS)).split()[-1]
    fill = max(0, int(free) - 2)
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
    """The consumers' pods are lost with their node unschedulable (cordoned; the
    replacements stay Pending, so no consumer comes back until the node is uncordoned):
    the router answers 503 meanwhile. Last in the module: the pool is not waited back.
    (Deleting the pods alone raced the alerts: a warm node starts vLLM in ~30 s.)"""
    node = f"{kind.name}-control-plane"
    kind.kubectl("cordon", node)
    try:
        wait_until("a consumer Pending on the cordoned node", lambda: consumers_pending(kind))
        no_consumer_fires_its_alerts(kind)
    finally:
        kind.kubectl("uncordon", node, check=False)


def consumers_pending(kind: KindCluster) -> bool:
    """Deletes every consumer pod bound to the node; True once a replacement exists and
    none is bound. A replacement made right after the cordon can still be bound (the
    scheduler had not seen it yet, seen on a busy node): it is deleted in turn."""
    pods = kind.get("pods", "-n", NS, "-l", f"{LABEL_COMPONENT}=consumer")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    bound = [p["metadata"]["name"] for p in live if p["spec"].get("nodeName")]
    if bound:
        kind.kubectl("delete", "pod", "-n", NS, *bound, "--wait=false")
        return False
    return bool(live)


def no_consumer_fires_its_alerts(kind: KindCluster) -> None:
    with monitoring.prometheus(kind) as prom, kind.port_forward(NS, f"service/{POOL}", 8000) as url:
        body = chat_request(image(900), max_tokens=2)
        # While the replacements are Pending, the router has no consumer to send to;
        # clients keep asking meanwhile, one request every two seconds.
        wait_until("the router to answer 503", lambda: status_of(url, body) == 503, timeout=120)
        alerts = ("EncoderPoolNoConsumerReady", "EncoderPoolRouter5xx")

        def not_yet_firing() -> list[str]:
            code = status_of(url, body)
            assert code == 503, f"{code}: the consumer came back before the alerts fired"
            return [a for a in alerts if not prom.firing(a, NS, POOL)]

        # `for` 15 s on each, after the router's 5xx ratio over 5m and its empty consumer
        # set are scraped and evaluated: seconds on an idle node, more beside make test.
        wait_until("both alerts to fire", lambda: not not_yet_firing(), timeout=240, interval=2)


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

"""The Prometheus scrape configuration of docs/autoscaling.md and the test bed
(``e2e/kind/monitoring.py``): a pod in another namespace cannot forge a pool's series.

Pure tests read the configuration (the docs' copy must equal the test bed's) and run its
relabel rules on discovered targets, as Prometheus applies them. One test on the local
control plane runs the test bed's real Prometheus with the test bed's rules against pods
in three namespaces (the operator's, a pool's, a tenant's): kwok runs no pod, so each
pod is host-networked (its address is the kwok node's, 127.0.0.1) and its port is a
local server exporting what that pod would, forged series included.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import LocalCluster
from e2e.kind.monitoring import OPERATOR_NAMESPACE, SCRAPE_CONFIG, local_prometheus, scrape_config
from encoderpool_contracts.signals import (
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    VLLM_KV_CACHE_USAGE,
    VLLM_REQUESTS_RUNNING,
    VLLM_REQUESTS_WAITING,
)
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.render.autoscaling import scalers
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "autoscaling.md"
POOL_JOB, OPERATOR_JOB = "encoderpool", "encoderpool-operator"


def doc_blocks() -> list[Any]:
    """Every YAML block of docs/autoscaling.md, parsed."""
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)]


def job(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    [found] = [j for j in config["scrape_configs"] if j["job_name"] == name]
    return dict(found)


# --- Prometheus's relabelling, for the pure tests --------------------------------------


def relabel(labels: Mapping[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """``labels`` through ``rules`` (Prometheus's ``relabel_configs``, or a PodMonitor's
    ``relabelings``: the actions used here, keep and replace); None when dropped."""
    out = dict(labels)
    for rule in rules:
        sources = rule.get("source_labels", rule.get("sourceLabels", []))
        value = rule.get("separator", ";").join(out.get(s, "") for s in sources)
        match = re.fullmatch(str(rule.get("regex", "(.*)")), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                target = str(rule.get("target_label", rule.get("targetLabel")))
                new = match.expand(str(rule.get("replacement", "$1")).replace("$", "\\"))
                if new:
                    out[target] = new
                else:
                    out.pop(target, None)
        else:
            raise AssertionError(f"an action this test does not know: {action}")
    return out


def scraped(
    target: dict[str, str] | None, exported: Mapping[str, str], honor: bool
) -> dict[str, str]:
    """One exported series' labels once scraped from ``target`` (None: not scraped)."""
    if target is None:
        return {}
    own = {k: v for k, v in target.items() if not k.startswith("__")}
    if honor:
        return {**own, **exported}
    renamed = {(f"exported_{k}" if k in own else k): v for k, v in exported.items()}
    return {**renamed, **own}


def pod_target(namespace: str, labels: Mapping[str, str], port: str) -> dict[str, str]:
    """What Kubernetes service discovery (role: pod) gives for one container port."""
    meta = {
        f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
        for k, v in labels.items()
    }
    return {
        "__address__": "10.0.0.9:8000",
        "__meta_kubernetes_namespace": namespace,
        "__meta_kubernetes_pod_name": "p",
        "__meta_kubernetes_pod_container_port_name": port,
        **meta,
    }


POOL_LABELS = {"app.kubernetes.io/name": "encoderpool", "encoderpool.io/pool": "victim"}
OPERATOR_LABELS = {"app.kubernetes.io/name": "encoderpool-operator"}
# What a tenant exports to pass for pool "victim" of namespace "a".
FORGED = {"namespace": "a", "pool": "victim", "component": "consumer"}


# --- pure: the configuration's rules ----------------------------------------------------


def test_the_docs_show_the_test_beds_scrape_configuration() -> None:
    [config] = [b for b in doc_blocks() if isinstance(b, dict) and "scrape_configs" in b]
    assert config["scrape_configs"] == SCRAPE_CONFIG["scrape_configs"]
    assert OPERATOR_NAMESPACE == "encoderpool-system"  # what the docs' copy names


def test_pool_pods_labels_come_from_the_pod_never_from_what_it_exports() -> None:
    pools = job(SCRAPE_CONFIG, POOL_JOB)
    assert pools["honor_labels"] is False
    assert "metric_relabel_configs" not in pools  # nothing rewrites a label after the scrape
    # Only the pod's own metadata writes namespace, pool and component.
    writers = {
        r["target_label"]: r["source_labels"]
        for r in pools["relabel_configs"]
        if "target_label" in r
    }
    assert writers == {
        "namespace": ["__meta_kubernetes_namespace"],
        "pod": ["__meta_kubernetes_pod_name"],
        "pool": ["__meta_kubernetes_pod_label_encoderpool_io_pool"],
        "component": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
    }
    rules = pools["relabel_configs"]
    consumer = {**POOL_LABELS, "app.kubernetes.io/component": "consumer"}
    # A tenant's pod labelled like a pool's: its series are its own namespace's.
    target = relabel(pod_target("b", consumer, "http"), rules)
    assert scraped(target, FORGED, honor=False) == {
        "namespace": "b",
        "pod": "p",
        "pool": "victim",
        "component": "consumer",
        "exported_namespace": "a",
        "exported_pool": "victim",
        "exported_component": "consumer",
    }
    # Without a pool label it is not scraped: an exported pool would stand in for one.
    no_pool = {k: v for k, v in consumer.items() if k != "encoderpool.io/pool"}
    assert relabel(pod_target("b", no_pool, "http"), rules) is None
    # The real consumer in "a", and the router on its metrics port only.
    assert relabel(pod_target("a", consumer, "http"), rules) is not None
    router = {**POOL_LABELS, "app.kubernetes.io/component": "router"}
    assert relabel(pod_target("a", router, "metrics"), rules) is not None
    assert relabel(pod_target("a", router, "http"), rules) is None


def test_the_operator_job_keeps_only_its_namespace_and_its_own_metric_names() -> None:
    op = job(SCRAPE_CONFIG, OPERATOR_JOB)
    assert op["honor_labels"] is True  # the pool gauges' own namespace and pool
    assert op["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"names": [OPERATOR_NAMESPACE]}}
    ]
    assert {"source_labels": ["__meta_kubernetes_namespace"], "regex": OPERATOR_NAMESPACE,
            "action": "keep"} in op["relabel_configs"]  # fmt: skip
    assert op["metric_relabel_configs"] == [
        {"source_labels": ["__name__"], "regex": "encoderpool_operator_.+", "action": "keep"}
    ]
    rules = op["relabel_configs"]
    # A pod in a tenant's namespace labelled like the operator's is not scraped at all ...
    assert relabel(pod_target("b", OPERATOR_LABELS, "metrics"), rules) is None
    assert relabel(pod_target(OPERATOR_NAMESPACE, OPERATOR_LABELS, "metrics"), rules) is not None
    # ... and of the operator's own series only its own names are kept.
    for name, kept in [
        ("encoderpool_operator_pool_replicas", True),
        (VLLM_REQUESTS_RUNNING, False),
        (ENCODER_UNSERVED_ITEMS, False),
        ("process_cpu_seconds_total", False),
    ]:
        assert (relabel({"__name__": name}, op["metric_relabel_configs"]) is not None) == kept


def test_the_operator_namespace_is_a_parameter_of_the_test_bed() -> None:
    op = job(scrape_config("platform"), OPERATOR_JOB)
    assert op["kubernetes_sd_configs"][0]["namespaces"] == {"names": ["platform"]}
    assert relabel(pod_target("platform", OPERATOR_LABELS, "metrics"), op["relabel_configs"])
    assert not relabel(pod_target(OPERATOR_NAMESPACE, OPERATOR_LABELS, "metrics"),
                       op["relabel_configs"])  # fmt: skip


@pytest.mark.parametrize(
    ("component", "port"),
    [
        ("router", "metrics"),
        ("router", "http"),
        ("consumer", "http"),
        ("consumer", "metrics"),
        ("producer", "http"),
        ("producer-video", "http"),
        ("width", "http"),
    ],
)
def test_the_docs_pod_monitor_keeps_and_labels_what_the_scrape_job_does(
    component: str, port: str
) -> None:
    """The Prometheus Operator variant: the same targets, the same pool and component (it
    sets namespace and pod from the pod itself, and honours no label by default)."""
    [monitor] = [b for b in doc_blocks() if isinstance(b, dict) and b.get("kind") == "PodMonitor"]
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/name": "encoderpool"}
    assert all(not e.get("honorLabels", False) for e in spec["podMetricsEndpoints"])
    for labels in (
        {**POOL_LABELS, "app.kubernetes.io/component": component},
        {"app.kubernetes.io/name": "encoderpool", "app.kubernetes.io/component": component},
    ):
        target = pod_target("b", labels, port)
        want = relabel(target, job(SCRAPE_CONFIG, POOL_JOB)["relabel_configs"])
        relabelled = [
            relabel(target, e["relabelings"])
            for e in spec["podMetricsEndpoints"]
            if e["port"] == port
        ]
        got = [g for g in relabelled if g is not None]
        if want is None:
            assert got == []
        else:
            [one] = got
            assert {k: one.get(k) for k in ("pool", "component")} == {
                k: want[k] for k in ("pool", "component")
            }


# --- a real Prometheus, the test bed's rules, pods in three namespaces -------------------


class Exporter:
    """A /metrics endpoint on 127.0.0.1: ``lines(n)`` is its body at the n-th scrape; the
    scrapes ``fails(n)`` names are answered 500 (a server too busy to answer)."""

    def __init__(
        self, lines: Callable[[int], list[str]], fails: Callable[[int], bool] = lambda n: False
    ) -> None:
        self.lines = lines
        self.scrapes = 0
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                exporter.scrapes += 1
                if fails(exporter.scrapes):
                    self.send_error(500)
                    return
                body = ("\n".join(exporter.lines(exporter.scrapes)) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def series(name: str, value: float, **labels: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value}" if inner else f"{name} {value}"


def host_pod(name: str, labels: Mapping[str, str], port_name: str, port: int) -> dict[str, Any]:
    """A pod whose address is the kwok node's (127.0.0.1): its port is a local server."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "hostNetwork": True,
            "containers": [
                {
                    "name": "main",
                    "image": "example.invalid/none:1",
                    "ports": [{"name": port_name, "containerPort": port}],
                }
            ],
        },
    }


@contextmanager
def prometheus(config: dict[str, Any], work: Path) -> Iterator[Callable[[str], list[Any]]]:
    """The test bed's Prometheus with ``config``; yields an instant-query function."""
    with local_prometheus(config, work) as url:

        def query(promql: str) -> list[Any]:
            q = urllib.parse.urlencode({"query": promql})
            with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
                body = json.load(r)
            assert body["status"] == "success", body
            return list(body["data"]["result"])

        yield query


@pytest.fixture
def namespaces(cluster: LocalCluster) -> Iterator[tuple[str, str, str]]:
    """The operator's, a pool's and a tenant's namespace, fresh."""
    names = tuple(f"t-{role}-{uuid.uuid4().hex[:8]}" for role in ("op", "pool", "tenant"))
    for ns in names:
        cluster.kubectl("create", "namespace", ns)
    yield names  # type: ignore[misc]
    for ns in names:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def victim_pool(namespace: str) -> EncoderPool:
    """A pool whose producers and consumers autoscale, on every signal."""
    obj = yaml.safe_load((REPO / "examples" / "pool-shared-volume.yaml").read_text())
    obj["metadata"] = {"name": "victim", "namespace": namespace}
    obj["spec"]["producer"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 4}
    obj["spec"]["consumer"]["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetKvCacheUsage": 0.8,
    }
    return EncoderPool.from_object(obj)


@pytest.mark.cluster
def test_a_tenants_forged_series_change_nothing_the_pools_autoscalers_read(
    cluster: LocalCluster, namespaces: tuple[str, str, str], tmp_path: Path
) -> None:
    op_ns, pool_ns, tenant_ns = namespaces
    pool = victim_pool(pool_ns)
    triggers = {t.name: t for s in scalers(pool) for t in s.triggers}
    assert set(triggers) == {"encoder-demand", "encoder-unserved", "lm-demand", "kv-cache-usage"}
    group = f"{pool.name}-producer"
    victim = {"namespace": pool_ns, "pool": pool.name}
    # The tenant's counters rise at every scrape: if one reached a rate, it would show.

    def forged(n: int) -> list[str]:
        return [
            series(VLLM_REQUESTS_RUNNING, 1000, **victim, component="consumer"),
            series(VLLM_REQUESTS_WAITING, 1000, **victim, component="consumer"),
            series(VLLM_KV_CACHE_USAGE, 1, **victim, component="consumer"),
            series(ENCODER_UNSERVED_ITEMS, 100 * n, **victim, component="router", group=group),
            series(ENCODER_INFLIGHT_SECONDS, 100 * n, **victim, component="router", group=group),
            series("encoderpool_operator_pool_replicas", 99, **victim, component="consumer"),
        ]

    exporters = {
        # The pool's own pods, and the operator in its namespace.
        "router": Exporter(
            lambda n: [
                series(ENCODER_UNSERVED_ITEMS, 2, group=group),
                series(ENCODER_INFLIGHT_SECONDS, 5, group=group),
            ]
        ),
        "consumer": Exporter(
            lambda n: [
                series(VLLM_REQUESTS_RUNNING, 3),
                series(VLLM_REQUESTS_WAITING, 1),
                series(VLLM_KV_CACHE_USAGE, 0.25),
            ]
        ),
        "operator": Exporter(
            lambda n: [
                series("encoderpool_operator_pool_replicas", 1, **victim, component="consumer"),
                # Not an operator metric: never kept, whatever labels it carries.
                series(VLLM_REQUESTS_RUNNING, 1000, **victim, component="consumer"),
            ]
        ),
        # The tenant: a pod labelled like the operator's, one like the pool's consumer,
        # one like a router of no pool.
        "fake-operator": Exporter(forged),
        "fake-consumer": Exporter(forged),
        "fake-router": Exporter(forged),
    }
    consumer = {**POOL_LABELS, "encoderpool.io/pool": pool.name}
    pods = [
        (pool_ns, "router", {**consumer, "app.kubernetes.io/component": "router"}, "metrics"),
        (pool_ns, "consumer", {**consumer, "app.kubernetes.io/component": "consumer"}, "http"),
        (op_ns, "operator", OPERATOR_LABELS, "metrics"),
        (tenant_ns, "fake-operator", OPERATOR_LABELS, "metrics"),
        (tenant_ns, "fake-consumer", {**consumer, "app.kubernetes.io/component": "consumer"},
         "http"),
        (tenant_ns, "fake-router",
         {"app.kubernetes.io/name": "encoderpool", "app.kubernetes.io/component": "router"},
         "metrics"),
    ]  # fmt: skip
    try:
        for ns, name, labels, port in pods:
            cluster.kubectl(
                "apply", "-n", ns, "-f", "-",
                input=json.dumps(host_pod(name, labels, port, exporters[name].port)),
            )  # fmt: skip
        for ns, name, _, _ in pods:
            wait_until(f"pod {ns}/{name} on 127.0.0.1", partial(on_loopback, cluster, ns, name))
        config = copy.deepcopy(scrape_config(op_ns))
        config.pop("rule_files")
        for j in config["scrape_configs"]:
            for sd in j["kubernetes_sd_configs"]:
                sd["kubeconfig_file"] = str(cluster.kubeconfig)
                # Discovery sees these three namespaces only (the shared control plane's
                # other kwok pods have addresses that must never be contacted); the
                # operator job too, so that its relabel rules, not discovery, must drop
                # the tenant's pod.
                sd["namespaces"] = {"names": [op_ns, pool_ns, tenant_ns]}
        with prometheus(config, tmp_path) as query:
            scraped_by = {"operator", "router", "consumer", "fake-consumer"}
            kept = "|".join(scraped_by)
            wait_until(
                "three scrapes of every target kept",
                lambda: (
                    _count(query, f'count(count_over_time(up{{pod=~"{kept}"}}[1m]) >= 3)')
                    == len(scraped_by)
                ),
                timeout=90,
            )

            # What the pool's autoscalers read: the pool's own pods alone.
            expected = {
                "encoder-demand": 0.0,  # the router's counters stand still
                "encoder-unserved": 0.0,
                "lm-demand": 4.0,
                "kv-cache-usage": 0.25,
            }
            got = {name: _value(query, t.query) for name, t in triggers.items()}
            assert got == pytest.approx(expected)

            # Every series labelled with the pool's namespace comes from its own pods or,
            # the operator's gauge, from the operator in its namespace.
            sources = {
                (s["metric"].get("job"), s["metric"].get("pod"))
                for s in query(f'{{namespace="{pool_ns}"}}')
            }
            assert sources == {
                ("encoderpool", "router"),
                ("encoderpool", "consumer"),
                ("encoderpool-operator", "operator"),
            }
            operator_names = {
                s["metric"]["__name__"] for s in query('{job="encoderpool-operator"}')
            }
            assert {n for n in operator_names if not n.startswith(("up", "scrape_"))} == {
                "encoderpool_operator_pool_replicas"
            }
            assert exporters["fake-operator"].scrapes == 0  # not in the operator's namespace
            assert exporters["fake-router"].scrapes == 0  # no pool label
            # The tenant's lookalike consumer is scraped as what it is: its namespace.
            [running] = query(f'{VLLM_REQUESTS_RUNNING}{{pod="fake-consumer"}}')
            assert running["metric"]["namespace"] == tenant_ns
            assert running["metric"]["exported_namespace"] == pool_ns
    finally:
        for e in exporters.values():
            e.close()


@pytest.mark.cluster
def test_a_consumer_whose_scrapes_fail_is_not_read_as_idle(
    cluster: LocalCluster, namespaces: tuple[str, str, str], tmp_path: Path
) -> None:
    """vLLM answers /metrics late under load; a failed scrape marks the pod's series
    stale at once. The consumers' signals average each pod over the window, so they keep
    the pool's load through every other scrape failing, where an instant sum reads 0."""
    op_ns, pool_ns, _ = namespaces
    pool = victim_pool(pool_ns)
    triggers = {t.name: t for s in scalers(pool) for t in s.triggers}
    consumer = Exporter(
        lambda n: [
            series(VLLM_REQUESTS_RUNNING, 3),
            series(VLLM_REQUESTS_WAITING, 1),
            series(VLLM_KV_CACHE_USAGE, 0.25),
        ],
        fails=lambda n: n % 2 == 0,
    )
    labels = {**POOL_LABELS, "encoderpool.io/pool": pool.name}
    try:
        cluster.kubectl(
            "apply", "-n", pool_ns, "-f", "-",
            input=json.dumps(host_pod("consumer", {**labels, "app.kubernetes.io/component":
                                                   "consumer"}, "http", consumer.port)),
        )  # fmt: skip
        wait_until("the pod on 127.0.0.1", partial(on_loopback, cluster, pool_ns, "consumer"))
        config = copy.deepcopy(scrape_config(op_ns))
        config.pop("rule_files")
        for j in config["scrape_configs"]:
            for sd in j["kubernetes_sd_configs"]:
                sd["kubeconfig_file"] = str(cluster.kubeconfig)
                sd["namespaces"] = {"names": [pool_ns]}
        instant = (
            f'sum({VLLM_REQUESTS_RUNNING}{{namespace="{pool_ns}",component="consumer"}})'
            " or vector(0)"
        )
        with prometheus(config, tmp_path) as query:
            wait_until("four scrapes", lambda: consumer.scrapes >= 4, timeout=60)
            seen: dict[str, set[float]] = {"lm-demand": set(), "kv-cache-usage": set()}
            instants = set()
            deadline = consumer.scrapes + 4  # two more failures, two more answers
            while consumer.scrapes < deadline:
                for name in seen:
                    seen[name].add(_value(query, triggers[name].query))
                instants.add(_value(query, instant))
                threading.Event().wait(0.5)
        assert seen == {"lm-demand": {4.0}, "kv-cache-usage": {0.25}}
        assert 0.0 in instants  # what an instant sum read meanwhile: the test can tell
    finally:
        consumer.close()


def on_loopback(cluster: LocalCluster, namespace: str, name: str) -> bool:
    """Whether kwok runs the pod at the node's address."""
    ip = cluster.kubectl("get", "pod", "-n", namespace, name, "-o", "jsonpath={.status.podIP}")
    return ip == "127.0.0.1"


def _count(query: Callable[[str], list[Any]], promql: str) -> int:
    result = query(promql)
    return int(float(result[0]["value"][1])) if result else 0


def _value(query: Callable[[str], list[Any]], promql: str) -> float:
    [one] = query(promql)
    return float(one["value"][1])

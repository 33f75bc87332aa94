"""Prometheus and KEDA in the kind cluster, as a platform team runs them beside a pool.

Both are built here from their Go modules (``e2e/monitoring/build.sh``) into one image
(``e2e/monitoring/image.sh``). KEDA is installed from the manifests its own module ships
(``config/``, rendered with ``kubectl kustomize``, only the image names replaced);
Prometheus from the objects below: one server that scrapes every encoderpool pod and
labels each series with ``namespace``, ``pod``, ``pool`` and ``component`` — the labels
the pool's autoscaling queries select by, taken from the pod and never from what it
exports (docs/autoscaling.md shows the same scrape configuration for a cluster's own
Prometheus) — and the operator in its own namespace, whose pool gauges keep their own
``namespace`` and ``pool`` labels (only its ``encoderpool_operator_*`` series). It loads
the chart's alerts with their expressions unchanged and each ``for`` cut to
``TEST_BED_FOR``, so a test sees an induced fault fire within a minute
(tests/chart/test_alert_rules.py tests the real ``for``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from e2e.kind.cluster import OPERATOR_NS, ROOT, KindCluster, key_values, run

MONITORING_DIR = ROOT / "e2e" / "monitoring"
ALERTS = ROOT / "charts" / "encoderpool-operator" / "files" / "alerts.json"
PROMETHEUS_NS = "monitoring"
KEDA_NS = "keda"
PROMETHEUS_PORT = 9090
# How often the test bed's Prometheus scrapes: short, so a test sees load within seconds.
SCRAPE_INTERVAL = "5s"
TEST_BED_FOR = "15s"

# Where the operator runs (the kind test bed installs the chart there): the only
# namespace whose operator pods Prometheus keeps.
OPERATOR_NAMESPACE = OPERATOR_NS
# What an operator pod may export: its own metric names, nothing else.
OPERATOR_METRICS = "encoderpool_operator_.+"


def scrape_config(operator_namespace: str = OPERATOR_NAMESPACE) -> dict[str, Any]:
    """The test bed's Prometheus configuration (docs/autoscaling.md shows the same jobs).

    Pool pods: every series takes ``namespace`` from the pod's real namespace and
    ``pool`` and ``component`` from its labels, never from what the pod exports
    (``honor_labels: false``: an exported label of the same name is kept as
    ``exported_<name>``), and a pod without a pool label is not scraped (a label it set
    would otherwise stand in for the missing one). So a pod in another namespace,
    labelled like a pool's, only ever adds series of its own namespace.

    The operator: its pool gauges carry each pool's namespace and pool labels, which the
    chart's alerts and dashboard select by, so its labels are honoured; hence only its
    own namespace's pods are scraped (a tenant could label a pod like the operator's) and
    only ``encoderpool_operator_*`` names kept from them, none of which an autoscaler
    reads.
    """
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        # The chart's alerts (charts/encoderpool-operator/files/alerts.json), as a rule file.
        "rule_files": ["/etc/prometheus/alerts.yml"],
        "scrape_configs": [
            {
                "job_name": "encoderpool",
                "honor_labels": False,
                "kubernetes_sd_configs": [{"role": "pod"}],
                "relabel_configs": [
                    {
                        "source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
                        "regex": "encoderpool",
                        "action": "keep",
                    },
                    # vLLM serves /metrics on its API port; the router on a port of its own.
                    {
                        "source_labels": [
                            "__meta_kubernetes_pod_label_app_kubernetes_io_component",
                            "__meta_kubernetes_pod_container_port_name",
                        ],
                        "regex": "(router;metrics|producer(-.+)?;http|consumer;http)",
                        "action": "keep",
                    },
                    {
                        "source_labels": ["__meta_kubernetes_pod_label_encoderpool_io_pool"],
                        "regex": ".+",
                        "action": "keep",
                    },
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {
                        "source_labels": ["__meta_kubernetes_pod_label_encoderpool_io_pool"],
                        "target_label": "pool",
                    },
                    {
                        "source_labels": [
                            "__meta_kubernetes_pod_label_app_kubernetes_io_component"
                        ],
                        "target_label": "component",
                    },
                ],
            },
            {
                "job_name": "encoderpool-operator",
                "honor_labels": True,
                "kubernetes_sd_configs": [
                    {"role": "pod", "namespaces": {"names": [operator_namespace]}}
                ],
                "relabel_configs": [
                    {
                        "source_labels": ["__meta_kubernetes_namespace"],
                        "regex": operator_namespace,
                        "action": "keep",
                    },
                    {
                        "source_labels": [
                            "__meta_kubernetes_pod_label_app_kubernetes_io_name",
                            "__meta_kubernetes_pod_container_port_name",
                        ],
                        "regex": "encoderpool-operator;metrics",
                        "action": "keep",
                    },
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                ],
                "metric_relabel_configs": [
                    {"source_labels": ["__name__"], "regex": OPERATOR_METRICS, "action": "keep"}
                ],
            },
        ],
    }


SCRAPE_CONFIG = scrape_config()


def tools_dir() -> Path:
    """The folder of the built prometheus, promtool, keda and kstatus (``build.sh``: built
    once, then found by its versions' key)."""
    out = run([MONITORING_DIR / "build.sh"], timeout=3600).stdout.split()[-1]
    return Path(out)


@contextmanager
def local_prometheus(config: Mapping[str, Any], work: Path) -> Iterator[str]:
    """The test bed's Prometheus as a local process with ``config`` (its data and log in
    ``work``), on a free loopback port; yields its base URL once it is ready."""
    (work / "prometheus.yml").write_text(json.dumps(config))
    log = work / "prometheus.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                str(tools_dir() / "prometheus"),
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:  # a rule file it cannot load stops it at start
            raise AssertionError(f"Prometheus exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        deadline = time.monotonic() + 60
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Prometheus not ready in 60 s:\n{log.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def build_image(env: Mapping[str, str]) -> str:
    """The monitoring image (built, or found cached by content)."""
    out = key_values(run([MONITORING_DIR / "image.sh"], env=env, timeout=5400).stdout)
    return out["MONITORING_IMAGE"]


def test_bed_rules() -> str:
    """The chart's rule file with every ``for`` at ``TEST_BED_FOR``."""
    rules = json.loads(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = TEST_BED_FOR
    return json.dumps(rules, indent=1)


def prometheus_objects(image: str) -> list[dict[str, Any]]:
    """A single Prometheus server with read access to pods, restricted like our own pods."""
    meta = {"name": "prometheus", "namespace": PROMETHEUS_NS}
    labels = {"app.kubernetes.io/name": "prometheus"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "encoderpool-test-prometheus"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "encoderpool-test-prometheus"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "encoderpool-test-prometheus",
            },
            "subjects": [{"kind": "ServiceAccount", **meta}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {
                "prometheus.yml": json.dumps(SCRAPE_CONFIG, indent=1),
                "alerts.yml": test_bed_rules(),  # JSON is YAML
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {**meta, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": "prometheus",
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 65532,
                            "fsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": "prometheus",
                                "image": image,
                                "command": ["/bin/prometheus"],
                                "args": [
                                    "--config.file=/etc/prometheus/prometheus.yml",
                                    "--storage.tsdb.path=/data",
                                    "--storage.tsdb.retention.time=2h",
                                    f"--web.listen-address=:{PROMETHEUS_PORT}",
                                ],
                                "ports": [{"name": "http", "containerPort": PROMETHEUS_PORT}],
                                "readinessProbe": {
                                    "httpGet": {"path": "/-/ready", "port": PROMETHEUS_PORT},
                                    "periodSeconds": 2,
                                },
                                "resources": {
                                    "requests": {"cpu": "100m", "memory": "128Mi"},
                                    "limits": {"memory": "1Gi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [
                                    {"name": "config", "mountPath": "/etc/prometheus"},
                                    {"name": "data", "mountPath": "/data"},
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "config", "configMap": {"name": "prometheus"}},
                            {"name": "data", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {**meta, "labels": labels},
            "spec": {
                "selector": labels,
                "ports": [{"name": "http", "port": PROMETHEUS_PORT, "targetPort": PROMETHEUS_PORT}],
            },
        },
    ]


# What an autoscaler in the cluster names as its Prometheus.
PROMETHEUS_ADDRESS = f"http://prometheus.{PROMETHEUS_NS}.svc:{PROMETHEUS_PORT}"


def keda_module() -> Path:
    """KEDA's module tree (from the Go module cache; e2e/monitoring/build.sh fills it)."""
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod", "GOWORK": "off"}
    version = key_values((MONITORING_DIR / "versions.env").read_text())["KEDA_VERSION"]
    proc = run(
        ["go", "mod", "download", "-json", f"github.com/kedacore/keda/v2@v{version}"],
        env=env,
        timeout=900,
    )
    return Path(json.loads(proc.stdout)["Dir"])


def scaled_object_crd() -> Path:
    """KEDA's ScaledObject CRD as KEDA ships it (for a control plane without KEDA running)."""
    return keda_module() / "config" / "crd" / "bases" / "keda.sh_scaledobjects.yaml"


def keda_manifests(cluster: KindCluster, image: str) -> str:
    """KEDA's own install manifests from its module (operator, metrics API server, CRDs,
    RBAC; without its admission webhooks), with our image in place of its registry's."""
    module = keda_module()
    repo, tag = image.rsplit(":", 1)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(module / "config", Path(tmp) / "config")
        overlay = Path(tmp) / "overlay"
        overlay.mkdir()
        images = [
            {"name": name, "newName": repo, "newTag": tag}
            for name in ("ghcr.io/kedacore/keda", "ghcr.io/kedacore/keda-metrics-apiserver")
        ]
        (overlay / "kustomization.yaml").write_text(
            json.dumps({"resources": ["../config/minimal"], "images": images})
        )
        return cluster.kubectl("kustomize", str(overlay), timeout=300)


def install(cluster: KindCluster, image: str) -> None:
    """Prometheus, then KEDA; returns when both serve (KEDA: the external metrics API)."""
    cluster.namespace(PROMETHEUS_NS)
    cluster.apply(prometheus_objects(image))
    cluster.kubectl("apply", "--server-side", "-f", "-", input=keda_manifests(cluster, image))
    for ns, deploy in (
        (PROMETHEUS_NS, "prometheus"),
        (KEDA_NS, "keda-operator"),
        (KEDA_NS, "keda-metrics-apiserver"),
    ):
        cluster.kubectl(
            "-n", ns, "rollout", "status", f"deployment/{deploy}", "--timeout=600s", timeout=660
        )
    cluster.kubectl(
        "wait",
        "--for=condition=Available",
        "apiservice/v1beta1.external.metrics.k8s.io",
        "--timeout=300s",
        timeout=330,
    )


@contextmanager
def prometheus(cluster: KindCluster) -> Iterator[Prometheus]:
    """The test bed's Prometheus, through a port-forward on 127.0.0.1."""
    with cluster.port_forward(PROMETHEUS_NS, "service/prometheus", PROMETHEUS_PORT) as url:
        yield Prometheus(url)


class Prometheus:
    """The HTTP query API, nothing more."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector; raises on a query Prometheus refuses."""
        q = urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # 400/422: a query Prometheus cannot run
            raise RuntimeError(f"Prometheus refused {promql!r}: {e.read()[:500]!r}") from None
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {promql!r}: {body}")
        return list(body["data"]["result"])

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded alerting rule, with its health and state."""
        with urllib.request.urlopen(f"{self.url}/api/v1/rules?type=alert", timeout=30) as resp:
            body = json.load(resp)
        return [r for g in body["data"]["groups"] for r in g["rules"]]

    def firing(self, alert: str, namespace: str, pool: str) -> bool:
        """Whether ``alert`` fires for the pool (past its ``for``, not just pending)."""
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=30) as resp:
            body = json.load(resp)
        return any(
            a["state"] == "firing"
            and a["labels"].get("alertname") == alert
            and a["labels"].get("namespace") == namespace
            and a["labels"].get("pool") == pool
            for a in body["data"]["alerts"]
        )

    def value(self, promql: str) -> float | None:
        """The single value of a query that sums to one series, or None if it has none."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

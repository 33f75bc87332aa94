"""Pods of another tenant that try to forge a pool's autoscaling signals.

Three pods in the tenant's own namespace, each serving a Prometheus text page that
claims to be another namespace's pool: a "consumer" (``vllm:num_requests_running`` of
the victim at 1000), a "router" (the victim's producer-group counters, growing by 1000
a second: demand, and unserved items that would wake its producers) and an "operator"
(labelled like the operator's pods, exporting the same). They carry the labels and port
names the test bed's scrape configuration looks for (``monitoring.scrape_config``). The
pages are served by the operator image's Python (standard library only).
"""

from __future__ import annotations

from typing import Any

from encoderpool_contracts.signals import (
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_NAMESPACE,
    LABEL_POOL,
    VLLM_REQUESTS_RUNNING,
)

# Serves the page at every path; counters grow with time so that their rates are high.
SERVER = """
import http.server, sys, time
PAGE = sys.argv[1]
T0 = time.time()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = PAGE.replace("N", str(int(1000 * (time.time() - T0)))).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("", int(sys.argv[2])), H).serve_forever()
"""


def page(victim_ns: str, pool: str, group: str) -> str:
    """The forged series: the victim's labels, written into the page."""
    consumer = f'{LABEL_NAMESPACE}="{victim_ns}",{LABEL_POOL}="{pool}",{LABEL_COMPONENT}="consumer"'
    router = (
        f'{LABEL_NAMESPACE}="{victim_ns}",{LABEL_POOL}="{pool}",{LABEL_COMPONENT}="router",'
        f'{LABEL_GROUP}="{group}"'
    )
    return (
        f"{VLLM_REQUESTS_RUNNING}{{{consumer}}} 1000\n"
        f"{ENCODER_INFLIGHT_SECONDS}{{{router}}} N\n"
        f"{ENCODER_UNSERVED_ITEMS}{{{router}}} N\n"
    )


def pods(namespace: str, image: str, victim_ns: str, pool: str, group: str) -> list[dict[str, Any]]:
    """The forging pods: (name, labels, port name, port) of each, all with the same page."""
    shapes = [
        ("forged-consumer", {"app.kubernetes.io/name": "encoderpool",
                             "app.kubernetes.io/component": "consumer"}, "http", 8000),
        ("forged-router", {"app.kubernetes.io/name": "encoderpool",
                           "app.kubernetes.io/component": "router"}, "metrics", 9090),
        ("forged-operator", {"app.kubernetes.io/name": "encoderpool-operator"}, "metrics", 8080),
    ]  # fmt: skip
    out = []
    for name, labels, port_name, port in shapes:
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": {**labels, "encoderpool.io/pool": pool},
                },
                "spec": {
                    "containers": [
                        {
                            "name": "page",
                            "image": image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": [
                                "python",
                                "-c",
                                SERVER,
                                page(victim_ns, pool, group),
                                str(port),
                            ],
                            "ports": [{"name": port_name, "containerPort": port}],
                            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                        }
                    ]
                },
            }
        )
    return out

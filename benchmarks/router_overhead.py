"""What the router adds to a request whose embeddings are already cached.

One run, real vLLM on loopback: a producer and a consumer with our EC
connector, and two routers (processes) in front of them: one as deployed for a
shared-volume pool (``--reuse-encoded-s``: an item a producer encoded moments
ago is not sent to a producer again) and one that sends every item to a
producer. Every image is first sent through both routers once (so its
embedding sits in the shared volume and in the consumer's caches); then each
request is sent, in rotating order, straight to the consumer and through each
router, on kept-alive connections. Overhead = routed minus direct latency of
the same request in the same round.

    python benchmarks/router_overhead.py [--images 10] [--rounds 20]

Last line (the deployed shared-volume configuration):
``RESULT router_overhead_ms_p50=<ms> p99=<ms>``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchmarks.stats import percentile
from e2e.media import chat_request, image, token_ids
from e2e.tiny_model import ensure_tiny_model
from e2e.vllm_server import VllmServer, base_env, ec_transfer_config, running
from tests.router.fixtures import CONNECTORS, EC_CONNECTOR, RouterProcess


class Client:
    """One kept-alive HTTP connection, so connection set-up is not measured."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        assert u.hostname == "127.0.0.1", "loopback only"
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)

    def chat(self, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        data = json.dumps(body).encode()
        start = time.perf_counter()
        self.conn.request(
            "POST", "/v1/chat/completions", data, {"Content-Type": "application/json"}
        )
        resp = self.conn.getresponse()
        raw = resp.read()
        elapsed = time.perf_counter() - start
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {raw[:500]!r}")
        return elapsed, json.loads(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=10, help="distinct requests (one image each)")
    ap.add_argument("--rounds", type=int, default=20, help="times each request is measured")
    ap.add_argument("--connector", choices=sorted(CONNECTORS), default=EC_CONNECTOR)
    args = ap.parse_args()

    model = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    store = work / "ec"
    store.mkdir()
    name, extra, module = CONNECTORS[args.connector](store, model)

    def server(role: str, cpu: str) -> VllmServer:
        ec = ec_transfer_config(name, role, extra, module)
        return VllmServer(
            name=role,
            model=model,
            log_path=work / f"{role}.log",
            args=["--ec-transfer-config", ec],
            env=base_env(cpu),
        )

    producer, consumer = server("ec_producer", "1"), server("ec_consumer", "0")
    backends = ["--producers", producer.url, "--consumers", consumer.url, "--log-level", "WARNING"]
    modes = {"reuse": ["--reuse-encoded-s", "600"], "every-item": []}
    with running(producer, consumer):
        routers = {
            mode: RouterProcess([*backends, *flags], work / f"router-{mode}.log")
            for mode, flags in modes.items()
        }
        try:
            for r in routers.values():
                r.start()
            bodies = [chat_request(image(1000 + i)) for i in range(args.images)]
            clients = {"direct": Client(consumer.url)}
            clients.update({mode: Client(r.url) for mode, r in routers.items()})
            order = list(clients)
            for body in bodies:  # warm: encode once, so every later request finds it cached
                for c in clients.values():
                    c.chat(body)
            times: dict[str, list[float]] = {name: [] for name in clients}
            for rnd in range(args.rounds):
                for i, body in enumerate(bodies):
                    # Rotate who goes first, so no path always meets a warmer system.
                    k = (rnd + i) % len(order)
                    answers = {}
                    for name in order[k:] + order[:k]:
                        elapsed, answers[name] = clients[name].chat(body)
                        times[name].append(elapsed * 1e3)
                    ids = {name: tuple(token_ids(a)) for name, a in answers.items()}
                    assert len(set(ids.values())) == 1, f"a router changed the answer: {ids}"
            producer_ms = {
                mode: r.metric("encoderpool_router_producer_latency_seconds_sum")
                / max(1.0, r.metric("encoderpool_router_producer_latency_seconds_count"))
                * 1e3
                for mode, r in routers.items()
            }
        finally:
            for r in routers.values():
                r.stop()

    n = len(times["direct"])
    print(
        f"connector={args.connector} requests={n} per path "
        f"(images={args.images} rounds={args.rounds})"
    )
    overhead = {
        mode: [t - d for t, d in zip(times[mode], times["direct"], strict=True)] for mode in modes
    }
    rows = [(name, xs) for name, xs in times.items()]
    rows += [(f"overhead {mode}", xs) for mode, xs in overhead.items()]
    for label, xs in rows:
        print(
            f"{label:>20} ms: p50={percentile(xs, 50):7.2f} p90={percentile(xs, 90):7.2f} "
            f"p99={percentile(xs, 99):7.2f} mean={statistics.fmean(xs):7.2f}"
        )
    for mode, ms in producer_ms.items():
        print(f"{mode:>20}: mean producer round trip seen by the router {ms:.2f} ms")
    ev = overhead["every-item"]
    print(
        f"RESULT_EVERY_ITEM router_overhead_ms_p50={percentile(ev, 50):.2f} "
        f"p99={percentile(ev, 99):.2f}"
    )
    ov = overhead["reuse"]
    print(f"RESULT router_overhead_ms_p50={percentile(ov, 50):.2f} p99={percentile(ov, 99):.2f}")


if __name__ == "__main__":
    main()

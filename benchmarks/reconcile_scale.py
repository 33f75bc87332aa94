"""How the operator scales: N pools on the local control plane, widths pre-seeded.

    python -m benchmarks.reconcile_scale --pools 100 --pools 500 [--pools 1000]

For each N, in one run: a fresh control plane (etcd, kube-apiserver,
controller-manager with the client limits of a large production cluster,
scheduler, kwok with enough fake nodes), the CRD, one width report shared by all
pools (same model), the operator as a local process, then N EncoderPools applied
at once. From the API server's audit log (the operator's own user only) and the
operator's metrics it reports:

- converge_s: from the apply until every pool is Ready (operator + cluster);
- operator_s: until the operator had written every child of every pool and each
  pool's first status (its own work; the rest is the controllers and kwok);
- writes_per_pool during creation (children, status, Events, the shared report)
  against children_per_pool (objects a pool owns: its children, its internal
  Secret and its share of the report ConfigMap);
- noop_writes: writes during a full resync of every pool once all is quiet;
- rss_mb: the operator's peak resident memory; and a profile: passes, API
  requests per pass, seconds per pass, and the CPU seconds of the operator and of
  each control-plane process while the pools converged (the machine's two cores
  run them all).

Last line per N: ``RESULT pools=<N> converge_s=<s> operator_s=<s> writes_per_pool=<n>
children_per_pool=<n> noop_writes=<n> rss_mb=<m>``.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.stats import cpu_seconds
from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from e2e.processes import exit_on_sigterm
from encoderpool_operator import render
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kube import Kube
from tests.operator.fixtures import sample_pool, seed_report

NAMESPACE = "scale"
RESYNC_SECONDS = 30
# What a large production control plane gives its controllers (the defaults, 20 qps
# and 5 workers per controller, would make this a benchmark of the controller-manager).
CONTROLLER_MANAGER_ARGS = (
    "--kube-api-qps=500",
    "--kube-api-burst=1000",
    "--concurrent-deployment-syncs=50",
    "--concurrent-replicaset-syncs=50",
)


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the most resident memory the process ever had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metrics(url: str) -> dict[str, float]:
    """Prometheus text, summed per metric name and label set (as the raw key)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
    return out


def total(m: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in m.items() if re.match(rf"{name}(\{{|$)", k) and label in k)


def ready_count(cluster: LocalCluster) -> int:
    pools = json.loads(cluster.kubectl("get", "epool", "-n", NAMESPACE, "-o", "json"))["items"]
    return sum(
        1
        for p in pools
        for c in p.get("status", {}).get("conditions", [])
        if c["type"] == "Ready" and c["status"] == "True"
    )


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(
        event["requestReceivedTimestamp"].replace("Z", "+00:00")
    ).timestamp()


def category(event: dict[str, Any]) -> str:
    ref = event["objectRef"]
    if ref.get("resource") == "events":
        return "events"
    if ref.get("resource") == "encoderpools":
        return "status" if ref.get("subresource") == "status" else "pool"
    if ref.get("resource") == "configmaps":
        return "report"
    return "children"


def create_all(cluster: LocalCluster, pools: list[dict[str, Any]]) -> None:
    """Create every pool at once, 16 requests in flight (as a GitOps sync would): a
    serial ``kubectl apply`` of 1,000 objects outlasts its own timeout on a busy box."""
    from kubernetes import config

    admin = Kube(config.new_client_from_config(config_file=str(cluster.kubeconfig)))
    with ThreadPoolExecutor(16) as pool:
        for _ in pool.map(
            lambda p: admin.create({**p, "metadata": {**p["metadata"], "namespace": NAMESPACE}}),
            pools,
        ):
            pass


def wait_quiet(cluster: LocalCluster, seconds: float = 5.0) -> None:
    """Until the operator wrote nothing for ``seconds``."""
    count = len(cluster.audit_events(namespace=NAMESPACE))
    while True:
        time.sleep(seconds)
        now = len(cluster.audit_events(namespace=NAMESPACE))
        if now == count:
            return
        count = now


def run(n: int, work: Path) -> dict[str, Any]:
    nodes = n * 3 // 100 + 2  # kwok nodes take 110 pods each; a pool has 3 pods
    cluster = LocalCluster(
        work / f"cluster-{n}", nodes=nodes, controller_manager_args=CONTROLLER_MANAGER_ARGS
    )
    with cluster:
        crd = Path(__file__).resolve().parent.parent / "crds" / "encoderpool.io_encoderpools.yaml"
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
        cluster.wait_established("encoderpools.encoderpool.io")
        cluster.kubectl("create", "namespace", NAMESPACE)
        seed_report(cluster, NAMESPACE, sample_pool())
        op = OperatorProcess(
            cluster.operator_kubeconfig,
            work / f"operator-{n}.log",
            NAMESPACE,
            env={"ENCODERPOOL_RESYNC_SECONDS": str(RESYNC_SECONDS)},
        ).start()
        try:
            time.sleep(5)
            pools = [sample_pool(name=f"pool-{i:04d}") for i in range(n)]
            one = {**pools[0], "metadata": {**pools[0]["metadata"], "uid": "u", "namespace": "n"}}
            # Its children, its internal Secret, its share of the report ConfigMap.
            children = len(render.child_refs(EncoderPool.from_object(one))) + 2
            before = len(cluster.audit_events(namespace=NAMESPACE))
            procs = {name: p.pid for name, p in cluster.procs.items()}
            assert op.proc is not None
            procs["operator"] = op.proc.pid
            cpu_before = {name: cpu_seconds(pid) for name, pid in procs.items()}
            started = time.time()
            create_all(cluster, pools)
            while (ready := ready_count(cluster)) < n:
                if time.time() - started > 3600:
                    raise TimeoutError(f"only {ready}/{n} pools Ready after an hour")
                time.sleep(1)
            converge = time.time() - started
            # Where the machine's cores went while the pools converged.
            cpu = {
                name: round(cpu_seconds(pid) - cpu_before[name], 1) for name, pid in procs.items()
            }
            print(f"  {n} pools Ready in {converge:.1f}s", flush=True)
            wait_quiet(cluster)
            created = cluster.audit_events(namespace=NAMESPACE)[before:]
            first: dict[tuple[str, str, str], float] = {}
            for e in created:
                if category(e) in ("children", "status"):
                    ref = e["objectRef"]
                    key = (ref["resource"], ref.get("subresource", ""), ref["name"])
                    first.setdefault(key, stamp(e))
            operator_s = max(first.values()) - started
            by_category = Counter(category(e) for e in created)
            m = metrics(op.metrics_url)
            passes = total(m, "encoderpool_operator_reconciles_total")
            reads = total(m, "encoderpool_operator_api_reads")
            writes = total(m, "encoderpool_operator_api_writes")
            pass_s = total(m, "encoderpool_operator_reconcile_seconds_sum")
            # A full resync with nothing changed: every pool passed once more.
            quiet = len(cluster.audit_events(namespace=NAMESPACE))
            resynced = total(m, "encoderpool_operator_reconciles_total", 'trigger="resync"')
            while (
                total(
                    metrics(op.metrics_url),
                    "encoderpool_operator_reconciles_total",
                    'trigger="resync"',
                )
                < resynced + n
            ):
                time.sleep(1)
            time.sleep(2)
            noop_events = cluster.audit_events(namespace=NAMESPACE)[quiet:]
            rss = peak_rss_mb(op.proc.pid)
        finally:
            op.stop()
    return {
        "pools": n,
        "converge_s": round(converge, 1),
        "operator_s": round(operator_s, 1),
        "writes_per_pool": round(sum(by_category.values()) / n, 2),
        "children_per_pool": children,
        "noop_writes": len(noop_events),
        "rss_mb": round(rss),
        "writes_by_kind_per_pool": {k: round(v / n, 2) for k, v in sorted(by_category.items())},
        "noop_detail": Counter(
            f"{e['verb']} {e['objectRef'].get('resource')}" for e in noop_events
        ).most_common(5),
        "passes_per_pool": round(passes / n, 2),
        "reads_per_pass": round(reads / passes, 2) if passes else 0,
        "writes_per_pass": round(writes / passes, 2) if passes else 0,
        "ms_per_pass": round(1000 * pass_s / passes, 1) if passes else 0,
        "cpu_s_while_converging": cpu,
        "cores_busy": round(sum(cpu.values()) / converge, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pools", type=int, action="append", help="N (repeatable)")
    sizes = parser.parse_args().pools or [100]
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="encoderpool-scale-") as tmp:
        for n in sizes:
            r = run(n, Path(tmp))
            print("  " + json.dumps(r), flush=True)
            print(
                f"RESULT pools={r['pools']} converge_s={r['converge_s']} "
                f"operator_s={r['operator_s']} writes_per_pool={r['writes_per_pool']} "
                f"children_per_pool={r['children_per_pool']} noop_writes={r['noop_writes']} "
                f"rss_mb={r['rss_mb']}",
                flush=True,
            )


if __name__ == "__main__":
    main()

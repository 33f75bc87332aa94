"""How the operator scales: N pools on the local control plane, widths pre-seeded.

    python -m benchmarks.reconcile_scale --pools 100 [--pools 500]

For each N, in one run: a fresh control plane (etcd, kube-apiserver,
controller-manager, scheduler, kwok with enough fake nodes), the CRD, one
width report shared by all pools (same model, same fingerprint), the operator
as a local process, then N EncoderPools applied at once. It reports the time
until every pool is Ready, the writes the operator makes during one full
resync pass over all pools with nothing changed (from the API server's audit
log), and the operator's peak RSS. Last line per N:
``RESULT pools=<N> converge_s=<s> noop_writes=<n> rss_mb=<m>``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from e2e.processes import exit_on_sigterm
from tests.operator.fixtures import report_for, sample_pool

NAMESPACE = "scale"
RESYNC_SECONDS = 20


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the most resident memory the process ever had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ready_count(cluster: LocalCluster) -> int:
    pools = json.loads(cluster.kubectl("get", "epool", "-n", NAMESPACE, "-o", "json"))["items"]
    return sum(
        1
        for p in pools
        for c in p.get("status", {}).get("conditions", [])
        if c["type"] == "Ready" and c["status"] == "True"
    )


def run(n: int, work: Path) -> dict[str, Any]:
    nodes = n * 3 // 100 + 2  # kwok nodes take 110 pods each; a pool has 3 pods
    with LocalCluster(work / f"cluster-{n}", nodes=nodes) as cluster:
        crd = Path(__file__).resolve().parent.parent / "crds" / "encoderpool.io_encoderpools.yaml"
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
        cluster.kubectl("wait", "--for=condition=Established", "crd/encoderpools.encoderpool.io")
        cluster.kubectl("create", "namespace", NAMESPACE)
        report = report_for(sample_pool())
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": report.configmap_name, "namespace": NAMESPACE},
            "data": report.to_configmap_data(),
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(cm))
        op = OperatorProcess(
            cluster.operator_kubeconfig,
            work / f"operator-{n}.log",
            NAMESPACE,
            env={"ENCODERPOOL_RESYNC_SECONDS": str(RESYNC_SECONDS)},
        ).start()
        try:
            time.sleep(3)
            pools = [sample_pool(name=f"pool-{i:04d}") for i in range(n)]
            started = time.monotonic()
            items = {"apiVersion": "v1", "kind": "List", "items": pools}
            cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(items))
            while (ready := ready_count(cluster)) < n:
                if time.monotonic() - started > 3600:
                    raise TimeoutError(f"only {ready}/{n} pools Ready after an hour")
                time.sleep(2)
            converge = time.monotonic() - started
            print(f"  {n} pools Ready in {converge:.1f}s", flush=True)
            # Settle (the last child events), then count writes over a full resync.
            time.sleep(5)
            before = len(cluster.audit_events(namespace=NAMESPACE))
            time.sleep(RESYNC_SECONDS * 1.5)
            noop = len(cluster.audit_events(namespace=NAMESPACE)) - before
            assert op.proc is not None
            rss = peak_rss_mb(op.proc.pid)
        finally:
            op.stop()
    return {"pools": n, "converge_s": round(converge, 1), "noop_writes": noop, "rss_mb": round(rss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pools", type=int, action="append", help="N (repeatable)")
    sizes = parser.parse_args().pools or [100]
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="encoderpool-scale-") as tmp:
        for n in sizes:
            r = run(n, Path(tmp))
            print(
                f"RESULT pools={r['pools']} converge_s={r['converge_s']} "
                f"noop_writes={r['noop_writes']} rss_mb={r['rss_mb']}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""``make demo``: an EncoderPool, end to end, on this machine.

A real control plane (etcd, kube-apiserver, controller-manager, scheduler,
kwok) on 127.0.0.1, the operator, the sample EncoderPool pointed at a tiny
Qwen2-VL built here, and one chat request with an image answered through the
pool's router. kwok's pods run nothing, so wherever a pod would do work this
demo runs that pod's own command (as the operator rendered it) as a local
process: the width Job's measurement, then a producer, a consumer and the
router. Everything started is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import LocalCluster
from e2e.cluster.kubelet import LocalPod, run_pods
from e2e.media import chat_request, image, token_ids
from e2e.operator_process import OperatorProcess
from e2e.processes import exit_on_sigterm
from e2e.tiny_model import ensure_tiny_model
from e2e.vllm_server import base_env, free_port, post_json
from encoderpool_contracts.router_args import PROBE_PORT_ENV

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "demo"
POOL = "demo"
T0 = time.monotonic()


def say(step: str, text: str = "") -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {step}{(': ' + text) if text else ''}", flush=True)


@contextmanager
def stage(step: str) -> Iterator[None]:
    start = time.monotonic()
    say(step, "...")
    yield
    say(step, f"done in {time.monotonic() - start:.1f}s")


def pool_manifest(model: Path, transport: str) -> dict[str, Any]:
    """The sample pool, serving the local model, over the chosen transport."""
    pool = yaml.safe_load((REPO / "examples" / "pool-shared-volume.yaml").read_text())
    pool["metadata"] = {"name": POOL, "namespace": NAMESPACE}
    # The pods' model path: here, the local build (the pods run here, not from the claim).
    pool["spec"]["model"].pop("source", None)
    pool["spec"]["model"]["name"] = str(model)
    if transport == "rdma":
        # NIXL over UCX on TCP and shared memory: what these machines have instead of a NIC.
        pool["spec"]["connector"] = {
            "rdma": {
                "ucxTransports": "tcp,self,sm",
                "sideChannelPort": free_port(),
                "bufferSize": "256Mi",
            }
        }
    return dict(pool)


def wait_ready(cluster: LocalCluster, timeout: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool = json.loads(cluster.kubectl("get", "epool", POOL, "-n", NAMESPACE, "-o", "json"))
        conds = {c["type"]: c for c in pool.get("status", {}).get("conditions", [])}
        if conds.get("Ready", {}).get("status") == "True":
            return dict(pool)
        time.sleep(1)
    raise TimeoutError(f"EncoderPool {POOL} not Ready in {timeout:.0f}s: {conds}")


def first_pod(cluster: LocalCluster, component: str) -> dict[str, Any]:
    pods = json.loads(
        cluster.kubectl(
            "get",
            "pods",
            "-n",
            NAMESPACE,
            "-o",
            "json",
            "-l",
            f"app.kubernetes.io/instance={POOL},app.kubernetes.io/component={component}",
        )
    )["items"]
    assert pods, f"no {component} pod"
    return dict(pods[0])


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus metric's samples (optionally those whose labels contain ``labels``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__)
    parser.add_argument("--transport", choices=["sharedVolume", "rdma"], default="sharedVolume")
    transport = parser.parse_args(argv).transport
    exit_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="encoderpool-demo-"))
    say("encoderpool demo", f"transport {transport}; logs and state in {work}")
    with ExitStack() as stack:
        with stage("1/6 tiny Qwen2-VL (random weights, built locally, cached)"):
            model = ensure_tiny_model()
        with stage(
            "2/6 control plane on 127.0.0.1 (etcd, apiserver, controllers, scheduler, kwok)"
        ):
            cluster = stack.enter_context(LocalCluster(work / "cluster"))
        with stage("3/6 CRD and operator"):
            crd = REPO / "crds" / "encoderpool.io_encoderpools.yaml"
            cluster.kubectl("apply", "--server-side", "-f", str(crd))
            cluster.wait_established("encoderpools.encoderpool.io")
            cluster.kubectl("create", "namespace", NAMESPACE)
            op = OperatorProcess(cluster.operator_kubeconfig, work / "operator.log", NAMESPACE)
            stack.callback(op.stop)
            op.start()
        with stage("4/6 kubectl apply EncoderPool demo; its width Job measures the model"):
            cluster.kubectl("apply", "-f", "-", input=json.dumps(pool_manifest(model, transport)))
            (run,) = run_pods(
                cluster, NAMESPACE, "app.kubernetes.io/component=width-job", work, timeout=600,
                extra_env={"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"},
            )  # fmt: skip
            if run.returncode != 0:
                print(run.output[-4000:], file=sys.stderr)
                raise SystemExit(f"the width Job's command failed ({run.returncode})")
            pool = wait_ready(cluster)
        print(cluster.kubectl("get", "epool", "-n", NAMESPACE))
        st = pool["status"]
        say("  measured", f"encoder output widths {st['encoderOutputWidths']}, "
            f"{st['bytesPerToken']} bytes/token, report {st['widthReportName']}")  # fmt: skip
        print(cluster.kubectl("get", "deploy,svc,pvc,job", "-n", NAMESPACE))

        with stage("5/6 serve: the producer, consumer and router pods' commands, run here"):
            cache = work / "ec-cache"
            cache.mkdir()
            rewrite = {"0.0.0.0": "127.0.0.1"}  # noqa: S104
            if shared := pool["spec"]["connector"].get("sharedVolume"):
                rewrite[shared["mountPath"]] = str(cache)
            pods = {}
            for cpu, component in enumerate(("producer", "consumer")):
                pods[component] = LocalPod(
                    first_pod(cluster, component), work / f"{component}.log", free_port(),
                    rewrite, base_env(str(cpu)), cluster=cluster,  # the pool's key: a Secret
                ).start()  # fmt: skip
                stack.callback(pods[component].stop)
            for p in pods.values():
                p.wait_healthy()
            router_metrics = f"http://127.0.0.1:{free_port()}"
            router = LocalPod(
                first_pod(cluster, "router"), work / "router.log", free_port(), rewrite,
                {**base_env(), PROBE_PORT_ENV: str(free_port())},
                replace_flags={
                    "--producer-service": ["--producers", pods["producer"].url],
                    "--consumer-service": ["--consumers", pods["consumer"].url],
                    "--namespace": [],
                    "--metrics-port": ["--metrics-port", router_metrics.rsplit(":", 1)[1]],
                },
                cluster=cluster,
            ).start()  # fmt: skip
            stack.callback(router.stop)
            router.wait_healthy()
            say("  router", f"{router.url} (in the cluster: {st['routerEndpoint']})")

        with stage("6/6 one chat request with an image, through the router"):
            answer = post_json(router.url + "/v1/chat/completions", chat_request(image(7)))
        say("  answer", f"{answer['choices'][0]['message']['content']!r} (random weights: noise)")
        say("  token ids", str(token_ids(answer)))
        remote = metric(router_metrics, "encoderpool_router_media_items_total", 'encoded="remote"')
        hits = metric(pods["consumer"].url, "encoderpool_ec_hits_total")
        say("  router", f"{remote:.0f} image encoded by the producer")
        source = "read over NIXL/UCX" if transport == "rdma" else "loaded from the shared volume"
        say("  consumer", f"{hits:.0f} embedding {source} (its encoder idle)")
        ok = remote >= 1 and hits >= 1
    if ok:
        shutil.rmtree(work, ignore_errors=True)  # on failure the logs stay for reading
    say("demo", "OK: the pool answered through the router, with the encoder disaggregated"
        if ok else "FAILED: the embedding did not go producer -> consumer")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

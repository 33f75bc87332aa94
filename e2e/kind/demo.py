"""``make demo``: the pool as users run it, on kind, step by step with timings.

Our own Docker engine (egress guard first), the images built offline, a kind
cluster, ``helm install`` of the chart, the sample EncoderPool (model from a
PersistentVolumeClaim), ``kubectl wait --for=condition=Ready``, and one chat
request with an image answered through the router (a port-forward on
127.0.0.1). Where no Docker engine can run, it says why and runs the local demo
(``make demo-local``: pods as local processes) instead. The cluster is deleted at
the end unless ``--keep``; the engine is stopped if the demo started it.
"""

from __future__ import annotations

import argparse
import os
import sys

from e2e.cluster.runner import bin_dir
from e2e.demo import say, stage
from e2e.kind.cluster import Engine, Images, KindCluster
from e2e.kind.pool import (
    cache_volume,
    chat,
    encoded,
    example,
    for_kind,
    model_volume,
    rdma,
    wait_ready,
)
from e2e.media import chat_request, image
from e2e.processes import exit_on_sigterm
from e2e.tiny_model import ensure_tiny_model

NAMESPACE = "demo"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["sharedVolume", "rdma"], default="sharedVolume")
    parser.add_argument("--keep", action="store_true", help="leave the kind cluster running")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    try:
        engine = Engine.ensure()
    except RuntimeError as e:
        say("no Docker engine here", f"{e}".splitlines()[0])
        say("falling back to the local demo (make demo-local)")
        from e2e import demo

        return demo.main(["--transport", args.transport])
    kind: KindCluster | None = None
    try:
        with stage("1/7 images: operator+router, vLLM+connector (offline, cached by content)"):
            images = Images.build({**os.environ, "DOCKER_HOST": engine.host})
            say("  images", f"{images.operator}, {images.vllm}")
        with stage("2/7 kind cluster (node image assembled offline, cached)"):
            kind = KindCluster.up("encoderpool-demo", engine, bin_dir())
            say("  kubeconfig", str(kind.kubeconfig))
        with stage("3/7 docker push to the cluster's registry (only new layers move)"):
            images = kind.push_images(images)
            say("  pods pull", f"{images.operator}, {images.vllm}")
        with stage("4/7 helm install charts/encoderpool-operator"):
            kind.install_operator(images)
        with stage("5/7 the model on a PersistentVolumeClaim, the sample EncoderPool"):
            kind.namespace(NAMESPACE)
            model_volume(kind, NAMESPACE, ensure_tiny_model())
            pool = for_kind(example("pool-shared-volume.yaml"), images.vllm)
            if args.transport == "rdma":
                pool = rdma(pool)
            else:
                cache_volume(kind, NAMESPACE)
            pool["metadata"] = {"name": "tiny", "namespace": NAMESPACE}
            kind.apply(pool)
        with stage("6/7 kubectl wait --for=condition=Ready epool/tiny (width Job, then pods)"):
            wait_ready(kind, NAMESPACE, "tiny")
        with stage("7/7 one chat request with an image, through the router"):
            with kind.port_forward(
                NAMESPACE, "service/tiny", pool["spec"]["router"]["port"]
            ) as url:
                answer = chat(url, chat_request(image(0), max_tokens=8))
            say("  answer", repr(answer["choices"][0]["message"]["content"]))
            producer = encoded(kind, NAMESPACE, "tiny", "producer")
            consumer = encoded(kind, NAMESPACE, "tiny", "consumer")
            say("  encoders", f"producer ran {producer}, consumer ran {consumer}")
        ok = producer >= 1 and consumer == 0
        say("demo", "OK: answered through the pool, encoder disaggregated" if ok else "FAILED")
        return 0 if ok else 1
    except Exception:
        if kind is not None:
            print(kind.diagnose([NAMESPACE, "encoderpool-system"]), file=sys.stderr)
        raise
    finally:
        if kind is not None and args.keep:
            say("kept", f"KUBECONFIG={kind.kubeconfig}; delete with e2e/kind/down.sh {kind.name}")
        else:
            if kind is not None:
                kind.down()
            engine.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

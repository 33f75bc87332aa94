"""``make demo``: the pool as users run it, on kind, step by step with timings.

Our own Docker engine (egress guard first), the images built offline, a kind
cluster, ``helm install`` of the chart, the sample EncoderPool (model from a
PersistentVolumeClaim), ``kubectl wait --for=condition=Ready``, one chat request
with an image answered through the router (a port-forward on 127.0.0.1), which pod
encoded it and which loaded its embedding, and the same request to a monolithic vLLM
pod: the demo states whether the token ids are equal. Where no Docker engine can run,
it says why and runs the local demo (``make demo-local``: pods as local processes)
instead. The cluster is deleted at
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
    chat,
    consumer_loads,
    encoded,
    monolithic_token_ids,
    sample_pool,
    wait_ready,
)
from e2e.media import chat_request, image, token_ids
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
        with stage("1/8 images: operator+router, vLLM+connector (offline, cached by content)"):
            images = Images.build({**os.environ, "DOCKER_HOST": engine.host})
            say("  images", f"{images.operator}, {images.vllm}")
        with stage("2/8 kind cluster (node image assembled offline, cached)"):
            kind = KindCluster.up("encoderpool-demo", engine, bin_dir())
            say("  kubeconfig", str(kind.kubeconfig))
        with stage("3/8 docker push to the cluster's registry (only new layers move)"):
            images = kind.push_images(images)
            say("  pods pull", f"{images.operator}, {images.vllm}")
        with stage("4/8 helm install charts/encoderpool-operator"):
            kind.install_operator(images)
        with stage("5/8 the model on a PersistentVolumeClaim, the sample EncoderPool"):
            pool = sample_pool(
                kind, NAMESPACE, "tiny", ensure_tiny_model(), images.vllm, transport=args.transport
            )
            kind.apply(pool)
        with stage("6/8 kubectl wait --for=condition=Ready epool/tiny (width Job, then pods)"):
            wait_ready(kind, NAMESPACE, "tiny")
        body = chat_request(image(0), max_tokens=8)
        with stage("7/8 one chat request with an image, through the router"):
            with kind.port_forward(
                NAMESPACE, "service/tiny", pool["spec"]["router"]["port"]
            ) as url:
                answer = chat(url, body)
            got = token_ids(answer)
            text = answer["choices"][0]["message"]["content"]
            say("  answer", f"{text!r} (the test model has random weights: the text is noise)")
            producer = encoded(kind, NAMESPACE, "tiny", "producer")
            consumer = encoded(kind, NAMESPACE, "tiny", "consumer")
            loads = consumer_loads(kind, NAMESPACE, "tiny")
            say("  producer", f"tiny-producer ran its encoder for {producer} image(s)")
            say(
                "  consumer",
                f"tiny-consumer loaded {loads:.0f} embedding(s) "
                f"({args.transport}), ran its encoder {consumer} time(s)",
            )
        with stage("8/8 the same request to a monolithic vLLM pod (same image, model, flags)"):
            (expected,) = monolithic_token_ids(kind, NAMESPACE, pool, [body])
            same = got == expected
            say(
                "  token ids",
                f"pool {got} {'==' if same else '!='} monolithic {expected}",
            )
        ok = same and producer >= 1 and consumer == 0
        say(
            "demo",
            "OK: the pool's answer equals a monolithic server's, and the consumer encoded nothing"
            if ok
            else "FAILED: see the lines above",
        )
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

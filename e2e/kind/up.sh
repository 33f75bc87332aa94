#!/usr/bin/env bash
# The whole system on a kind cluster (a machine with docker, kind, kubectl, helm and
# python3): build and load the images, helm install the operator, apply the sample
# pool (tiny random Qwen2-VL on CPUs), wait for Ready, send one image request.
#   e2e/kind/up.sh      then   e2e/kind/down.sh
# Env: KIND_CLUSTER (encoderpool), VLLM_BASE (vLLM 0.32.0 CPU release image).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
cluster=${KIND_CLUSTER:-encoderpool}
vllm_base=${VLLM_BASE:-public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0}
operator_image=ghcr.io/encoderpool/encoderpool-operator:0.1.0
pool_image=localhost/encoderpool/vllm-cpu:0.32.0  # what examples/pool-shared-volume.yaml runs
ns=demo
step() { echo "=== $*" >&2; }

step "kind cluster $cluster"
kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster" --config e2e/kind/cluster.yaml
kubectl config use-context "kind-$cluster" >/dev/null

step "images"
docker build -f docker/operator.Dockerfile -t "$operator_image" .
docker build -f docker/vllm.Dockerfile --build-arg VLLM_BASE="$vllm_base" -t encoderpool/vllm-cpu-connector:0.32.0 .
docker build -f e2e/kind/model.Dockerfile -t "$pool_image" .
kind load docker-image --name "$cluster" "$operator_image" "$pool_image"

step "helm install"
helm upgrade --install encoderpool charts/encoderpool-operator \
  --namespace encoderpool-system --create-namespace --wait --timeout 5m

step "shared volume: kind's storage class is ReadWriteOnce; one node's hostPath can be ReadWriteMany"
kubectl apply -f - <<'YAML'
apiVersion: v1
kind: PersistentVolume
metadata: {name: encoderpool-demo-cache}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteMany]
  storageClassName: encoderpool-kind-rwx
  hostPath: {path: /var/cache/encoderpool-demo, type: DirectoryOrCreate}
YAML

step "sample pool"
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
kubectl create --dry-run=client -o json -f examples/pool-shared-volume.yaml \
  | python3 -c 'import json, sys
pool = json.load(sys.stdin)
pool["spec"]["connector"]["sharedVolume"]["storageClassName"] = "encoderpool-kind-rwx"
json.dump(pool, sys.stdout)' \
  | kubectl apply -n "$ns" -f -
kubectl wait -n "$ns" --for=condition=Ready encoderpool/tiny --timeout=30m
kubectl get -n "$ns" encoderpool/tiny

step "one request through the router"
kubectl port-forward -n "$ns" service/tiny 18000:8000 >/dev/null &
forward=$!
trap 'kill $forward' EXIT
sleep 3
python3 - <<'PY'
import base64, json, struct, urllib.request, zlib

def png(w=112, h=112):  # a gradient, stdlib only
    rows = b"".join(b"\0" + bytes(v for x in range(w) for v in (2 * x % 256, 2 * y % 256, 128)) for y in range(h))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))

url = "data:image/png;base64," + base64.b64encode(png()).decode()
body = {"model": "tiny-qwen2vl", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in the image?"}]}]}
req = urllib.request.Request("http://127.0.0.1:18000/v1/chat/completions",
                             json.dumps(body).encode(), {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=300) as resp:
    answer = json.load(resp)
print("answer:", repr(answer["choices"][0]["message"]["content"]), answer["usage"])
PY
step "done: kubectl get -n $ns encoderpool,pods   |   e2e/kind/down.sh"

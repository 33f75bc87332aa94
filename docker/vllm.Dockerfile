# syntax=docker/dockerfile:1
# vLLM with the encoderpool EC connector (and the width Job's entrypoint) installed:
# the image an EncoderPool's spec.image names.
#   docker build -f docker/vllm.Dockerfile -t registry.example.com/encoderpool/vllm:0.32.0 .
# The connector loads out of tree through --ec-transfer-config's ec_connector_module_path,
# so vLLM itself is unchanged. VLLM_BASE must be a vLLM 0.32.0 image: the official CUDA one
# (default), or vLLM's CPU release image for CPU-only clusters (e2e/kind/up.sh).
# Pin it by digest in your registry.
ARG VLLM_BASE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_BASE}
COPY pyproject.toml README.md /tmp/encoderpool/
COPY operator/ /tmp/encoderpool/operator/
COPY connector/ /tmp/encoderpool/connector/
# Only the connector extra: vLLM already brings torch and pydantic; no kopf, no Kubernetes
# client. uv is how vLLM's images install packages (vLLM's docs/deployment/docker.md).
# The width Job runs `python -m encoderpool_connector.measure`: make sure `python` exists.
RUN uv pip install --system --no-cache "/tmp/encoderpool[connector]" \
 && rm -rf /tmp/encoderpool \
 && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; } \
 && mkdir -p /home/vllm && chown 1000:1000 /home/vllm
# The operator's pods run as 1000:1000 with HOME on an emptyDir; so does a plain `docker run`.
ENV HOME=/home/vllm
USER 1000:1000

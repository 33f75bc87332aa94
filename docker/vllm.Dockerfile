# vLLM with the encoderpool EC connector (shared volume and rdma) and the width Job's
# entrypoint installed: the image an EncoderPool's spec.image names. vLLM itself is
# unchanged: the connector loads out of tree through --ec-transfer-config's
# ec_connector_module_path. VLLM_BASE must be a vLLM image of a supported release
# (docs/connector.md): the official CUDA one (default), vLLM's CPU release image for
# CPU-only clusters, vllm-cpu.Dockerfile's image where no registry is reachable, or the
# GPU base docker/build.sh --gpu makes from PyPI's wheels (vLLM 0.34; it then replaces
# requirements/constraints.txt with that lock's pins). Pin it by digest.
ARG VLLM_BASE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_BASE}
# vLLM's model-class answers, computed once here instead of in a subprocess at every pod
# start (~10 s of CPU each; encoderpool_connector/programs/vllm_cache.py says why). vLLM
# writes its other caches there too, so the pods' user owns it. First, as a plain script:
# this layer depends on vLLM alone, so a change to our sources does not redo it.
ENV VLLM_CACHE_ROOT=/var/cache/vllm
COPY connector/encoderpool_connector/programs/vllm_cache.py /tmp/vllm_cache.py
RUN mkdir -p /var/cache/vllm \
 && python3 /tmp/vllm_cache.py \
 && chown -R 1000:1000 /var/cache/vllm \
 && rm /tmp/vllm_cache.py
# --no-index --find-links /wheels when offline (the wheelhouse then holds only the build
# backend: the base brings torch, pydantic, safetensors and nixl); empty means PyPI.
ARG PIP_INDEX_ARGS=""
COPY wheels/ /wheels/
COPY pyproject.toml README.md /tmp/encoderpool/
COPY requirements/constraints.txt /tmp/encoderpool/requirements/
COPY contracts/ /tmp/encoderpool/contracts/
COPY operator/ /tmp/encoderpool/operator/
COPY connector/ /tmp/encoderpool/connector/
COPY router/ /tmp/encoderpool/router/
# vLLM's images install with uv; ours (a venv) with pip. No kopf, no Kubernetes client.
# The extras install with the project's pins (requirements/constraints.txt: the lock, which
# was resolved against vLLM 0.32's own requirements, so it never moves what vLLM needs).
# hadolint ignore=DL3013,SC2086
RUN if python3 -m pip --version >/dev/null 2>&1; then \
      python3 -m pip install --no-cache-dir ${PIP_INDEX_ARGS} \
        -c /tmp/encoderpool/requirements/constraints.txt "/tmp/encoderpool[connector,rdma]"; \
    else uv pip install --system --no-cache ${PIP_INDEX_ARGS} \
        -c /tmp/encoderpool/requirements/constraints.txt "/tmp/encoderpool[connector,rdma]"; fi \
 && rm -rf /tmp/encoderpool /wheels \
 && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; } \
 && mkdir -p /home/vllm && chown 1000:1000 /home/vllm
# The operator's pods run as 1000:1000 with HOME on an emptyDir; so does a plain `docker run`.
ENV HOME=/home/vllm
USER 1000:1000

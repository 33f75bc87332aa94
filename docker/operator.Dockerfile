# The operator image: the kopf operator and each pool's router (no torch, no vLLM).
# Build it with docker/build.sh (offline: our Debian base and a wheelhouse made on the
# host; --online: the public python base and PyPI). The context is the one build.sh
# assembles: the project's sources, requirements/ and wheels/ (empty online). Pinned by
# requirements/constraints.txt (the lock's versions; pip refuses hashes beside a local
# directory, see requirements/README.md).
# Pin the base by digest in your registry (python:3.11.11-slim-bookworm@sha256:...).
ARG PYTHON_BASE=python:3.11.11-slim-bookworm
FROM ${PYTHON_BASE} AS build
# --no-index --find-links /wheels when offline; empty means PyPI.
ARG PIP_INDEX_ARGS=""
WORKDIR /src
COPY wheels/ /wheels/
COPY pyproject.toml README.md ./
COPY requirements/constraints.txt requirements/constraints.txt
COPY contracts/ contracts/
COPY operator/ operator/
COPY connector/ connector/
COPY router/ router/
# hadolint ignore=DL3013
RUN python3 -m venv /opt/encoderpool \
 && /opt/encoderpool/bin/pip install --no-cache-dir ${PIP_INDEX_ARGS} \
      --constraint requirements/constraints.txt ".[operator,router]"

FROM ${PYTHON_BASE}
COPY --from=build /opt/encoderpool /opt/encoderpool
# `kopf` (the operator) and `python -m encoderpool_router` (the router) come from here.
ENV PATH=/opt/encoderpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root, matching the chart's and the router's runAsUser; nothing is written at run time.
USER 1000:1000
# The chart passes the real arguments (scope, peering, liveness); this is the standalone default.
CMD ["kopf", "run", "--module=encoderpool_operator.handlers", "--all-namespaces"]

# syntax=docker/dockerfile:1
# The operator image: the kopf operator and each pool's router (no torch, no vLLM).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/encoderpool/encoderpool-operator:0.1.0 .
# Dependencies are pinned by requirements/lock.txt, the lock the tests run against.
# Pin the base by digest in your registry (FROM python:3.11.11-slim-bookworm@sha256:...).
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/lock.txt requirements/lock.txt
COPY operator/ operator/
COPY connector/ connector/
RUN python -m venv /opt/encoderpool \
 && /opt/encoderpool/bin/pip install --no-cache-dir --constraint requirements/lock.txt ".[operator,router]"

FROM python:3.11.11-slim-bookworm
COPY --from=build /opt/encoderpool /opt/encoderpool
# `kopf` (the operator) and `python -m encoderpool_connector.router` (the router) come from here.
ENV PATH=/opt/encoderpool/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root, matching the chart's and the router's runAsUser; nothing is written at run time.
USER 1000:1000
# The chart passes the real arguments (scope, peering, liveness); this is the standalone default.
CMD ["kopf", "run", "--module=encoderpool_operator.handlers", "--all-namespaces"]

"""The pool's front door: an OpenAI-compatible EPD router.

For each request with media items it asks a producer to encode every item
(``max_tokens: 1``), gathers the producers' ``ec_transfer_params``, and sends
the original request, with those params, to a consumer; text-only requests go
straight to a consumer. Backends come from the producer and consumer Services'
EndpointSlices (watched) or from flags. See docs/router.md.

A request's walk is ``pipeline``: ``intake`` (read, classify), ``shares`` (admit),
``encode`` (producers), ``relay`` (a consumer); ``app`` wires the parts and serves
the routes; ``backends`` keeps each backend's in-flight count and ejection.

Runs as ``python -m encoderpool_router``, in a pod of its own (a Deployment per
pool, from the operator image). It is an import package of its own, not part of
the in-pod connector, because it needs aiohttp, prometheus_client and the
Kubernetes client, none of which belong in a vLLM image, and it imports neither
torch nor vLLM; it shares only ``encoderpool_contracts`` (pydantic)
with the connector. The ``router`` extra installs exactly what it imports.
"""

from encoderpool_router.config import RouterSettings

__all__ = ["RouterSettings"]

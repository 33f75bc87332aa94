"""The pool's front door: an OpenAI-compatible EPD router.

For each request with media items it asks a producer to encode every item
(``max_tokens: 1``), gathers the producers' ``ec_transfer_params``, and sends
the original request, with those params, to a consumer; text-only requests go
straight to a consumer. Backends come from the producer and consumer Services'
EndpointSlices (watched) or from flags. See docs/router.md.

Runs as ``python -m encoderpool_connector.router``. It imports neither torch nor
vLLM: the router image carries only aiohttp, prometheus_client and pydantic.
"""

from encoderpool_connector.router.config import RouterSettings

__all__ = ["RouterSettings"]

"""Programs that run in the vLLM image but are not the connector.

- ``measure``: the width Job's entrypoint (``python -m`` with
  ``encoderpool_contracts.pod.MEASURE_MODULE``): measures the encoder's output widths;
- ``api_guard``: the ASGI middleware ``vllm serve --middleware`` loads
  (``encoderpool_contracts.pod.API_GUARD_MIDDLEWARE``); standard library and the
  contracts' names only;
- ``vllm_cache``: fills vLLM's model-class cache when the image is built; run as a
  plain script before encoderpool is installed, so it imports nothing of ours.

Neither the core nor the transports import these.
"""

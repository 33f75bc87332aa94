"""encoderpool's in-pod code: the EC connectors vLLM loads, and the programs beside them.

Three layers, each importing only the ones above it (tools/import_rules.py checks it):

- ``core``: what both transports build on (role routing, lookups, tensor-parallel
  ranks, load buffers, counters, worker metadata, device helpers, start-up checks);
- ``shared_volume`` and ``rdma``: one transport each, one connector class each (the
  names vLLM loads are ``encoderpool_contracts.pod.CONNECTOR_CLASSES``); a transport
  imports the core and ``encoderpool_contracts``, never the other transport;
- ``programs``: what runs in the vLLM image but is not the connector (the width Job's
  ``measure``, the API guard middleware, the image build's ``vllm_cache``); nothing
  above imports them.

Importing this package imports nothing, torch and vLLM included.
"""

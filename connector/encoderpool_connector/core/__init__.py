"""The connector's core: what both transports build on, so the two cannot drift.

- ``routing``: ``RoleRoutingConnector``, the ``ECConnectorBase`` a transport's class
  subclasses; it parses the config and routes each call to the role's delegate;
- ``startup``: the config check and the encoder widths lookups compare against;
- ``lookups``: a consumer scheduler's per-item lookups and the requests waiting on them;
- ``ranks``: what a worker does as one tensor-parallel rank (who writes, agreeing on
  failed loads, encoding them instead);
- ``metadata``: the worker -> scheduler report both transports extend;
- ``stats``: counters and their Prometheus metrics, per transport by subclassing;
- ``loadbuffers``, ``tensors``: reused host buffers for loads; torch dtypes and the
  worker's device (worker side only: they import torch);
- ``staging``, ``streams``, ``savequeue``: a producer's saves off the encoder step
  (bounded staging memory, copies on a side stream, the writer thread that publishes
  through the transport) and loads uploaded on a side stream (worker side only).

The core imports neither transport nor the programs. Importing this package imports
nothing; each module says what it needs (vLLM, torch).
"""

"""The pod contract: names the operator renders into vLLM pods and the code in them reads.

The operator image and the vLLM image upgrade apart; each name here is written once,
so the two cannot drift (a test starts vLLM with ``API_GUARD_MIDDLEWARE`` and checks it
names the guard's class).
"""

# The pool's key toward producers and consumers: vLLM's own --api-key variable, which
# the API guard reads too.
VLLM_API_KEY_ENV = "VLLM_API_KEY"
# The address an rdma producer announces to consumers: its pod IP (downward API).
ADVERTISE_HOST_ENV = "ENCODERPOOL_ADVERTISE_HOST"
# What `vllm serve --middleware` loads: every route but /health and /metrics needs the key.
API_GUARD_MIDDLEWARE = "encoderpool_connector.programs.api_guard.RequireApiKey"
# Shared-volume pods also load this one: the cache volume's free space and files on the
# server's /metrics, measured at scrape time in the directory ``CACHE_DIR_ENV`` names.
VOLUME_METRICS_MIDDLEWARE = "encoderpool_connector.programs.volume_metrics.VolumeMetrics"
CACHE_DIR_ENV = "ENCODERPOOL_CACHE_DIR"

# The out-of-tree connector class and the module vLLM imports it from, per transport
# (each class name unique: vLLM's factory looks its built-ins up first).
CONNECTOR_CLASSES: dict[str, tuple[str, str]] = {
    "sharedVolume": ("EncoderPoolSharedVolumeConnector", "encoderpool_connector.shared_volume"),
    "rdma": ("EncoderPoolNixlConnector", "encoderpool_connector.rdma"),
}
# What the width Job runs with ``python -m`` in the vLLM image: it measures the encoder's
# output widths and writes a WidthReport to the file named by ``--output-file``.
MEASURE_MODULE = "encoderpool_connector.programs.measure"
# The port vLLM and the router serve the OpenAI API on, the router's metrics port
# (scrapers never need the API) and its probe port (the kubelet's, outside the caps
# clients can fill on the API port).
HTTP_PORT = 8000
ROUTER_METRICS_PORT = 9090
ROUTER_PROBE_PORT = 8081

"""Every metric name the chart's dashboard and alerts read, beside the autoscaling signals.

The router, the operator and the connector register these series; the operator's code
generator writes panels and alerts over them and renders autoscaler queries over the
signals: different images, so a name written twice could drift silently (a renamed
counter, a dashboard showing nothing). ``signals`` keeps the autoscaling signals with
what they mean; this module names the rest and lists them all (``READ``). Names are as
queries spell them: counters with ``_total``; histograms by their base name, read through
``_bucket``. A component registers a counter by ``family(name)`` (prometheus_client adds
``_total`` back).
"""

from encoderpool_contracts.signals import (
    DISPATCH_DECISIONS,
    ENCODER_INFLIGHT_ITEMS,
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    PRODUCER_ITEM_SECONDS,
    VLLM_KV_CACHE_USAGE,
    VLLM_REQUESTS_RUNNING,
    VLLM_REQUESTS_WAITING,
)


def family(name: str) -> str:
    """The name a counter is registered by: its series' name without ``_total``."""
    return name.removesuffix("_total")


# The router (encoderpool_router.metrics).
ROUTER_REQUESTS = "encoderpool_router_requests_total"  # labels: endpoint, code
ROUTER_ERRORS = "encoderpool_router_errors_total"  # label: kind
ROUTER_MEDIA_ITEMS = "encoderpool_router_media_items_total"  # label: encoded
ROUTER_CONSUMER_LATENCY = "encoderpool_router_consumer_latency_seconds"  # histogram; phase
ROUTER_BACKENDS = "encoderpool_router_backends"  # label: role

# The operator (encoderpool_operator.controller.metrics), one series per pool.
OPERATOR_POOL_CONDITION = "encoderpool_operator_pool_condition"
OPERATOR_POOL_REPLICAS = "encoderpool_operator_pool_replicas"
OPERATOR_POOL_ENCODER_WIDTH = "encoderpool_operator_pool_encoder_width"

# The connector: one counter per key of a transport's counters table (its stats module),
# on vLLM's /metrics.
EC_COUNTER_PREFIX = "encoderpool_ec_"


def ec_counter(key: str) -> str:
    """The series of a transport's counter ``key``."""
    return f"{EC_COUNTER_PREFIX}{key}_total"


EC_HITS = ec_counter("hits")
EC_MISSES = ec_counter("misses")
EC_REJECTED = ec_counter("rejected")
EC_PUBLISH_BYTES = ec_counter("publish_bytes")
EC_EVICTED_BYTES = ec_counter("evicted_bytes")
EC_LOADS = ec_counter("loads")
EC_LOAD_SECONDS = ec_counter("load_seconds")

# The shared cache volume's filesystem (encoderpool_connector.programs.volume_metrics).
EC_VOLUME_SIZE_BYTES = "encoderpool_ec_volume_size_bytes"
EC_VOLUME_AVAILABLE_BYTES = "encoderpool_ec_volume_available_bytes"
EC_VOLUME_FILES = "encoderpool_ec_volume_files"
EC_VOLUME_FILES_AVAILABLE = "encoderpool_ec_volume_files_available"

# vLLM's own, beside the scheduler gauges in ``signals``.
# A histogram. (S105: a metric name, not a secret.)
VLLM_INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"  # noqa: S105

# vLLM registers these; none of our components does.
VLLM = (
    VLLM_REQUESTS_RUNNING,
    VLLM_REQUESTS_WAITING,
    VLLM_KV_CACHE_USAGE,
    VLLM_INTER_TOKEN_LATENCY,
)
# Every name above: what dashboards, alerts and autoscalers may read.
READ = (
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    ENCODER_INFLIGHT_ITEMS,
    DISPATCH_DECISIONS,
    PRODUCER_ITEM_SECONDS,
    ROUTER_REQUESTS,
    ROUTER_ERRORS,
    ROUTER_MEDIA_ITEMS,
    ROUTER_CONSUMER_LATENCY,
    ROUTER_BACKENDS,
    OPERATOR_POOL_CONDITION,
    OPERATOR_POOL_REPLICAS,
    OPERATOR_POOL_ENCODER_WIDTH,
    EC_HITS,
    EC_MISSES,
    EC_REJECTED,
    EC_PUBLISH_BYTES,
    EC_EVICTED_BYTES,
    EC_LOADS,
    EC_LOAD_SECONDS,
    EC_VOLUME_SIZE_BYTES,
    EC_VOLUME_AVAILABLE_BYTES,
    EC_VOLUME_FILES,
    EC_VOLUME_FILES_AVAILABLE,
    *VLLM,
)

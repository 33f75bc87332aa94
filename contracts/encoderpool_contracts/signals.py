"""The autoscaling signals: what the router and vLLM export, and the labels queries select by.

The router exports the encoder demand, vLLM the LM demand, and the operator renders
Prometheus queries over both into each role's autoscaler: three images, so every
name is written here once. docs/autoscaling.md says what each means and why it was
chosen.
"""

# Producers: the time integral of media items in flight to a producer group (sent, not
# yet answered). Its rate over a window is the mean number of items in flight then, i.e.
# the encoder seconds per second the group was asked for (Little's law), whatever the
# scrape interval catches. Label: group, the producer Service that feeds the group
# (<pool>-producer, <pool>-producer-<group>).
ENCODER_INFLIGHT_SECONDS = "encoderpool_router_encoder_inflight_seconds_total"
# Items the router wanted a producer for but found none ready (the group at zero, or all
# ejected): the consumer encoded them. Counted once a consumer accepted their request,
# each item once per window and one client's within its share. Its rate wakes a group
# scaled to zero. Label: group.
ENCODER_UNSERVED_ITEMS = "encoderpool_router_encoder_unserved_items_total"
# Items in flight to a group right now (a gauge, for dashboards and the dispatch decision).
ENCODER_INFLIGHT_ITEMS = "encoderpool_router_encoder_inflight_items"
# Each media item's dispatch decision. Labels: group, to ("producer" | "consumer"),
# reason (see the router's dispatch module).
DISPATCH_DECISIONS = "encoderpool_router_dispatch_decisions_total"
# Seconds per media item on a producer group, hop included, as the router measures them
# (a gauge: what the dispatch decision weighs). Labels: group, modality.
PRODUCER_ITEM_SECONDS = "encoderpool_router_producer_item_seconds"

# Consumers: vLLM's own scheduler gauges, per engine.
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"

# The labels the scrape configuration gives every series of a pool's pods
# (docs/autoscaling.md has it for Prometheus and for a Prometheus Operator PodMonitor).
LABEL_NAMESPACE = "namespace"
LABEL_POOL = "pool"
LABEL_COMPONENT = "component"
LABEL_GROUP = "group"

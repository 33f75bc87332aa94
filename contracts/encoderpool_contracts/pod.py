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
API_GUARD_MIDDLEWARE = "encoderpool_connector.api_guard.RequireApiKey"

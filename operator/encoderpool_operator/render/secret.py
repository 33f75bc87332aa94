"""The pool's internal Secret, ``<pool>-internal``: random keys its pods share.

The operator creates it (random values, see reconcile/act.py) and never reads
it: pods get its keys by secretKeyRef.
"""

from __future__ import annotations

from typing import Any

from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kinds import SECRET
from encoderpool_operator.naming import INTERNAL, child_meta, name_of
from encoderpool_operator.render.family import Family

VLLM_API_KEY_KEY = "vllm-api-key"  # the router's key toward producers and consumers
CHANNEL_KEY_KEY = "channel-key"  # the pool key: rdma messages, shared-volume entries
INTERNAL_KEYS = (VLLM_API_KEY_KEY, CHANNEL_KEY_KEY)


def internal_secret(pool: EncoderPool) -> dict[str, Any]:
    """``<pool>-internal`` without its data: ``act`` fills ``INTERNAL_KEYS`` with fresh
    random values when it creates it. Owned by the pool, so it goes with the pool."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_meta(pool, name_of(pool, INTERNAL), INTERNAL),
        "type": "Opaque",
    }


def internal_key_env(pool: EncoderPool, env: str, key: str) -> dict[str, Any]:
    """Env ``env`` from key ``key`` of the pool's internal Secret (a reference, never a value)."""
    return {
        "name": env,
        "valueFrom": {"secretKeyRef": {"name": name_of(pool, INTERNAL), "key": key}},
    }


# Created with its random data before the first Deployment, never applied or read
# (``reconcile.plan.with_internal_secret``).
FAMILY = Family("secret", (SECRET,), rendered_by="reconcile/plan.py")

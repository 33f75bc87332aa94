"""The pool's ingress NetworkPolicies, one per component (spec.networkPolicy)."""

from __future__ import annotations

from typing import Any

from encoderpool_contracts.pod import HTTP_PORT, ROUTER_METRICS_PORT
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kinds import NETWORK_POLICY
from encoderpool_operator.naming import (
    CONSUMER,
    ROUTER,
    WIDTH_JOB,
    Ref,
    child_meta,
    name_of,
    producer_components,
    ref_of,
    selector_labels,
)
from encoderpool_operator.render import transport
from encoderpool_operator.render.family import Defaults, Family, Inputs


def _network_policy(pool: EncoderPool, component: str, ingress: list[Any]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(pool, name_of(pool, component), component),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(pool, component)},
            "policyTypes": ["Ingress"],
            # No rules: nothing gets in. (The server drops an empty list; leaving it out
            # keeps the comparison with the live object exact.)
            **({"ingress": ingress} if ingress else {}),
        },
    }


def network_policies(pool: EncoderPool) -> list[dict[str, Any]]:
    """Ingress policies, one per component: clients -> router -> producers and consumers,
    consumers -> producers (rdma: side channel and UCX, whose ports are ephemeral),
    scrapers -> the vLLM port and the router's metrics port, nothing -> the width Job.
    Egress is left open (the router watches the API server, the pods may load models
    from a hub)."""
    spec = pool.spec.network_policy
    if not spec.enabled:
        return []
    http = [{"protocol": "TCP", "port": HTTP_PORT}]
    clients = [p.render() for p in spec.clients]

    def allow(peers: list[dict[str, Any]] | None, ports: list[Any] | None = http) -> Any:
        rule: dict[str, Any] = {} if peers is None else {"from": peers}
        return {**rule, "ports": ports} if ports else rule

    def pods_of(component: str) -> dict[str, Any]:
        return {"podSelector": {"matchLabels": selector_labels(pool, component)}}

    anyone_or_clients = clients or None
    if pool.spec.router.enabled:
        vllm_port = [allow([pods_of(ROUTER)])]
    else:  # the user's own proxy reaches the vLLM pods
        vllm_port = [allow(anyone_or_clients)]
    scrapers = [p.render() for p in spec.metrics]
    if scrapers:  # vLLM serves /metrics on its API port (its /v1 needs the pool's key)
        vllm_port.append(allow(scrapers))
    producers = list(vllm_port)
    if transport.consumers_reach_producers(pool):
        producers.append(allow([pods_of(CONSUMER)], ports=None))
    out = [
        *(_network_policy(pool, c, producers) for c, _ in producer_components(pool)),
        _network_policy(pool, CONSUMER, vllm_port),
        _network_policy(pool, WIDTH_JOB, []),
    ]
    if pool.spec.router.enabled:
        router = [allow(anyone_or_clients)]
        if scrapers:  # the router's /metrics has a port of its own: clients never reach it
            router.append(allow(scrapers, ports=[{"protocol": "TCP", "port": ROUTER_METRICS_PORT}]))
        out.append(_network_policy(pool, ROUTER, router))
    return out


def _objects(pool: EncoderPool, _: Inputs) -> list[dict[str, Any]]:
    return network_policies(pool)


def _refs(pool: EncoderPool, _: Defaults | None, __: frozenset[str]) -> list[Ref]:
    return [ref_of(p) for p in network_policies(pool)]


FAMILY = Family("network", (NETWORK_POLICY,), _objects, _refs)

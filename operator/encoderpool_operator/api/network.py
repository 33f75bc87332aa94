"""``spec.networkPolicy``: who may reach the pool's pods."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field

from encoderpool_contracts.pod import ROUTER_METRICS_PORT
from encoderpool_operator.api.schema import ApiModel, Label, LabelKey, Rule

CIDR_PATTERN = r"^[0-9a-fA-F:.]+/[0-9]{1,3}$"


class LabelSelector(ApiModel):
    """Objects whose labels hold every pair (an empty selector matches all)."""

    match_labels: dict[LabelKey, Label] = Field(
        default_factory=dict, max_length=16, description="Labels the objects must carry."
    )

    def render(self) -> dict[str, Any]:
        return {"matchLabels": dict(self.match_labels)}


class IpBlock(ApiModel):
    """An address range (for clients outside the cluster, e.g. a load balancer's)."""

    cidr: str = Field(
        min_length=9, max_length=43, pattern=CIDR_PATTERN, description="CIDR, e.g. 10.0.0.0/8."
    )
    except_: tuple[Annotated[str, Field(max_length=43, pattern=CIDR_PATTERN)], ...] = Field(
        default=(), alias="except", max_length=16, description="CIDRs inside cidr to leave out."
    )


class NetworkPeer(ApiModel):
    """Who may connect: as a NetworkPolicyPeer (selectors by matchLabels)."""

    rules: ClassVar[tuple[Rule[NetworkPeer], ...]] = (
        Rule(
            "",
            cel="has(self.podSelector) || has(self.namespaceSelector) || has(self.ipBlock)",
            check=lambda p: (
                not (p.pod_selector is None and p.namespace_selector is None and p.ip_block is None)
            ),
            message="set at least one of podSelector, namespaceSelector or ipBlock",
        ),
    )

    pod_selector: LabelSelector | None = Field(
        default=None, description="Pods (in the pool's namespace, or the selected namespaces)."
    )
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces; {} means every namespace."
    )
    ip_block: IpBlock | None = Field(default=None, description="An address range.")

    def render(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.pod_selector is not None:
            out["podSelector"] = self.pod_selector.render()
        if self.namespace_selector is not None:
            out["namespaceSelector"] = self.namespace_selector.render()
        if self.ip_block is not None:
            out["ipBlock"] = self.ip_block.model_dump(
                mode="json", by_alias=True, exclude_defaults=True
            )
        return out


class NetworkPolicySpec(ApiModel):
    """Who may reach the pool's pods: one ingress NetworkPolicy per component.

    Clients reach the router; the router reaches producers and consumers; consumers
    reach producers (rdma: the side channel and UCX's ports); nothing reaches the
    width Job. vLLM serves /metrics on its API port, so scrapers named in
    ``metrics`` reach that port (its API still needs the pool's key) and the router's
    metrics port. Effective only where the cluster's network plugin enforces
    NetworkPolicy.
    """

    enabled: bool = Field(default=True, description="Render the policies; false removes them.")
    clients: tuple[NetworkPeer, ...] = Field(
        default=(),
        max_length=16,
        description="Who may reach the pool's endpoint (the router; without a router, the "
        "consumers and producers). Empty: anyone.",
    )
    metrics: tuple[NetworkPeer, ...] = Field(
        default=(),
        max_length=16,
        description="Scrapers allowed on the vLLM pods' port (vLLM serves /metrics beside "
        "its API, which needs the pool's key) "
        f"and on the router's metrics port ({ROUTER_METRICS_PORT}).",
    )

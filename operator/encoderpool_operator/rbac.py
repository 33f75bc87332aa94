"""Every permission the operator needs: the one list the Helm chart's RBAC is rendered from.

What it holds on the kinds it reads and writes is declared with each kind
(``kinds.Kind.grants``, beside the families that render them); kopf's own needs and
what the operator holds only to grant it are listed here. ``python -m encoderpool_codegen.chart
charts/encoderpool-operator`` writes it to the chart's files/rbac.json, which
the templates render (never a hand-kept copy of the rules), and
tests/chart/test_rbac_chart.py proves the list on the local control plane both ways:
the operator, run as the chart's ServiceAccount, never gets a 403, and every
verb granted here is used at least once (DELEGATED ones excepted, with why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from encoderpool_operator.kinds import CHILD_KINDS, OPERATOR_KINDS, Engine, Kind

Mode = Literal["cluster", "namespace"]
MODES: tuple[Mode, ...] = ("cluster", "namespace")
# The Lease the replicas elect their leader on (kopf runs standalone: no kopf peering).
LEASE_GROUP = "coordination.k8s.io"


@dataclass(frozen=True)
class Permission:
    """Verbs on one resource (``plural`` or ``plural/subresource``) of one API group."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str
    # Which install modes grant it: cluster-scoped kinds exist only for the cluster-wide one.
    modes: tuple[Mode, ...] = MODES
    # Granted by the release namespace's leader-election Role, never the main (Cluster)Role:
    # in either mode the Lease lives beside the operator's pods.
    lease_role: bool = False
    # Also restricted to the release's own Lease (by resourceNames).
    lease_object_only: bool = False
    # Held only so the operator may grant it to a child's Role; the operator never calls it.
    delegated: bool = False
    # Granted only with this autoscaling engine (the chart's autoscaling.engine).
    engine: Engine | None = None

    def rule(self) -> dict[str, Any]:
        return {
            "apiGroups": [self.group],
            "resources": [self.resource],
            "verbs": list(self.verbs),
            "why": self.why,
            "leaseRole": self.lease_role or self.lease_object_only,
            "leaseObjectOnly": self.lease_object_only,
            "engine": self.engine or "",
        }


def _granted(kinds: tuple[Kind, ...]) -> tuple[Permission, ...]:
    """The permissions ``kinds`` declare, in their order."""
    return tuple(
        Permission(
            k.group,
            f"{k.plural}/{g.subresource}" if g.subresource else k.plural,
            g.verbs,
            g.why,
            engine=g.engine,
        )
        for k in kinds
        for g in k.grants
    )


PERMISSIONS: tuple[Permission, ...] = (
    # ---- the pools (kopf watches them) and the Events a pass posts
    *_granted(OPERATOR_KINDS),
    # ---- kopf itself
    Permission(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("list", "watch"),
        "kopf notices CRDs installed or changed after start (cluster-wide mode only; a "
        "namespaced operator runs with scanning disabled: see handlers.configure)",
        modes=("cluster",),
    ),
    # ---- leader election (controller/leader.py): a Role in the release namespace only
    Permission(
        LEASE_GROUP,
        "leases",
        ("get", "update"),
        "leader election: read and renew the release's own Lease",
        lease_object_only=True,
    ),
    Permission(
        LEASE_GROUP,
        "leases",
        ("create",),
        "leader election: create the Lease on the first start (RBAC cannot limit create by name)",
        lease_role=True,
    ),
    # ---- children (reconcile/ through kube.Kube), and what a pass reads with them
    *_granted(CHILD_KINDS),
    # ---- held only to grant them (Kubernetes refuses a Role granting what its writer lacks)
    Permission(
        "discovery.k8s.io",
        "endpointslices",
        ("get", "list", "watch"),
        "granted to each router's Role (render.router.router_objects), so held",
        delegated=True,
    ),
    Permission(
        "",
        "services",
        ("get",),
        "granted to each router's Role for its pool's own Services (render.router.router_objects: "
        "it checks they are the pool's before trusting their EndpointSlices), so held",
        delegated=True,
    ),
)

# Held, never exercised by the operator itself: the RBAC test exempts these (and
# only these) from "every grant is used".
DELEGATED: frozenset[tuple[str, str, str]] = frozenset(
    (p.group, p.resource, v) for p in PERMISSIONS if p.delegated for v in p.verbs
)


def rules(mode: Mode) -> list[dict[str, Any]]:
    """RBAC rules for one install mode, with each rule's reason (the chart prints it)."""
    return [p.rule() for p in PERMISSIONS if mode in p.modes]


def granted(mode: Mode, engine: str = "keda") -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples the chart grants in ``mode`` with ``engine``."""
    return {
        (p.group, p.resource, v)
        for p in PERMISSIONS
        if mode in p.modes and p.engine in (None, engine)
        for v in p.verbs
    }

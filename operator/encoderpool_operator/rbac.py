"""Every permission the operator needs: the one list the Helm chart's RBAC is rendered from.

It lives beside the code whose API calls it grants, so a change to those calls
and to this list go together. ``python -m encoderpool_codegen.chart
charts/encoderpool-operator`` writes it to the chart's files/rbac.json, which
the templates render (never a hand-kept copy of the rules), and
tests/chart/test_rbac_chart.py proves the list on the local control plane both ways:
the operator, run as the chart's ServiceAccount, never gets a 403, and every
verb granted here is used at least once (DELEGATED ones excepted, with why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from encoderpool_operator.api import GROUP, PLURAL

Mode = Literal["cluster", "namespace"]
MODES: tuple[Mode, ...] = ("cluster", "namespace")
# kopf's peering objects (the chart ships their CRDs); kopf also knows the old zalando.org.
PEERING_GROUP = "kopf.dev"


@dataclass(frozen=True)
class Permission:
    """Verbs on one resource (``plural`` or ``plural/subresource``) of one API group."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str
    # Which install modes grant it: cluster-scoped kinds exist only for the cluster-wide one.
    modes: tuple[Mode, ...] = MODES
    # Restricted to the release's own peering object (kopf lists all, patches only its own).
    peering_object_only: bool = False
    # Held only so the operator may grant it to a child's Role; the operator never calls it.
    delegated: bool = False
    # Granted only with this autoscaling engine (the chart's autoscaling.engine).
    engine: Literal["keda", "hpa"] | None = None

    def rule(self) -> dict[str, Any]:
        return {
            "apiGroups": [self.group],
            "resources": [self.resource],
            "verbs": list(self.verbs),
            "why": self.why,
            "peeringObjectOnly": self.peering_object_only,
            "engine": self.engine or "",
        }


PERMISSIONS: tuple[Permission, ...] = (
    # ---- kopf itself
    Permission(GROUP, PLURAL, ("list", "watch"), "kopf: watch EncoderPools (the read cache)"),
    Permission(GROUP, f"{PLURAL}/status", ("patch",), "status: conditions, widths, replicas"),
    Permission("", "events", ("create",), "a pass posts Events: Ready changed, problems"),
    Permission(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("list", "watch"),
        "kopf notices CRDs installed or changed after start (cluster-wide mode only; a "
        "namespaced operator runs with scanning disabled: see handlers.configure)",
        modes=("cluster",),
    ),
    Permission(
        PEERING_GROUP,
        "clusterkopfpeerings",
        ("list", "watch"),
        "kopf peering: see the other replicas (cluster-wide mode)",
        modes=("cluster",),
    ),
    Permission(
        PEERING_GROUP,
        "clusterkopfpeerings",
        ("patch",),
        "kopf peering: keep-alives in the release's own peering object",
        modes=("cluster",),
        peering_object_only=True,
    ),
    Permission(
        PEERING_GROUP,
        "kopfpeerings",
        ("list", "watch"),
        "kopf peering: see the other replicas (namespaced mode)",
        modes=("namespace",),
    ),
    Permission(
        PEERING_GROUP,
        "kopfpeerings",
        ("patch",),
        "kopf peering: keep-alives in the release's own peering object",
        modes=("namespace",),
        peering_object_only=True,
    ),
    # ---- children (reconcile/ through kube.Kube): read from kopf's watches (handlers: the
    # read cache, so list + watch, no get), written by server-side apply, which is a patch
    # that creates a missing object: the API server then checks create as well.
    Permission(
        "apps",
        "deployments",
        ("list", "watch", "create", "patch", "delete"),
        "producer/consumer/router Deployments: cached, a change marks the pool; deleted "
        "when the spec drops them (the router disabled)",
    ),
    Permission(
        "batch",
        "jobs",
        ("list", "watch", "create", "patch", "delete"),
        "width Jobs: cached (is a Job's name someone else's?), a change marks the pool; "
        "deleted to retry or when their model is stale",
    ),
    Permission(
        "",
        "services",
        ("list", "watch", "create", "patch", "delete"),
        "producer (headless), consumer, router: cached; deleted when dropped",
    ),
    Permission(
        "",
        "persistentvolumeclaims",
        ("list", "watch", "create", "patch", "delete"),
        "the shared-volume cache PVC: cached; deleted when the pool switches to rdma",
    ),
    Permission(
        "",
        "configmaps",
        ("list", "watch", "create", "patch"),
        "width reports: cached; store what the width Job's pod reported, add this pool as "
        "an owner, count failed attempts",
    ),
    Permission(
        "",
        "secrets",
        ("create",),
        "each pool's <pool>-internal Secret (random keys: vLLM API key, rdma channel key). "
        "Create only, never get/list/watch: reading would expose every Secret of the "
        "namespace; pods get the keys by secretKeyRef",
    ),
    Permission(
        "",
        "pods",
        ("list",),
        "a finished width Job's pod (by controller-uid): its termination message is the report",
    ),
    Permission(
        "",
        "serviceaccounts",
        ("list", "watch", "create", "patch", "delete"),
        "the router's identity: cached; deleted with the router",
    ),
    Permission(
        "rbac.authorization.k8s.io",
        "roles",
        ("list", "watch", "create", "patch", "delete"),
        "the router's Role (EndpointSlices of its pool): cached; deleted with the router",
    ),
    Permission(
        "rbac.authorization.k8s.io",
        "rolebindings",
        ("list", "watch", "create", "patch", "delete"),
        "the router's RoleBinding: cached; deleted with the router",
    ),
    Permission(
        "networking.k8s.io",
        "networkpolicies",
        ("list", "watch", "create", "patch", "delete"),
        "each pool's ingress NetworkPolicies: cached; deleted when spec.networkPolicy is "
        "turned off",
    ),
    Permission(
        "keda.sh",
        "scaledobjects",
        ("list", "watch"),
        "autoscaling roles' KEDA ScaledObjects: cached, whichever engine (a pool's old "
        "autoscalers are pruned after the engine changes); their status conditions (Ready, "
        "Active) are status.autoscaling's",
    ),
    Permission(
        "keda.sh",
        "scaledobjects",
        ("create", "patch", "delete"),
        "each autoscaling role's ScaledObject (engine keda): applied; deleted when the role "
        "stops autoscaling",
        engine="keda",
    ),
    Permission(
        "autoscaling",
        "horizontalpodautoscalers",
        ("list", "watch"),
        "autoscaling roles' HorizontalPodAutoscalers, the operator's and those KEDA makes "
        "for its ScaledObjects: cached, whichever engine (whose each is decides what the "
        "operator renders); their status (replicas, last scale, conditions) is "
        "status.autoscaling's",
    ),
    Permission(
        "autoscaling",
        "horizontalpodautoscalers",
        ("create", "patch", "delete"),
        "each autoscaling role's HorizontalPodAutoscaler (engine hpa): applied; deleted when "
        "the role stops autoscaling",
        engine="hpa",
    ),
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

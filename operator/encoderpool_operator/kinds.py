"""Every kind the operator reads or writes, declared once: where it is served (apiVersion,
plural, namespaced), whether the read cache keeps it, and what the operator may do with it.

    kube     paths (``kube.PLURALS``)
    rbac     the chart's rules (``rbac.PERMISSIONS``, in ``KINDS`` order)
    render   each family of a pool's children names the kinds it renders
             (``render.FAMILIES``); what the reconcile prunes and the read cache
             keeps derive from those lists

So a new kind of child is one ``Kind`` here, named by the family that renders it;
tests/operator/test_registry.py checks that every object a family renders is of a kind
it names, and that every kind here is someone's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from encoderpool_operator.api import API_VERSION, KIND, PLURAL
from encoderpool_operator.naming import Ref

# What drives autoscaling roles (the chart's autoscaling.engine): KEDA's ScaledObjects or
# plain HorizontalPodAutoscalers.
Engine = Literal["keda", "hpa"]
ENGINES: tuple[Engine, ...] = ("keda", "hpa")
# The verbs on a kind a pass reads from the read cache (kopf's watches fill it: list and
# watch, no get) and writes by server-side apply, which is a patch that creates a missing
# object (the API server then checks create as well), deleting what the spec drops.
CACHED_CHILD = ("list", "watch", "create", "patch", "delete")


@dataclass(frozen=True)
class Grant:
    """Verbs the operator holds on a kind (or one of its subresources), and why: one rule
    of the chart's RBAC."""

    verbs: tuple[str, ...]
    why: str
    subresource: str = ""
    # Granted only with this autoscaling engine.
    engine: Engine | None = None


@dataclass(frozen=True)
class Kind:
    """One kind of object: where the API server serves it and what the operator may do."""

    api_version: str
    kind: str
    plural: str
    grants: tuple[Grant, ...]
    namespaced: bool = True
    # Kept by the read cache: kopf watches every object of it (handlers), and a pass reads
    # it from there instead of the API server.
    cached: bool = True

    @property
    def key(self) -> tuple[str, str]:
        """(apiVersion, kind), as the API client and the read cache look kinds up."""
        return (self.api_version, self.kind)

    @property
    def group(self) -> str:
        """The API group ("" for the core group's v1)."""
        return self.api_version.rpartition("/")[0]

    def ref(self, name: str) -> Ref:
        """(apiVersion, kind, name) of the object of this kind named ``name``."""
        return (self.api_version, self.kind, name)


# ---- the operator's own: the pools it watches (their own index, not the read cache's
# per-kind ones) and the Events a pass posts
POOL = Kind(
    API_VERSION,
    KIND,
    PLURAL,
    (
        Grant(("list", "watch"), "kopf: watch EncoderPools (the read cache)"),
        Grant(("patch",), "status: conditions, widths, replicas", subresource="status"),
    ),
    cached=False,
)
EVENT = Kind(
    "v1",
    "Event",
    "events",
    (Grant(("create",), "a pass posts Events: Ready changed, problems"),),
    cached=False,
)

# ---- what the pools' families render or read (render.FAMILIES names them)
DEPLOYMENT = Kind(
    "apps/v1",
    "Deployment",
    "deployments",
    (
        Grant(
            CACHED_CHILD,
            "producer/consumer/router Deployments: cached, a change marks the pool; deleted "
            "when the spec drops them (the router disabled)",
        ),
    ),
)
JOB = Kind(
    "batch/v1",
    "Job",
    "jobs",
    (
        Grant(
            CACHED_CHILD,
            "width Jobs: cached (is a Job's name someone else's?), a change marks the pool; "
            "deleted to retry or when their model is stale",
        ),
    ),
)
SERVICE = Kind(
    "v1",
    "Service",
    "services",
    (
        Grant(
            CACHED_CHILD,
            "producer (headless), consumer, router: cached; deleted when dropped",
        ),
    ),
)
PERSISTENT_VOLUME_CLAIM = Kind(
    "v1",
    "PersistentVolumeClaim",
    "persistentvolumeclaims",
    (
        Grant(
            CACHED_CHILD,
            "the shared-volume cache PVC: cached; deleted when the pool switches to rdma",
        ),
    ),
)
CONFIG_MAP = Kind(
    "v1",
    "ConfigMap",
    "configmaps",
    (
        Grant(
            ("list", "watch", "create", "patch"),
            "width reports: cached; store what the width Job's pod reported, add this pool "
            "as an owner, count failed attempts",
        ),
    ),
)
SECRET = Kind(
    "v1",
    "Secret",
    "secrets",
    (
        Grant(
            ("create",),
            "each pool's <pool>-internal Secret (random keys: vLLM API key, rdma channel "
            "key). Create only, never get/list/watch: reading would expose every Secret of "
            "the namespace; pods get the keys by secretKeyRef",
        ),
    ),
    cached=False,
)
POD = Kind(
    "v1",
    "Pod",
    "pods",
    (
        Grant(
            ("list",),
            "a finished width Job's pod (by controller-uid): its termination message is the report",
        ),
    ),
    cached=False,
)
SERVICE_ACCOUNT = Kind(
    "v1",
    "ServiceAccount",
    "serviceaccounts",
    (Grant(CACHED_CHILD, "the router's identity: cached; deleted with the router"),),
)
ROLE = Kind(
    "rbac.authorization.k8s.io/v1",
    "Role",
    "roles",
    (
        Grant(
            CACHED_CHILD,
            "the router's Role (EndpointSlices of its pool): cached; deleted with the router",
        ),
    ),
)
ROLE_BINDING = Kind(
    "rbac.authorization.k8s.io/v1",
    "RoleBinding",
    "rolebindings",
    (Grant(CACHED_CHILD, "the router's RoleBinding: cached; deleted with the router"),),
)
NETWORK_POLICY = Kind(
    "networking.k8s.io/v1",
    "NetworkPolicy",
    "networkpolicies",
    (
        Grant(
            CACHED_CHILD,
            "each pool's ingress NetworkPolicies: cached; deleted when spec.networkPolicy "
            "is turned off",
        ),
    ),
)
SCALED_OBJECT = Kind(
    "keda.sh/v1alpha1",
    "ScaledObject",
    "scaledobjects",
    (
        Grant(
            ("list", "watch"),
            "autoscaling roles' KEDA ScaledObjects: cached, whichever engine (a pool's old "
            "autoscalers are pruned after the engine changes); their status conditions "
            "(Ready, Active) are status.autoscaling's",
        ),
        Grant(
            ("create", "patch", "delete"),
            "each autoscaling role's ScaledObject (engine keda): applied; deleted when the "
            "role stops autoscaling",
            engine="keda",
        ),
    ),
)
HORIZONTAL_POD_AUTOSCALER = Kind(
    "autoscaling/v2",
    "HorizontalPodAutoscaler",
    "horizontalpodautoscalers",
    (
        Grant(
            ("list", "watch"),
            "autoscaling roles' HorizontalPodAutoscalers, the operator's and those KEDA "
            "makes for its ScaledObjects: cached, whichever engine (whose each is decides "
            "what the operator renders); their status (replicas, last scale, conditions) is "
            "status.autoscaling's",
        ),
        Grant(
            ("create", "patch", "delete"),
            "each autoscaling role's HorizontalPodAutoscaler (engine hpa): applied; deleted "
            "when the role stops autoscaling",
            engine="hpa",
        ),
    ),
)

OPERATOR_KINDS: tuple[Kind, ...] = (POOL, EVENT)
# What the pools' families render, and what a pass reads with them (the width Job's pods):
# each is named by a family (render.FAMILY_KINDS), in the order the chart's RBAC lists
# their rules.
CHILD_KINDS: tuple[Kind, ...] = (
    DEPLOYMENT,
    JOB,
    SERVICE,
    PERSISTENT_VOLUME_CLAIM,
    CONFIG_MAP,
    SECRET,
    POD,
    SERVICE_ACCOUNT,
    ROLE,
    ROLE_BINDING,
    NETWORK_POLICY,
    SCALED_OBJECT,
    HORIZONTAL_POD_AUTOSCALER,
)
KINDS: tuple[Kind, ...] = (*OPERATOR_KINDS, *CHILD_KINDS)

"""What a family of a pool's children declares, once: the kinds it renders, its objects,
and their refs; and what rendering takes besides the pool.

Each family module ends with its ``FAMILY``; ``render.FAMILIES`` lists them in apply
order, and ``workload_objects``, ``child_refs``, the kinds the reconcile prunes and the
read cache keeps all derive from that list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from encoderpool_contracts import WidthReport
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kinds import Engine, Kind
from encoderpool_operator.naming import Ref


@dataclass(frozen=True)
class Observed:
    """What rendering takes from the live world, read by the plan, so that rendering
    stays a pure function of its arguments."""

    # The pool's own Deployments by name: an autoscaling role keeps its live replicas
    # applied until its autoscaler holds them (render.vllm.deployment_replicas).
    deployments: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Components whose autoscaler is not rendered: its Deployment, or a name it needs,
    # is not the pool's (reconcile.scaling.withheld_autoscalers).
    withheld: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Defaults:
    """Operator-wide settings a reconcile needs (from OperatorSettings)."""

    router_image: str
    width_retry_seconds: float = 30.0  # first back-off after a failed width Job
    autoscaling_engine: Engine = "keda"  # what drives autoscaling roles
    prometheus_address: str | None = None  # what KEDA queries (the cluster's Prometheus)


@dataclass(frozen=True)
class Inputs:
    """What a workload family renders from besides the pool: the model's measurements,
    the operator's settings and what the plan observed."""

    report: WidthReport
    defaults: Defaults
    observed: Observed


# A family's objects for a measured model, in apply order.
Objects = Callable[[EncoderPool, Inputs], list[dict[str, Any]]]
# (apiVersion, kind, name) of what ``Objects`` returns, in its order, known without a
# report: the settings (None: name no autoscaler) and the components whose autoscaler
# is withheld.
Refs = Callable[[EncoderPool, "Defaults | None", frozenset[str]], list[Ref]]


@dataclass(frozen=True)
class Family:
    """One family of a pool's children.

    A workload family (``objects`` and ``refs``) is applied by every pass and pruned
    when the spec stops asking for it. The others name kinds the reconcile writes or
    reads by rules of its own (``rendered_by`` says where).
    """

    name: str
    kinds: tuple[Kind, ...]
    objects: Objects | None = None
    refs: Refs | None = None
    rendered_by: str = ""

    def __post_init__(self) -> None:
        assert (self.objects is None) == (self.refs is None), self.name
        assert (self.objects is None) == bool(self.rendered_by), self.name

    @property
    def workload(self) -> bool:
        return self.objects is not None

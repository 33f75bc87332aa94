"""What one pass knows about one pool and its children: ``observe`` reads it, the plan
(``plan``, ``widths``, ``scaling``) decides from it, and a test builds one by hand."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from encoderpool_contracts import WidthMismatch
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.cache import controller_uid
from encoderpool_operator.naming import Ref, name_of, width_job_name
from encoderpool_operator.render.widths import report_key


@dataclass(frozen=True)
class Snapshot:
    """What one pass knows about one pool and its children, as read from the API server."""

    pool: EncoderPool
    fingerprint: str
    report_cm: Mapping[str, Any] | None = None
    # This pool's width Jobs (controlled by it), of any model (the current one among them).
    width_jobs: tuple[Mapping[str, Any], ...] = ()
    # Pods of the current width Job: read only once it completed and no report is stored.
    job_pods: tuple[Mapping[str, Any], ...] = ()
    # Each object the spec names (``render.child_refs``, the HPAs KEDA makes for the
    # ScaledObjects, and the width Job while there is no report): the live object,
    # whoever owns it, or None.
    live: Mapping[Ref, Mapping[str, Any] | None] = field(default_factory=dict)
    # Every object of ``render.WORKLOAD_KINDS`` this pool controls, wanted or not (for pruning).
    owned: Mapping[Ref, Mapping[str, Any]] = field(default_factory=dict)
    # When this operator last wrote the pool's status (its memory; None: not since start).
    status_written_at: datetime | None = None
    # vLLM components whose Deployment is not available and one of whose pods refused to
    # start on the width report: component -> (pod, why). Read only for such Deployments.
    refusals: Mapping[str, tuple[str, WidthMismatch]] = field(default_factory=dict)

    @cached_property
    def report_key(self) -> str:
        """What the width report and Job are named by (``render.widths.report_key``)."""
        return report_key(self.pool)

    @property
    def job_name(self) -> str:
        return width_job_name(self.pool, self.report_key)

    @property
    def job(self) -> Mapping[str, Any] | None:
        """The width Job of the current model, if it exists."""
        return next((j for j in self.width_jobs if j["metadata"]["name"] == self.job_name), None)

    def ours(self, obj: Mapping[str, Any] | None) -> bool:
        return obj is not None and controller_uid(obj) == self.pool.metadata.get("uid")

    def made_by_ours(self, obj: Mapping[str, Any] | None) -> bool:
        """Controlled by one of the pool's children (the HPA KEDA makes for a ScaledObject
        of the pool's): the pool's too, one step removed."""
        uid = controller_uid(obj) if obj is not None else None
        return bool(uid) and any(uid == c["metadata"].get("uid") for c in self.owned.values())

    def child(self, ref: Ref) -> Mapping[str, Any] | None:
        return self.live.get(ref)

    def deployment(self, component: str) -> Mapping[str, Any] | None:
        """This pool's Deployment of ``component`` (never a foreign one of the same name)."""
        dep = self.child(("apps/v1", "Deployment", name_of(self.pool, component)))
        return dep if self.ours(dep) else None

    def foreign(self) -> list[Ref]:
        """Objects with a child's name that neither this pool nor a child of it controls:
        never touched."""
        return sorted(
            ref
            for ref, obj in self.live.items()
            if obj is not None and not self.ours(obj) and not self.made_by_ours(obj)
        )

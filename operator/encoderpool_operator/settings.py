"""Operator-wide settings, from the environment (ENCODERPOOL_*), parsed once at start-up."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class OperatorSettings(BaseSettings):
    """What the chart sets on the operator's Deployment; every value bounded."""

    model_config = SettingsConfigDict(env_prefix="ENCODERPOOL_", frozen=True, extra="ignore")

    router_image: str = Field(
        default="ghcr.io/encoderpool/encoderpool-operator:0.1.0",
        min_length=1,
        description="Image of the per-pool router (the operator's own image has it).",
    )
    resync_seconds: float = Field(
        default=60.0, ge=5, le=3600, description="How often every pool is reconciled anyway."
    )
    width_retry_seconds: float = Field(
        default=30.0, ge=1, le=600, description="First back-off after a failed width Job."
    )
    metrics_port: int = Field(
        default=8081, ge=0, le=65535, description="Prometheus /metrics port; 0 turns it off."
    )
    metrics_address: str = Field(
        default="0.0.0.0",  # noqa: S104 (in a pod, the port must be reachable for scraping)
        min_length=1,
        max_length=253,
        description="Address the metrics server listens on.",
    )
    settle_seconds: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="How long a pool marked by a child's or its own status change waits "
        "for more changes before its pass (a rollout is a burst of them); a new spec "
        "goes at once.",
    )
    workers: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Pools reconciled at once (each pass reads the cache, then writes).",
    )
    write_concurrency: int = Field(
        default=16,
        ge=1,
        le=128,
        description="API writes in flight at once, across all passes (one phase of a pass "
        "is written at once).",
    )
    api_qps: float = Field(
        default=200.0,
        gt=0,
        le=10000,
        description="Average API requests a second (client-side token bucket).",
    )
    api_burst: int = Field(
        default=400, ge=1, le=20000, description="Requests allowed at once above api_qps."
    )
    max_connections: int = Field(
        default=32, ge=1, le=512, description="HTTP connections kept to the API server."
    )
    max_retry_seconds: float = Field(
        default=300.0, ge=1, le=3600, description="Longest back-off after failed passes."
    )
    lease_name: str = Field(
        default="encoderpool-operator",
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The coordination.k8s.io Lease the replicas elect their leader on "
        "(the chart sets the release's full name).",
    )
    lease_namespace: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        description="Namespace of the Lease (the chart sets the pod's own, the release "
        "namespace); unset: the pod's service account namespace, else default.",
    )
    lease_duration_seconds: float = Field(
        default=15.0,
        ge=2,
        le=300,
        description="How long a Lease not renewed stays its holder's (client-go's default).",
    )
    renew_deadline_seconds: float = Field(
        default=10.0,
        ge=1,
        le=300,
        description="How long after its last renewal a holder still writes; less than the "
        "lease duration, so it stops before another replica may start.",
    )
    retry_period_seconds: float = Field(
        default=2.0, ge=0.1, le=60, description="How often the Lease is renewed or tried."
    )
    autoscaling_engine: Literal["keda", "hpa"] = Field(
        default="keda",
        description="What drives a pool's autoscaling roles: keda (a KEDA ScaledObject per "
        "role, Prometheus triggers, scale to zero) or hpa (a HorizontalPodAutoscaler on "
        "External metrics from the cluster's own adapter).",
    )
    prometheus_address: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        pattern=r"^https?://[^\s]+$",
        description="The Prometheus KEDA queries for pools' autoscaling signals (the "
        "cluster's, never a pool's: a pool cannot point KEDA elsewhere).",
    )
    kubeconfig: str | None = Field(
        default=None, description="Kubeconfig for running outside a cluster; in-cluster if unset."
    )

    @model_validator(mode="after")
    def _election_order(self) -> OperatorSettings:
        if not (
            self.retry_period_seconds < self.renew_deadline_seconds < self.lease_duration_seconds
        ):
            raise ValueError(
                "ENCODERPOOL_RETRY_PERIOD_SECONDS < ENCODERPOOL_RENEW_DEADLINE_SECONDS < "
                "ENCODERPOOL_LEASE_DURATION_SECONDS, or a holder could write after losing the lease"
            )
        return self

    def lease_namespace_or_own(self) -> str:
        """The Lease's namespace: the setting, else the pod's own, else default."""
        if self.lease_namespace:
            return self.lease_namespace
        try:
            with open(_SA_NAMESPACE) as f:
                return f.read().strip() or "default"
        except OSError:
            return "default"

"""The Helm chart's values as a pydantic model, and the generator of the chart's derived files.

    python -m encoderpool_operator.chartvalues charts/encoderpool-operator          # write
    python -m encoderpool_operator.chartvalues --check charts/encoderpool-operator  # 1 if stale

It writes three files that must never be edited by hand, so that they cannot
drift from their sources:

- ``values.schema.json`` from ``ChartValues``: Helm validates every install,
  upgrade, lint and template against it, so an unknown key or a bad value fails
  with a message naming it;
- ``files/rbac.json`` from ``rbac.PERMISSIONS`` (the templates render it);
- ``crds/encoderpool.io_encoderpools.yaml``, byte-identical to ``crds/`` at the
  repository root (``crdgen``).

``values.yaml`` is written by hand for its comments; tests/test_chart.py checks
that it equals ``ChartValues()``'s defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from encoderpool_operator import crdgen, rbac

_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a DNS-1123 label


class _Values(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Image(_Values):
    repository: str = Field(
        default="ghcr.io/encoderpool/encoderpool-operator",
        min_length=1,
        max_length=255,
        description="Operator image (docker/operator.Dockerfile); it also runs each pool's router.",
    )
    tag: str = Field(
        default="", max_length=128, description="Image tag; empty means the chart's appVersion."
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", alias="pullPolicy"
    )


class LocalObjectReference(_Values):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")


class ServiceAccount(_Values):
    # `helm lint` tolerates a template's `required`; the schema makes lint fail too.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"create": {"const": False}}},
            "then": {"properties": {"name": {"minLength": 1}}},
        }
    )

    create: bool = Field(default=True, description="Create the operator's ServiceAccount.")
    name: str = Field(
        default="",
        max_length=63,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        description="Its name; empty means the release's full name. Required to be an existing "
        "ServiceAccount when create is false.",
    )
    annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _named_when_not_created(self) -> ServiceAccount:
        if not self.create and not self.name:
            raise ValueError("serviceAccount.name: name an existing ServiceAccount")
        return self


class Rbac(_Values):
    create: bool = Field(
        default=True,
        description="Create the (Cluster)Role and binding from files/rbac.json; turn off only "
        "if you grant exactly those rules another way.",
    )


class Peering(_Values):
    name: str = Field(
        default="",
        max_length=63,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        description="kopf peering object the replicas coordinate through; empty means the "
        "release's full name. The chart creates it.",
    )


class Operator(_Values):
    resync_seconds: float = Field(
        default=60, ge=5, le=3600, alias="resyncSeconds", description="ENCODERPOOL_RESYNC_SECONDS"
    )
    width_retry_seconds: float = Field(
        default=30,
        ge=1,
        le=600,
        alias="widthRetrySeconds",
        description="ENCODERPOOL_WIDTH_RETRY_SECONDS",
    )
    router_image: str = Field(
        default="",
        max_length=512,
        alias="routerImage",
        description="ENCODERPOOL_ROUTER_IMAGE; empty means the operator image.",
    )


Quantity = str | int


def _requests() -> dict[str, Quantity]:
    return {"cpu": "50m", "memory": "128Mi"}


def _limits() -> dict[str, Quantity]:
    return {"memory": "256Mi"}


class Resources(_Values):
    requests: dict[str, Quantity] = Field(default_factory=_requests, max_length=16)
    limits: dict[str, Quantity] = Field(default_factory=_limits, max_length=16)


class ChartValues(_Values):
    """values.yaml of charts/encoderpool-operator."""

    name_override: str = Field(default="", max_length=63, alias="nameOverride")
    fullname_override: str = Field(default="", max_length=63, alias="fullnameOverride")
    scope: Literal["cluster", "namespace"] = Field(
        default="cluster",
        description="cluster: watch EncoderPools in every namespace (ClusterRole). namespace: "
        "only in the release namespace (a Role; no cluster-scoped permission at all).",
    )
    replica_count: int = Field(
        default=2,
        ge=1,
        le=5,
        alias="replicaCount",
        description="Operator pods; kopf peering keeps one active and the others standby.",
    )
    image: Image = Field(default_factory=Image)
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, alias="imagePullSecrets"
    )
    service_account: ServiceAccount = Field(default_factory=ServiceAccount, alias="serviceAccount")
    rbac: Rbac = Field(default_factory=Rbac)
    peering: Peering = Field(default_factory=Peering)
    operator: Operator = Field(default_factory=Operator)
    resources: Resources = Field(
        default_factory=Resources, description="The operator container's resources."
    )
    pod_annotations: dict[str, str] = Field(default_factory=dict, alias="podAnnotations")
    pod_labels: dict[str, str] = Field(default_factory=dict, alias="podLabels")
    priority_class_name: str = Field(default="", max_length=253, alias="priorityClassName")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, max_length=32)
    affinity: dict[str, Any] = Field(default_factory=dict)


def schema() -> dict[str, Any]:
    out = ChartValues.model_json_schema(by_alias=True, mode="validation")
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return out


def _derived() -> dict[str, str]:
    """Chart-relative path -> the text it must hold."""
    return {
        "values.schema.json": json.dumps(schema(), indent=2, sort_keys=True) + "\n",
        "files/rbac.json": rbac.render(),
        f"crds/{crdgen.FILENAME}": crdgen.render(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m encoderpool_operator.chartvalues")
    parser.add_argument("chart", type=Path, help="charts/encoderpool-operator")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in _derived().items():
        path = args.chart / rel
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run {parser.prog} {args.chart}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

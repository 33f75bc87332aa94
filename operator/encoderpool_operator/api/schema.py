"""Shared building blocks of the API types: the base model, CEL rules, small field types.

Cross-field rules live twice, side by side, so they cannot drift: a pydantic
validator (what the operator trusts) and a CEL rule in ``x-kubernetes-validations``
(what the API server enforces), with one message. ``cel`` builds the second.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

MODALITY_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"


def _utc_seconds(value: datetime) -> datetime:
    """Kubernetes times have second precision; normalizing keeps read-back equal."""
    return value.astimezone(timezone.utc).replace(microsecond=0)


Timestamp = Annotated[AwareDatetime, AfterValidator(_utc_seconds)]
Modality = Annotated[str, Field(pattern=MODALITY_PATTERN, max_length=32)]
ResourceName = Annotated[str, Field(min_length=1, max_length=253)]
Label = Annotated[str, Field(max_length=63)]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry; `field_path` points the error at a child field."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def cel_extra(*rules: dict[str, str]) -> dict[str, Any]:
    """`json_schema_extra` carrying CEL rules (for a model_config or a Field)."""
    return {"x-kubernetes-validations": list(rules)}


class ApiModel(BaseModel):
    """Frozen, strict about unknown keys, camelCase on the wire (as the CRD is)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

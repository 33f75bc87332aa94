"""Shared building blocks of the API types: the base model, validation rules, small field types.

A rule a JSON schema keyword cannot state (one field against another, a list against
a pattern, a new value against the stored one) is a ``Rule`` in its model's ``rules``
table, stated once: its CEL expression becomes an ``x-kubernetes-validations`` entry
of the model's schema (the API server enforces it at admission) and its ``check``
runs when the operator parses a pool, both refusing with the same message at the
same field::

    class Autoscaling(ApiModel):
        rules: ClassVar[tuple[Rule[Autoscaling], ...]] = (
            Rule(
                ".minReplicas",
                cel="self.minReplicas <= self.maxReplicas",
                check=lambda a: a.min_replicas <= a.max_replicas,
                message="minReplicas must not exceed maxReplicas: raise maxReplicas",
            ),
        )

tests/operator/api_cases.py then needs one invalid sample of it (RULE_CASES); the
tests check it on both sides.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Generic, TypeVar

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

MODALITY_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
# The `type` of the pydantic errors rules raise; `ctx.field_path` carries their field.
RULE_ERROR = "rule"


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


M = TypeVar("M")


@dataclass(frozen=True)
class Rule(Generic[M]):
    """One rule of a model, for the API server (``cel``) and the operator (``check``).

    ``field_path`` is the field the error names, relative to the model
    (``.capacity``), or "" for the model itself. ``cel`` sees the object as
    ``self`` with camelCase names (``oldSelf``: the stored object, on updates);
    ``check`` sees the parsed model and returns whether it is valid; it must
    accept exactly what ``cel`` accepts. ``message`` names the field and what
    to do. Either side may be None only where it cannot exist, and a comment
    beside the rule says why: a transition rule has no ``check`` (the operator
    never sees the stored object); a rule the API server applies through the
    schema (a list map's unique keys), or one whose CEL would exceed the API
    server's cost budget, has no ``cel``.
    """

    field_path: str
    cel: str | None
    check: Callable[[M], bool] | None
    message: str

    def __post_init__(self) -> None:
        assert self.cel or self.check, f"rule {self.message!r} has neither cel nor check"
        assert not self.field_path or self.field_path.startswith("."), self.field_path

    def holds(self, value: M) -> bool:
        """Whether ``value`` passes ``check`` (a rule without one: the API server's alone)."""
        return self.check is None or self.check(value)

    def entry(self) -> dict[str, str]:
        """The rule's ``x-kubernetes-validations`` entry."""
        assert self.cel is not None
        return cel(self.cel, self.message, self.field_path)

    def error(self) -> PydanticCustomError:
        """What the operator raises: the message, the field in ``ctx.field_path``."""
        return PydanticCustomError(RULE_ERROR, self.message, {"field_path": self.field_path})


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

    # The model's rules (see Rule): CEL in its schema, checks after its fields parse.
    rules: ClassVar[tuple[Rule[Any], ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> ApiModel:
        for rule in self.rules:
            if not rule.holds(self):
                raise rule.error()
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(core_schema)
        entries = [rule.entry() for rule in cls.rules if rule.cel is not None]
        if entries:
            target = handler.resolve_ref_schema(json_schema)
            target["x-kubernetes-validations"] = [
                *target.get("x-kubernetes-validations", []),
                *entries,
            ]
        return json_schema


# ----------------------------------------------------------------------------- shared by spec parts

# DNS-1123 subdomain (object names such as PVCs, Secrets).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A map key that is a label or annotation key (an optional DNS prefix, '/', a name).
LabelKey = Annotated[str, Field(max_length=317)]


# A path inside a volume: segments separated by single '/', none of them '.' or '..',
# so it can never leave the volume it is joined to.
RELATIVE_PATH_PATTERN = r"^[^/]+(/[^/]+)*$"
DOT_SEGMENT_PATTERN = r"(^|/)[.][.]?(/|$)"
RELATIVE_PATH_TEXT = "a relative path inside the volume (no leading '/', no '.' or '..' segments)"


def is_inside(path: str) -> bool:
    """``path`` is relative and stays inside the volume it is joined to."""
    return bool(re.match(RELATIVE_PATH_PATTERN, path)) and not re.search(DOT_SEGMENT_PATTERN, path)


def cel_is_inside(expr: str) -> str:
    """CEL for ``is_inside(expr)``."""
    return f"{expr}.matches('{RELATIVE_PATH_PATTERN}') && !{expr}.matches('{DOT_SEGMENT_PATTERN}')"


class LocalObjectReference(ApiModel):
    """A reference to an object in the pool's namespace."""

    name: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253, description="Object name."
    )


class SecretKeySelector(ApiModel):
    """One key of a Secret in the pool's namespace."""

    name: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253, description="Secret name."
    )
    key: str = Field(
        pattern=r"^[-._a-zA-Z0-9]+$",
        min_length=1,
        max_length=253,
        description="Key in the Secret's data.",
    )

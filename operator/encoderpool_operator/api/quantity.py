"""Kubernetes quantities ("10Gi", "500m"): the field type, exact parsing, byte ranges.

A ``Quantity`` field accepts what the API server accepts (a string or an
integer) and stores a string; ``ByteRange`` bounds it both here and, through a
CEL rule, in the API server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    WithJsonSchema,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from encoderpool_operator.api.schema import cel

# Kubernetes resource.Quantity, non-negative (the API server's own regex, sign dropped).
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

_QUANTITY_SUFFIX: dict[str, Decimal] = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY_SPLIT = re.compile(r"^([0-9.]+)([eE][-+]?[0-9.]+|[KMGTPE]i|[numkMGTPE])?$")


def parse_quantity(quantity: str | int) -> Decimal:
    """The value of a Kubernetes quantity ("10Gi", "500m", 3), exactly."""
    text = str(quantity)
    match = _QUANTITY_SPLIT.match(text)
    if match is None or not re.match(QUANTITY_PATTERN, text):
        raise ValueError(f"{text!r} is not a Kubernetes quantity such as 10Gi or 500m")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if len(suffix) > 1 and suffix[0] in "eE":  # an exponent; a lone E is exa
        return number * Decimal(10) ** Decimal(suffix[1:])
    return number * _QUANTITY_SUFFIX[suffix]


def quantity_bytes(quantity: str | int) -> int:
    """A quantity as a whole number of bytes ("1Gi" -> 1073741824)."""
    value = parse_quantity(quantity)
    if value != value.to_integral_value():
        raise ValueError(f"{quantity!r} is not a whole number of bytes")
    return int(value)


def _int_as_quantity(value: object) -> object:
    """YAML writes `nvidia.com/gpu: 1` as an integer; the API server accepts both."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


@dataclass(frozen=True)
class ByteRange:
    """Annotation for a Quantity of bytes: checked here and, by CEL, in the API server."""

    low: int
    high: int

    @property
    def message(self) -> str:
        return f"must be between {_human(self.low)} and {_human(self.high)}"

    def _check(self, value: str) -> str:
        if not self.low <= quantity_bytes(value) <= self.high:
            raise ValueError(f"{value!r} {self.message}")
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = dict(handler(schema))
        q = "quantity(string(self))"
        rule = (
            f"{q}.compareTo(quantity('{_human(self.low)}')) >= 0 && "
            f"{q}.compareTo(quantity('{_human(self.high)}')) <= 0"
        )
        json_schema["x-kubernetes-validations"] = [cel(rule, self.message)]
        return json_schema


def _human(n: int) -> str:
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_QUANTITY_SUFFIX[suffix])
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


# A Kubernetes quantity: a string ("10Gi") or an integer (1), stored as a string.
Quantity = Annotated[
    str,
    BeforeValidator(_int_as_quantity),
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "minimum": 0,
            "pattern": QUANTITY_PATTERN,
            "maxLength": 64,
            "x-kubernetes-int-or-string": True,
        }
    ),
]

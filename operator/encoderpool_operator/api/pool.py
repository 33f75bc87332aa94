"""The ``EncoderPool`` object (encoderpool.io/v1alpha1): its names, metadata rules and parsing.

``from_object`` is the one way the operator turns what the API server (or kopf)
hands it into a typed pool, with errors naming the object and each field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from encoderpool_operator.api.schema import RULE_ERROR, ApiModel, Rule
from encoderpool_operator.api.spec import EncoderPoolSpec
from encoderpool_operator.api.status import EncoderPoolStatus

GROUP = "encoderpool.io"
VERSION = "v1alpha1"
API_VERSION: Final = "encoderpool.io/v1alpha1"
KIND: Final = "EncoderPool"
PLURAL = "encoderpools"
SINGULAR = "encoderpool"
SHORT_NAMES = ("epool",)  # `ep` is taken by Endpoints
CRD_NAME = f"{PLURAL}.{GROUP}"

# Children are named `<pool>-<role>` (Services need DNS-1035 labels of at most
# 63 characters), so the pool's own name leaves room for the longest suffix.
MAX_NAME_LENGTH = 50
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


# The CRD may constrain metadata.name only: encoderpool_codegen.crd puts this rule's CEL
# there, and EncoderPool checks it on the name it is handed.
METADATA_NAME_RULE: Rule[str] = Rule(
    "",
    cel=f"size(self) <= {MAX_NAME_LENGTH} && self.matches('{NAME_PATTERN}')",
    check=lambda name: len(name) <= MAX_NAME_LENGTH and bool(re.match(NAME_PATTERN, name)),
    message="must be a DNS-1035 label (lowercase letters, digits, '-', starting with a "
    f"letter) of at most {MAX_NAME_LENGTH} characters: child objects are named <name>-<role>",
)


class EncoderPool(ApiModel):
    """A pool of vLLM encoder producers and LM consumers wired by an encoder-cache connector."""

    # model_validate(obj) takes what the API server returns; from_object also
    # takes kopf's mapping views and names the object in its error.
    api_version: Literal["encoderpool.io/v1alpha1"] = Field(
        default=API_VERSION, description="encoderpool.io/v1alpha1."
    )
    kind: Literal["EncoderPool"] = Field(default=KIND, description="EncoderPool.")
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Standard object metadata (kept as the server sent it)."
    )
    spec: EncoderPoolSpec = Field(description="Desired state.")
    status: EncoderPoolStatus = Field(
        default_factory=EncoderPoolStatus, description="Observed state."
    )

    @field_validator("metadata")
    @classmethod
    def _name(cls, value: dict[str, Any]) -> dict[str, Any]:
        name = value.get("name")
        if name is not None and not METADATA_NAME_RULE.holds(str(name)):
            raise PydanticCustomError(
                RULE_ERROR, METADATA_NAME_RULE.message, {"field_path": ".name"}
            )
        return value

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace", ""))

    @property
    def generation(self) -> int | None:
        generation = self.metadata.get("generation")
        return int(generation) if generation is not None else None

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> EncoderPool:
        """Parse an object from the API server or kopf (nested mappings welcome).

        Raises ValueError naming the object and each bad field (camelCase paths),
        fit for kopf.PermanentError and a Ready=False condition message.
        """
        plain = _plain(obj)
        try:
            return cls.model_validate(plain)
        except ValidationError as e:
            meta = plain.get("metadata") if isinstance(plain, dict) else None
            meta = meta if isinstance(meta, dict) else {}
            who = f"{meta.get('namespace', '')}/{meta.get('name', '?')}".lstrip("/")
            raise ValueError(f"{KIND} {who} is invalid: {format_errors(e)}") from None


def format_errors(error: ValidationError) -> str:
    """`spec.producer.tolerations[0].value: <what is wrong>; ...`, paths spelled as the
    API server spells them (camelCase, list indices in brackets).

    A rule's error names the field the rule points at (``ctx.field_path``), as the
    API server's does.
    """
    return "; ".join(f"{_path(err)}: {err['msg']}" for err in error.errors())


def _path(err: ErrorDetails) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
    if err["type"] == RULE_ERROR:
        path += str(err.get("ctx", {}).get("field_path", ""))
    return path.lstrip(".") or "<object>"


def _plain(value: Any) -> Any:
    """kopf hands out Mapping views; pydantic wants dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value

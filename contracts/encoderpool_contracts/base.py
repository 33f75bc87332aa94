"""The base every contract model shares: frozen, and unknown keys rejected."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Immutable once parsed; a key the model does not know is an error, not ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")

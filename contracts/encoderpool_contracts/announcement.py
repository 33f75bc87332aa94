"""The announcement a producer attaches to each item it encoded, in ``ec_transfer_params``.

A producer's response carries ``ec_transfer_params = {mm_hash: item}``, where
``item`` is vLLM's placeholder metadata plus ``item["encoderpool"]``, an
``Announcement``: the item is on its way (shared volume) or lies at these
coordinates (rdma). The router merges the items of a request's producers and
sets them on the consumer request (dropping any a client sent); the consumer
reads the announcement of each item it schedules. Producer, router and
consumer use this one model, so the envelope cannot drift; to a consumer it is
hostile input, parsed and never trusted. The rdma coordinates inside are the
rdma transport's own format (``encoderpool_connector.rdma.channel``), validated there.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from encoderpool_contracts.base import Frozen

# The request/response field vLLM carries the params in, and our key inside each item.
EC_TRANSFER_PARAMS = "ec_transfer_params"
ANNOUNCE_KEY = "encoderpool"


class Announcement(Frozen):
    """What a producer says about one item it encoded. Version 1."""

    v: Literal[1] = Field(default=1, description="Format version.")
    fingerprint: str = Field(
        pattern=r"^[0-9a-f]{16}$",
        description="The producer's model fingerprint; a consumer of another model ignores it.",
    )
    rdma: dict[str, Any] | None = Field(
        default=None,
        description="rdma transport only: where the item lies in the producer's registered "
        "memory (coordinates JSON). Absent when the producer could not offer it.",
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict a producer sets as ``item["encoderpool"]``."""
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def parse(cls, raw: Any) -> Announcement:
        """The announcement as received; ValueError naming each bad field otherwise."""
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                for err in e.errors()
            )
            raise ValueError(f"announcement: {problems}"[:300]) from None


def raw_announcement(params: Any, mm_hash: str) -> Any:
    """The item's announcement as received, unparsed; None when the item carries none."""
    item = params.get(mm_hash) if isinstance(params, dict) else None
    return item.get(ANNOUNCE_KEY) if isinstance(item, dict) else None


def announce(item: dict[str, Any], announcement: Announcement) -> None:
    """Attach ``announcement`` to one item of a producer's ``ec_transfer_params``."""
    item[ANNOUNCE_KEY] = announcement.to_wire()

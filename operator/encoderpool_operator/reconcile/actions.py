"""The writes a plan asks for: plain data, so a test can read a plan like a list of commands.

Each names its object in the pool's namespace; ``act`` carries them out in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias


@dataclass(frozen=True)
class Apply:
    """Server-side apply ``obj`` as the operator's field manager (creating it if missing)."""

    obj: dict[str, Any]

    def describe(self) -> str:
        return f"{self.obj['kind']}/{self.obj['metadata']['name']}"


@dataclass(frozen=True)
class Create:
    """Create ``obj``; if it appeared meanwhile it is left alone (the next pass sees it)."""

    obj: dict[str, Any]

    def describe(self) -> str:
        return f"{self.obj['kind']}/{self.obj['metadata']['name']} (created)"


@dataclass(frozen=True)
class CreateSecret:
    """Create Secret ``obj`` holding a fresh random value under each of ``random_keys``;
    one that exists already is left as it is (a 409: its values stay).

    The values are made by ``act`` when it writes, so a plan (pure, and read by tests
    and logs) never holds them, and the operator never reads the Secret back.
    """

    obj: dict[str, Any]
    random_keys: tuple[str, ...]

    def describe(self) -> str:
        return f"Secret/{self.obj['metadata']['name']} (created unless it exists)"


@dataclass(frozen=True)
class _Named:
    """An existing object, by name, and why it is written (for the log)."""

    api_version: str
    kind: str
    name: str
    why: str


@dataclass(frozen=True)
class MergePatch(_Named):
    """A JSON merge patch; with ``metadata.resourceVersion`` in ``body`` it fails on a race.

    ``strategic``: a strategic merge patch instead (built-in kinds only), which merges
    lists such as ownerReferences by key, so concurrent writers need no guard.
    """

    body: dict[str, Any]
    strategic: bool = False

    def describe(self) -> str:
        return f"{self.kind}/{self.name} ({self.why})"


@dataclass(frozen=True)
class Delete(_Named):
    """Delete with background propagation (owned pods go with it); a missing one is fine."""

    def describe(self) -> str:
        return f"{self.kind}/{self.name} (deleted: {self.why})"


@dataclass(frozen=True)
class PatchStatus:
    """Merge-patch the pool's status subresource with ``body``."""

    body: dict[str, Any]

    def describe(self) -> str:
        return "status"


Action: TypeAlias = Apply | Create | CreateSecret | MergePatch | Delete | PatchStatus

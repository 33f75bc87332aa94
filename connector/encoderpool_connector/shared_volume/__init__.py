"""encoderpool's shared-volume EC connector, loaded by vLLM out of tree.

    --ec-transfer-config '{"ec_connector": "EncoderPoolSharedVolumeConnector",
      "ec_connector_module_path": "encoderpool_connector.shared_volume",
      "ec_role": "ec_producer" | "ec_consumer",
      "ec_connector_extra_config": <ConnectorConfig JSON>}'

Producers publish each encoder output as one checksummed file (``entry``) in
a directory every pod of the pool mounts (``store``); consumers verify, pin and
load it (``scheduler``, ``worker``; large payloads in parts, ``split``). Like the
rdma transport it is built on ``encoderpool_connector.core`` (the connector class,
``connector``, subclasses its ``RoleRoutingConnector``), with its own ``metadata``
and ``stats``. The connector class is resolved on first access, so ``entry`` and
``store`` (which import neither torch nor vLLM) can be imported alone by benchmarks
and tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from encoderpool_connector.shared_volume.connector import EncoderPoolSharedVolumeConnector

__all__ = ["EncoderPoolSharedVolumeConnector"]


def __getattr__(name: str) -> Any:
    """vLLM's factory does ``getattr(import_module(path), class_name)``: import it then."""
    if name == "EncoderPoolSharedVolumeConnector":
        from encoderpool_connector.shared_volume.connector import (
            EncoderPoolSharedVolumeConnector,
        )

        return EncoderPoolSharedVolumeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

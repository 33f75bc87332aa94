"""encoderpool's RDMA EC connector (NIXL over UCX), loaded by vLLM out of tree.

    --ec-transfer-config '{"ec_connector": "EncoderPoolNixlConnector",
      "ec_connector_module_path": "encoderpool_connector.rdma",
      "ec_role": "ec_producer" | "ec_consumer",
      "ec_connector_extra_config": <ConnectorConfig JSON, transport "rdma">}'

Producers keep encoder outputs in NIXL-registered host memory (``buffer``) and
return their coordinates in ``ec_transfer_params`` (``channel``: coordinates,
release notices, the side channel); the router hands those to the consumer,
which pulls each item with a NIXL READ before scheduling it (``transfer``).
UCX picks verbs on RDMA NICs and TCP or shared memory elsewhere (``UCX_TLS``).
Messages are signed with the pool's key (``auth``). Like the shared-volume
transport it is built on ``encoderpool_connector.core`` (the connector class,
``connector``, subclasses its ``RoleRoutingConnector``; ``scheduler`` and ``worker``
are the two roles, the scheduler split into ``scheduler_producer`` and
``scheduler_consumer``, the worker's saves written by ``writer``), with its own
``metadata`` and ``stats``. The connector class is
resolved on first access, so ``buffer`` and ``channel`` (no torch, no vLLM) can be
imported alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from encoderpool_connector.rdma.connector import EncoderPoolNixlConnector

__all__ = ["EncoderPoolNixlConnector"]


def __getattr__(name: str) -> Any:
    """vLLM's factory does ``getattr(import_module(path), class_name)``: import it then."""
    if name == "EncoderPoolNixlConnector":
        from encoderpool_connector.rdma.connector import EncoderPoolNixlConnector

        return EncoderPoolNixlConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

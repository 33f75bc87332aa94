"""``EncoderPoolNixlConnector``: the class vLLM loads for the rdma transport.

The class is named for NIXL, the library that moves the bytes, because that name is a
contract between images (``encoderpool_contracts.pod.CONNECTOR_CLASSES``); every other
name in this transport says rdma, and nixl only where it means the library itself.

The scheduler side (slots, coordinates, pulls, the NIXL agents) lives in
``scheduler``, which hands each call to its producer and consumer roles
(``scheduler_producer``, ``scheduler_consumer``); the worker side (copies in and
out of the shared region, the producer's writer thread) in ``worker`` and
``writer``; torch is imported only by the worker side. The producer
advertises the host in env ``ENCODERPOOL_ADVERTISE_HOST`` (the pod IP; default
127.0.0.1). Both roles sign and check with the pool's key in env
``ENCODERPOOL_CHANNEL_KEY`` (``auth``); without it they run unauthenticated, warned.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, ClassVar

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorRole

from encoderpool_connector.core.routing import RoleRoutingConnector
from encoderpool_connector.core.startup import encoder_widths
from encoderpool_connector.rdma.metadata import RdmaMetadata
from encoderpool_contracts import ADVERTISE_HOST_ENV

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from encoderpool_connector.core.stats import CounterPromMetrics, CounterStats
    from encoderpool_connector.rdma.scheduler import RdmaScheduler
    from encoderpool_connector.rdma.worker import RdmaWorker

logger = logging.getLogger("vllm.ext." + __name__)


def advertise_host() -> str:
    """The address consumers reach this producer at: env ENCODERPOOL_ADVERTISE_HOST."""
    from encoderpool_connector.rdma.channel import valid_host

    host = os.environ.get(ADVERTISE_HOST_ENV, "").strip() or "127.0.0.1"
    if not valid_host(host):
        raise ValueError(
            f"env {ADVERTISE_HOST_ENV}={host!r} is not an IP address or DNS name; "
            "set it to the pod IP (downward API status.podIP)"
        )
    return host


class EncoderPoolNixlConnector(RoleRoutingConnector):
    """Encoder outputs pulled from producers' registered memory with NIXL READs."""

    transport: ClassVar[str] = "rdma"
    metadata_class: ClassVar[type[ECConnectorMetadata]] = RdmaMetadata

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        rd = self.config.rdma
        assert rd is not None
        logger.info(
            "encoderpool rdma connector: role=%s producer=%s consumer=%s buffer=%d "
            "side_channel_port=%d fingerprint=%s UCX_TLS=%s",
            role.name,
            self.is_producer,
            self.is_consumer,
            rd.buffer_bytes,
            rd.side_channel_port,
            self.config.model_fingerprint,
            os.environ.get("UCX_TLS", "<all>"),
        )

    def _make_scheduler(self, vllm_config: VllmConfig) -> RdmaScheduler:
        from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

        from encoderpool_connector.rdma.auth import warn_unauthenticated
        from encoderpool_connector.rdma.scheduler import RdmaScheduler
        from encoderpool_contracts import dtype_name
        from encoderpool_contracts.integrity import ChannelKey

        key = ChannelKey.from_env()
        if key is None:
            warn_unauthenticated("producer" if self.is_producer else "consumer")
        widths = encoder_widths(self.config, vllm_config, producer=self.is_producer)
        return RdmaScheduler(
            self.config,
            is_producer=self.is_producer,
            is_consumer=self.is_consumer,
            model_dtype=dtype_name(vllm_config.model_config.dtype),
            widths=widths,
            metadata_resolver=PlaceholderMetadataResolver(vllm_config.model_config),
            advertise_host=advertise_host() if self.is_producer else "127.0.0.1",
            channel_key=key,
        )

    def _make_worker(self, vllm_config: VllmConfig) -> RdmaWorker:
        from encoderpool_connector.rdma.worker import RdmaWorker

        return RdmaWorker(self.config, is_producer=self.is_producer, is_consumer=self.is_consumer)

    @staticmethod
    def _stats_classes() -> tuple[type[CounterStats], type[CounterPromMetrics]]:
        from encoderpool_connector.rdma.stats import RdmaPromMetrics, RdmaStats

        return RdmaStats, RdmaPromMetrics

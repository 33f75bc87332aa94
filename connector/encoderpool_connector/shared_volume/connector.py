"""``EncoderPoolSharedVolumeConnector``: the class vLLM loads for the shared-volume transport.

The scheduler side (lookups, verification, placeholder metadata) lives in
``scheduler``, the worker side (background writer, loads) in ``worker``;
torch is imported only by the worker side. This module exports exactly one
connector class, with a name vLLM's built-in registry does not use.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorRole

from encoderpool_connector.core.routing import RoleRoutingConnector
from encoderpool_connector.core.startup import encoder_widths
from encoderpool_connector.shared_volume.metadata import SharedVolumeMetadata
from encoderpool_connector.shared_volume.store import SharedStore
from encoderpool_contracts.integrity import ChannelKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from encoderpool_connector.core.stats import CounterPromMetrics, CounterStats
    from encoderpool_connector.shared_volume.scheduler import SharedVolumeScheduler
    from encoderpool_connector.shared_volume.worker import SharedVolumeWorker

logger = logging.getLogger("vllm.ext." + __name__)


class EncoderPoolSharedVolumeConnector(RoleRoutingConnector):
    """Encoder outputs through a directory every producer and consumer mounts."""

    transport: ClassVar[str] = "sharedVolume"
    metadata_class: ClassVar[type[ECConnectorMetadata]] = SharedVolumeMetadata

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        sv = self.config.shared_volume
        assert sv is not None
        logger.info(
            "encoderpool shared-volume connector: role=%s producer=%s consumer=%s root=%s "
            "capacity=%d eviction=%s fingerprint=%s signed entries=%s",
            role.name,
            self.is_producer,
            self.is_consumer,
            sv.root,
            sv.capacity_bytes,
            sv.eviction,
            self.config.model_fingerprint,
            ChannelKey.from_env() is not None,
        )

    def _store(self) -> SharedStore:
        sv = self.config.shared_volume
        assert sv is not None
        # The pool's key (the rdma transport's channel key): entries are signed with it,
        # and a consumer with it serves no entry without a valid mac.
        return SharedStore(sv.root, sv.capacity_bytes, sv.eviction, ChannelKey.from_env())

    def _make_scheduler(self, vllm_config: VllmConfig) -> SharedVolumeScheduler:
        from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

        from encoderpool_connector.shared_volume.scheduler import SharedVolumeScheduler
        from encoderpool_contracts import dtype_name

        widths = encoder_widths(self.config, vllm_config, producer=self.is_producer)
        return SharedVolumeScheduler(
            self.config,
            self._store(),
            is_producer=self.is_producer,
            is_consumer=self.is_consumer,
            model_dtype=dtype_name(vllm_config.model_config.dtype),
            widths=widths,
            metadata_resolver=PlaceholderMetadataResolver(vllm_config.model_config),
        )

    def _make_worker(self, vllm_config: VllmConfig) -> SharedVolumeWorker:
        from encoderpool_connector.shared_volume.worker import SharedVolumeWorker

        return SharedVolumeWorker(
            self.config, self._store(), is_producer=self.is_producer, is_consumer=self.is_consumer
        )

    @staticmethod
    def _stats_classes() -> tuple[type[CounterStats], type[CounterPromMetrics]]:
        from encoderpool_connector.shared_volume.stats import (
            SharedVolumePromMetrics,
            SharedVolumeStats,
        )

        return SharedVolumeStats, SharedVolumePromMetrics

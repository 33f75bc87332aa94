"""encoderpool's shared-volume EC connector, loaded by vLLM out of tree.

    --ec-transfer-config '{"ec_connector": "EncoderPoolSharedVolumeConnector",
      "ec_connector_module_path": "encoderpool_connector.shared_volume",
      "ec_role": "ec_producer" | "ec_consumer",
      "ec_connector_extra_config": <ConnectorConfig JSON>}'

The class routes by role, like vLLM's own connectors: the scheduler side
(lookups, verification, placeholder metadata) lives in ``sv_scheduler``, the
worker side (background writer, loads) in ``sv_worker``; torch is imported only
by the worker side. This module exports exactly one connector class, with a
name vLLM's built-in registry does not use.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from encoderpool_connector.startup import measured_widths, parse_config
from encoderpool_connector.store import SharedStore

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
    from vllm.distributed.ec_transfer.ec_connector.metrics import (
        ECConnectorPromMetrics,
        ECConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from encoderpool_connector.sv_scheduler import SharedVolumeScheduler
    from encoderpool_connector.sv_worker import SharedVolumeWorker

logger = logging.getLogger("vllm.ext." + __name__)


class EncoderPoolSharedVolumeConnector(ECConnectorBase):  # type: ignore[misc]  # untyped base
    """Encoder outputs through a directory every producer and consumer mounts."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self.config = parse_config(vllm_config, "sharedVolume", "EncoderPoolSharedVolumeConnector")
        sv = self.config.shared_volume
        assert sv is not None
        store = SharedStore(sv.root, sv.capacity_bytes, sv.eviction)
        self._scheduler: SharedVolumeScheduler | None = None
        self._worker: SharedVolumeWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config, store)
        else:
            from encoderpool_connector.sv_worker import SharedVolumeWorker

            self._worker = SharedVolumeWorker(
                self.config, store, is_producer=self.is_producer, is_consumer=self.is_consumer
            )
        logger.info(
            "encoderpool shared-volume connector: role=%s producer=%s consumer=%s root=%s "
            "capacity=%d eviction=%s fingerprint=%s",
            role.name,
            self.is_producer,
            self.is_consumer,
            sv.root,
            sv.capacity_bytes,
            sv.eviction,
            self.config.model_fingerprint,
        )

    def _make_scheduler(self, vllm_config: VllmConfig, store: SharedStore) -> SharedVolumeScheduler:
        from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

        from encoderpool_connector.contracts import dtype_name
        from encoderpool_connector.sv_scheduler import SharedVolumeScheduler

        measured = measured_widths(self.config, vllm_config)
        return SharedVolumeScheduler(
            self.config,
            store,
            is_producer=self.is_producer,
            is_consumer=self.is_consumer,
            model_dtype=dtype_name(vllm_config.model_config.dtype),
            measured_widths=measured,
            metadata_resolver=PlaceholderMetadataResolver(vllm_config.model_config),
        )

    # ---- worker side ----

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        from encoderpool_connector.metadata import SharedVolumeMetadata

        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SharedVolumeMetadata)
        if self._worker.is_consumer:
            self._worker.start_load_caches(encoder_cache, metadata)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_caches(encoder_cache, mm_hash)

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        if self._worker is not None:
            return self._worker.get_ec_connector_stats()
        assert self._scheduler is not None
        return self._scheduler.stats.take()

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.build_connector_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- scheduler side ----

    def has_cache_item(self, identifier: str) -> bool:
        assert self._scheduler is not None
        return self._scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        assert self._scheduler is not None
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta()

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.ec_connector_worker_meta)

    def take_unavailable_requests(self) -> set[str]:
        assert self._scheduler is not None
        return self._scheduler.take_unavailable_requests()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return False, self._scheduler.request_finished(request)

    # ---- stats and metrics (built in the API server process) ----

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats:
        from encoderpool_connector.stats import EncoderPoolECStats

        return EncoderPoolECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics:
        from encoderpool_connector.stats import EncoderPoolPromMetrics

        return EncoderPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

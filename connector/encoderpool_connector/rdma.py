"""encoderpool's RDMA EC connector (NIXL over UCX), loaded by vLLM out of tree.

    --ec-transfer-config '{"ec_connector": "EncoderPoolNixlConnector",
      "ec_connector_module_path": "encoderpool_connector.rdma",
      "ec_role": "ec_producer" | "ec_consumer",
      "ec_connector_extra_config": <ConnectorConfig JSON, transport "rdma">}'

Producers keep encoder outputs in NIXL-registered host memory and return
their coordinates in ``ec_transfer_params``; the router hands those to the
consumer, which pulls each item with a NIXL READ before scheduling it. UCX
picks verbs on RDMA NICs and TCP or shared memory elsewhere (``UCX_TLS``).

The class routes by role like vLLM's own connectors: ``rdma_scheduler`` (slots,
coordinates, pulls, the NIXL agents) and ``rdma_worker`` (copies in and out of
the shared region); torch is imported only by the worker side. The producer
advertises the host in env ``ENCODERPOOL_ADVERTISE_HOST`` (the pod IP; default
127.0.0.1).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from encoderpool_connector.startup import measured_widths, parse_config

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

    from encoderpool_connector.rdma_scheduler import RdmaScheduler
    from encoderpool_connector.rdma_worker import RdmaWorker

logger = logging.getLogger("vllm.ext." + __name__)

ADVERTISE_ENV = "ENCODERPOOL_ADVERTISE_HOST"


def advertise_host() -> str:
    """The address consumers reach this producer at: env ENCODERPOOL_ADVERTISE_HOST."""
    from encoderpool_connector.rdma_channel import valid_host

    host = os.environ.get(ADVERTISE_ENV, "").strip() or "127.0.0.1"
    if not valid_host(host):
        raise ValueError(
            f"env {ADVERTISE_ENV}={host!r} is not an IP address or DNS name; set it to the "
            "pod IP (downward API status.podIP)"
        )
    return host


def _tp_rank() -> int:
    """This worker's tensor-parallel rank: every rank holds the same encoder output, and only
    rank 0 copies it (the scheduler may read the slot before other ranks finish their step)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised: a single worker
        return 0


class EncoderPoolNixlConnector(ECConnectorBase):  # type: ignore[misc]  # untyped base
    """Encoder outputs pulled from producers' registered memory with NIXL READs."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self.config = parse_config(vllm_config, "rdma", "EncoderPoolNixlConnector")
        self._scheduler: RdmaScheduler | None = None
        self._worker: RdmaWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config)
        else:
            from encoderpool_connector.rdma_worker import RdmaWorker

            self._worker = RdmaWorker(
                self.config,
                is_producer=self.is_producer,
                is_consumer=self.is_consumer,
                writer=_tp_rank() == 0,
            )
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

        from encoderpool_connector.contracts import dtype_name
        from encoderpool_connector.rdma_scheduler import RdmaScheduler

        measured = measured_widths(self.config, vllm_config)
        return RdmaScheduler(
            self.config,
            is_producer=self.is_producer,
            is_consumer=self.is_consumer,
            model_dtype=dtype_name(vllm_config.model_config.dtype),
            widths={**measured, **self.config.encoder_output_widths},
            metadata_resolver=PlaceholderMetadataResolver(vllm_config.model_config),
            advertise_host=advertise_host() if self.is_producer else "127.0.0.1",
        )

    # ---- worker side ----

    def _metadata(self) -> Any:
        from encoderpool_connector.rdma_meta import RdmaMetadata

        metadata = self._get_connector_metadata()
        assert isinstance(metadata, RdmaMetadata)
        return metadata

    def start_save_caches(self, **kwargs: Any) -> None:
        assert self._worker is not None
        encoder_cache = kwargs.get("encoder_cache")
        if self._worker.is_producer and isinstance(encoder_cache, dict):
            self._worker.start_save_caches(encoder_cache, self._metadata())

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        if self._worker.is_producer:
            self._worker.save_caches(encoder_cache, mm_hash)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        assert self._worker is not None
        if self._worker.is_consumer:
            self._worker.start_load_caches(encoder_cache, self._metadata())

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
        return self._scheduler.build_connector_meta(scheduler_output)

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
        from encoderpool_connector.rdma_meta import RdmaECStats

        return RdmaECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics:
        from encoderpool_connector.rdma_meta import RdmaPromMetrics

        return RdmaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

"""The role-routing ``ECConnectorBase`` both transports build on.

vLLM builds one connector object per role: the scheduler's (engine core) and
one per worker (model runner). Like vLLM's own connectors, ours route each
call to a delegate for that role: a transport supplies ``_make_scheduler``
and ``_make_worker`` and nothing else routes. Worker-only imports (torch) stay
inside ``_make_worker``, so the scheduler process never loads them for us.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from encoderpool_connector.core.startup import parse_config

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

    from encoderpool_connector.core.stats import CounterPromMetrics, CounterStats

logger = logging.getLogger("vllm.ext." + __name__)


class SchedulerSide(Protocol):
    """What a transport's scheduler delegate answers (see ``ECConnectorBase``)."""

    @property
    def stats(self) -> CounterStats: ...

    def has_cache_item(self, identifier: str) -> bool: ...

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool: ...

    def update_state_after_alloc(self, request: Request, index: int) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata: ...

    def update_connector_output(self, worker_meta: Any) -> None: ...

    def take_unavailable_requests(self) -> set[str]: ...

    def request_finished(self, request: Request) -> dict[str, Any] | None: ...

    def shutdown(self) -> None: ...


class WorkerSide(Protocol):
    """What a transport's worker delegate does (see ``ECConnectorBase``)."""

    @property
    def is_producer(self) -> bool: ...

    @property
    def is_consumer(self) -> bool: ...

    def start_save_caches(
        self, encoder_cache: dict[str, torch.Tensor], metadata: ECConnectorMetadata
    ) -> None: ...

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None: ...

    def start_load_caches(
        self, encoder_cache: dict[str, torch.Tensor], metadata: ECConnectorMetadata
    ) -> None: ...

    def get_ec_connector_stats(self) -> ECConnectorStats | None: ...

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None: ...

    def shutdown(self) -> None: ...


class RoleRoutingConnector(ECConnectorBase):  # type: ignore[misc]  # untyped base
    """Parses the config once, builds the delegate of this role, routes every call to it."""

    transport: ClassVar[str]
    """``ConnectorConfig.transport`` this connector serves."""
    metadata_class: ClassVar[type[ECConnectorMetadata]]
    """What the scheduler side sends the worker each step."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self.config = parse_config(vllm_config, self.transport, type(self).__name__)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config)
        else:
            self._worker = self._make_worker(vllm_config)

    @abstractmethod
    def _make_scheduler(self, vllm_config: VllmConfig) -> SchedulerSide: ...

    @abstractmethod
    def _make_worker(self, vllm_config: VllmConfig) -> WorkerSide: ...

    @staticmethod
    @abstractmethod
    def _stats_classes() -> tuple[type[CounterStats], type[CounterPromMetrics]]:
        """The transport's counter classes (imported when vLLM first asks for them)."""

    # ---- worker side ----

    def _metadata(self) -> ECConnectorMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, self.metadata_class), type(metadata)
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
        stats_class, _ = cls._stats_classes()
        return stats_class(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics:
        _, prom_class = cls._stats_classes()
        return prom_class(vllm_config, metric_types, labelnames, per_engine_labelvalues)

"""Scheduler side of the RDMA connector: the region both roles share, and a delegate per role.

``RdmaScheduler`` is what the connector class routes to. It owns the registered
region, its slot allocator and the counters, and hands each vLLM call to the
producer role (``scheduler_producer``: slots, write plans, coordinates, releases)
and the consumer role (``scheduler_consumer``: pulls and loads), whichever this
engine has; an engine with both shares one region and one allocator between them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from encoderpool_connector.rdma.buffer import SharedRegion, SlotAllocator
from encoderpool_connector.rdma.metadata import RdmaMetadata, RdmaWorkerMetadata
from encoderpool_connector.rdma.scheduler_consumer import RdmaConsumerScheduler
from encoderpool_connector.rdma.scheduler_producer import RdmaProducerScheduler
from encoderpool_connector.rdma.stats import RdmaStats
from encoderpool_contracts import ConnectorConfig
from encoderpool_contracts.integrity import ChannelKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from encoderpool_connector.rdma.channel import SideChannelServer
    from encoderpool_connector.rdma.transfer import ProducerAgent, Puller

logger = logging.getLogger("vllm.ext." + __name__)


class RdmaScheduler:
    """Scheduler-role logic; the connector class only routes to it."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        is_producer: bool,
        is_consumer: bool,
        model_dtype: str,
        widths: dict[str, int],
        metadata_resolver: Any,
        advertise_host: str,
        channel_key: ChannelKey | None,
    ) -> None:
        rd = config.rdma
        assert rd is not None
        self.config = config
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.stats = RdmaStats()
        self.region = SharedRegion.create(rd.shm_dir, rd.buffer_bytes)
        self.alloc = SlotAllocator(rd.buffer_bytes)
        self.producer: RdmaProducerScheduler | None = None
        self.consumer: RdmaConsumerScheduler | None = None
        try:
            if is_producer:
                self.producer = RdmaProducerScheduler(
                    config,
                    self.region,
                    self.alloc,
                    self.stats,
                    model_dtype=model_dtype,
                    widths=widths,
                    metadata_resolver=metadata_resolver,
                    advertise_host=advertise_host,
                    channel_key=channel_key,
                )
            if is_consumer:
                self.consumer = RdmaConsumerScheduler(
                    config,
                    self.region,
                    self.alloc,
                    self.stats,
                    model_dtype=model_dtype,
                    widths=widths,
                    channel_key=channel_key,
                )
        except BaseException:
            self.shutdown()
            raise

    @property
    def agent(self) -> ProducerAgent | None:
        return self.producer.agent if self.producer is not None else None

    @property
    def channel(self) -> SideChannelServer | None:
        return self.producer.channel if self.producer is not None else None

    @property
    def puller(self) -> Puller | None:
        return self.consumer.puller if self.consumer is not None else None

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self.producer is not None:
            self.producer.track(request)
        return self.consumer is None or self.consumer.ensure_cache_available(
            request, num_computed_tokens
        )

    def has_cache_item(self, identifier: str) -> bool:
        return self.consumer is not None and self.consumer.has_cache_item(identifier)

    def build_connector_meta(self, scheduler_output: Any) -> RdmaMetadata:
        meta = RdmaMetadata(region=self.region.path, region_bytes=self.region.size)
        inputs = getattr(scheduler_output, "scheduled_encoder_inputs", None)
        if isinstance(inputs, dict):
            # The very dict the model runner encodes from: a failed load is added to it.
            meta.encoder_inputs = inputs
        try:
            if self.producer is not None:
                meta.writes = self.producer.plan_writes(scheduler_output)
            if self.consumer is not None:
                meta.loads = self.consumer.plan_loads(scheduler_output)
        except Exception as e:  # the step goes on; affected items become misses
            logger.warning("encoderpool: rdma build_connector_meta: %r", e)
        return meta

    def update_connector_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, RdmaWorkerMetadata):
            return
        if self.consumer is not None:
            self.consumer.loads_reported(worker_meta)
        if worker_meta.stats:
            self.stats.aggregate(RdmaStats(data=dict(worker_meta.stats)))

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self.consumer is not None:
            self.consumer.update_state_after_alloc(request, index)

    def take_unavailable_requests(self) -> set[str]:
        return self.consumer.take_unavailable_requests() if self.consumer is not None else set()

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        if self.consumer is not None:
            self.consumer.request_finished(request)
        return self.producer.request_finished(request) if self.producer is not None else None

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.shutdown()
        if self.producer is not None:
            self.producer.shutdown()
        self.region.close()

"""Scheduler side of an rdma consumer: pulls, and loads out of the local region.

``ensure_cache_available`` validates an item's coordinates, takes a local slot
and hands the READ to the puller thread; the request is deferred until the
verdict. ``has_cache_item`` is True only for items whose bytes are local and
verified, because vLLM treats that answer as final. Anything else (no or bad
coordinates, unreachable or restarted producer, failed, slow or corrupt READ, no
room) is a miss: the consumer encodes the item itself. A slot is reused once the
workers report the step that copied out of it (vLLM merges all tensor-parallel
ranks' reports first); a copy that failed on any rank was encoded in that step
instead (``core.ranks``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from encoderpool_connector.core.lookups import LookupScheduler, short
from encoderpool_connector.rdma.auth import OncePerPeer
from encoderpool_connector.rdma.buffer import SharedRegion, Slot, SlotAllocator
from encoderpool_connector.rdma.channel import (
    Coordinates,
    WireError,
    parse_coordinates,
    verify_coordinates,
)
from encoderpool_connector.rdma.metadata import LoadPlan, RdmaWorkerMetadata
from encoderpool_connector.rdma.stats import RdmaStats
from encoderpool_connector.rdma.transfer import Puller, PullResult
from encoderpool_contracts import Announcement, ConnectorConfig, raw_announcement
from encoderpool_contracts.integrity import AuthError, ChannelKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.ext." + __name__)

LOAD_GRACE_S = 120.0  # a planned load the worker never confirmed frees its slot after this

State = Literal["pulling", "hit", "miss"]


@dataclass
class _Pull:
    coords: Coordinates | None
    state: State
    slot: Slot | None = None
    future: Future[PullResult] | None = None
    requests: set[str] = field(default_factory=set)


@dataclass
class _Loading:
    slot: Slot
    requests: set[str]
    since: float


class RdmaConsumerScheduler(LookupScheduler[_Pull]):
    """The consumer role of ``RdmaScheduler``: the puller's NIXL agent, one lookup (a pull)
    per item, and the loads planned for the worker. The region, allocator and counters
    are ``RdmaScheduler``'s, shared with a producer role on the same engine."""

    in_flight = "pulling"

    def __init__(
        self,
        config: ConnectorConfig,
        region: SharedRegion,
        alloc: SlotAllocator,
        stats: RdmaStats,
        *,
        model_dtype: str,
        widths: dict[str, int],
        channel_key: ChannelKey | None,
    ) -> None:
        super().__init__()
        rd = config.rdma
        assert rd is not None
        self.config = config
        self.rd = rd
        self.region = region
        self.alloc = alloc
        self.stats = stats
        self.model_dtype = model_dtype
        self.widths = widths
        self.key = channel_key
        self._refused_log = OncePerPeer("item coordinates naming")
        self._loads: list[LoadPlan] = []
        self._loading: dict[str, _Loading] = {}
        self.puller = Puller(
            region,
            rd.backends,
            fingerprint=config.model_fingerprint,
            metadata_timeout=rd.metadata_timeout_ms / 1000.0,
            key=channel_key,
        )
        logger.info(
            "encoderpool rdma consumer: agent %s, %d bytes registered at %s",
            self.puller.name,
            rd.buffer_bytes,
            region.path,
        )

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self._consumer_lookups(request, num_computed_tokens)

    def plan_loads(self, scheduler_output: Any) -> list[LoadPlan]:
        """This step's loads (the hits vLLM scheduled); an idle step waits for a pull."""
        self._consumer_housekeeping()
        loads, self._loads = self._loads, []
        self.wait_if_idle(scheduler_output)
        return loads

    def loads_reported(self, worker_meta: RdmaWorkerMetadata) -> None:
        """The workers' loads of a step ended (copied out, or encoded instead): their slots
        are free again."""
        for mm_hash in worker_meta.loaded | worker_meta.failed:
            loading = self._loading.pop(mm_hash, None)
            if loading is None:
                continue
            self.alloc.free(loading.slot.offset)
        if worker_meta.failed:
            # Counted here, once per item, however many ranks failed: all ranks encoded it.
            self.stats.add("load_failures", len(worker_meta.failed))

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        pull = self._allocated_hit(request, index)
        if pull is None:
            return
        mm_hash = request.mm_features[index].identifier
        assert pull.slot is not None
        assert pull.coords is not None
        self._loads.append(
            LoadPlan(
                mm_hash,
                pull.slot.offset,
                pull.coords.dtype,
                pull.coords.shape,
                request.request_id,
                index,
            )
        )
        old = self._loading.pop(mm_hash, None)
        if old is not None:  # a load of the same item still unconfirmed: it cannot be both
            self.alloc.free(old.slot.offset)
        self._loading[mm_hash] = _Loading(pull.slot, {request.request_id}, time.monotonic())

    def request_finished(self, request: Request) -> None:
        rid = request.request_id
        for feature in request.mm_features:
            loading = self._loading.get(feature.identifier)
            if loading is not None:
                loading.requests.discard(rid)
        self._finish_lookups(request)

    def shutdown(self) -> None:
        self.puller.close()

    def _start(self, request: Request, index: int) -> _Pull:
        self.stats.add("lookups")
        pull = self._begin(request, index)
        if pull.state == "miss":
            self.stats.add("misses")
        return pull

    def _begin(self, request: Request, index: int) -> _Pull:
        """Validate the item's coordinates and start its READ, or decide it is a miss."""
        feature = request.mm_features[index]
        mm_hash = feature.identifier
        raw = raw_announcement(request.ec_transfer_params, mm_hash)
        if not isinstance(raw, dict) or raw.get("rdma") is None:
            logger.debug("encoderpool: item %s has no rdma coordinates", short(mm_hash))
            return _Pull(None, "miss")
        try:
            announcement = Announcement.parse(raw)
            if announcement.fingerprint != self.config.model_fingerprint:
                raise WireError(
                    f"fingerprint {announcement.fingerprint!r} is not this "
                    f"model's {self.config.model_fingerprint}"
                )
            if self.key is not None:  # before anything is acted on
                self._verify(announcement.rdma, mm_hash)
            coords = parse_coordinates(announcement.rdma)
            self._expect(coords, request, index)
        except AuthError:
            self.stats.add("unauthenticated")
            return _Pull(None, "miss")
        except ValueError as e:  # WireError, or the announcement itself is malformed
            self.stats.add("bad_coordinates")
            logger.warning(
                "encoderpool: bad rdma coordinates for item %s: %s; encoding it here",
                short(mm_hash),
                e,
            )
            return _Pull(None, "miss")
        slot, _ = self.alloc.allocate(mm_hash, coords.size, evict=False)
        if slot is None:
            self.stats.add("no_room")
            logger.warning(
                "encoderpool: no room for item %s (%d bytes) in the rdma buffer; encoding it "
                "here (raise rdma.buffer_bytes)",
                short(mm_hash),
                coords.size,
            )
            return _Pull(coords, "miss")
        future = self.puller.submit(coords, slot.offset, self.rd.transfer_timeout_ms / 1000.0)
        logger.debug("encoderpool: pulling item %s from %s", short(mm_hash), coords.agent)
        return _Pull(coords, "pulling", slot, future)

    def _verify(self, raw: Any, mm_hash: str) -> None:
        """AuthError (logged once per named producer) unless a holder of the pool's key
        signed these coordinates for this item, within ``slot_ttl_s``."""
        assert self.key is not None
        try:
            verify_coordinates(
                self.key,
                raw,
                mm_hash,
                self.config.model_fingerprint,
                max_age=float(self.rd.slot_ttl_s),
                now=time.time(),
            )
        except AuthError as e:
            named = (
                f"{raw.get('host')!s:.100}:{raw.get('port')!s:.8}" if isinstance(raw, dict) else "?"
            )
            self._refused_log.warn(named, f"{e}; item {short(mm_hash)} is encoded here")
            raise

    def _expect(self, coords: Coordinates, request: Request, index: int) -> None:
        """What this consumer would compute for the item must be what the producer offers."""
        if coords.dtype != self.model_dtype:
            raise WireError(f"dtype {coords.dtype} is not this model's {self.model_dtype}")
        tokens = int(request.get_num_encoder_embeds(index))
        width = self.widths.get(request.mm_features[index].modality)
        if len(coords.shape) != 2 or coords.shape[0] != tokens:
            raise WireError(f"shape {list(coords.shape)} is not ({tokens}, width)")
        if width is not None and coords.shape[1] != width:
            raise WireError(f"width {coords.shape[1]} is not this model's {width}")

    def _advance(self, mm_hash: str, pull: _Pull) -> bool:
        """True once the pull is decided (hit or miss)."""
        if pull.state != "pulling":
            return True
        assert pull.future is not None
        assert pull.slot is not None
        if not pull.future.done():
            return False
        result = pull.future.result()
        pull.future = None
        self.stats.add("pull_seconds", result.seconds)
        if result.ok:
            pull.state = "hit"
            self.stats.add("hits")
            assert pull.coords is not None
            self.stats.add("pulled_bytes", pull.coords.size)
            return True
        pull.state = "miss"
        self.stats.add("misses")
        self.stats.add(
            {
                "timeout": "transfer_timeouts",
                "corrupt": "corrupt",
                "unauthenticated": "unauthenticated",
            }.get(result.kind, "transfer_failures")
        )
        logger.warning(
            "encoderpool: pulling item %s failed (%s); encoding it here",
            short(mm_hash),
            result.reason,
        )
        if result.slot_free:
            self.alloc.free(pull.slot.offset)
        # else: the slot stays locked until the puller reports the READ released
        pull.slot = None
        return True

    def _forget(self, mm_hash: str) -> None:
        pull = self._lookups.pop(mm_hash)
        if pull.state == "hit" and pull.slot is not None:
            self.alloc.free(pull.slot.offset)

    def _consumer_housekeeping(self) -> None:
        for offset in self.puller.released():
            self.alloc.free(offset)
        self._drop_orphans()  # pulls whose requests all finished while they were in flight
        cutoff = time.monotonic() - LOAD_GRACE_S
        for mm_hash in [h for h, ld in self._loading.items() if ld.since < cutoff]:
            self.alloc.free(self._loading.pop(mm_hash).slot.offset)

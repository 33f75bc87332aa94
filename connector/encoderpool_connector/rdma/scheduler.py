"""Scheduler side of the RDMA connector: slots and coordinates (producer), pulls (consumer).

Producer: when a request is first scheduled, each of its items gets a slot in
the registered region (oldest slots evicted when full) and the worker is told
to copy the encoder output there (``WritePlan``). ``request_finished`` reads
the slot header the worker's writer wrote; if it is complete, the item's
``ec_transfer_params`` carry its coordinates. A slot is freed when every READ
announced for it confirmed (NIXL notification), or after ``slot_ttl_s``.

The worker's step only queues the copy (``worker``, ``writer``), so a request can
finish while its slot is still being written. The coordinates carry the payload's
checksum, which exists only once the writer hashed the bytes; announcing earlier
would need another wire format, and the consumer acts on coordinates at once. So
``request_finished`` waits, at most ``PUBLISH_WAIT_S`` per request, while a slot
shows its own generation's WRITING mark (the step set it, so that a write still to
come is told apart from one that will never come). Past the bound the item is
unannounced, as today for an unwritten slot (the consumer encodes it itself), but
the slot is kept, not freed, until its write ended (``_settle``): a freed range
could be planned again under a write still to land.

Consumer: ``ensure_cache_available`` validates an item's coordinates, takes
a local slot and hands the READ to the puller thread; the request is deferred
until the verdict. ``has_cache_item`` is True only for items whose bytes are
local and verified, because vLLM treats that answer as final. Anything else
(no or bad coordinates, unreachable or restarted producer, failed, slow or
corrupt READ, no room) is a miss: the consumer encodes the item itself. A
slot is reused once the workers report the step that copied out of it (vLLM
merges all tensor-parallel ranks' reports first); a copy that failed on any
rank was encoded in that step instead (``core.ranks``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from encoderpool_connector.core.lookups import LookupScheduler, short
from encoderpool_connector.rdma.auth import OncePerPeer
from encoderpool_connector.rdma.buffer import (
    HEADER_BYTES,
    MARK_BYTES,
    STATE_WRITING,
    SharedRegion,
    Slot,
    SlotAllocator,
    SlotHeader,
    key_digest,
    slot_state,
    unpack_slot_header,
)
from encoderpool_connector.rdma.channel import (
    Coordinates,
    SideChannelServer,
    WireError,
    parse_coordinates,
    sign_coordinates,
    verify_coordinates,
)
from encoderpool_connector.rdma.metadata import (
    LoadPlan,
    RdmaMetadata,
    RdmaWorkerMetadata,
    WritePlan,
)
from encoderpool_connector.rdma.stats import RdmaStats
from encoderpool_connector.rdma.transfer import ProducerAgent, Puller, PullResult
from encoderpool_contracts import (
    Announcement,
    ConnectorConfig,
    announce,
    payload_bytes,
    raw_announcement,
)
from encoderpool_contracts.integrity import AuthError, ChannelKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.ext." + __name__)

LOAD_GRACE_S = 120.0  # a planned load the worker never confirmed frees its slot after this
# request_finished waits at most this long in all for the writer to finish the request's
# slots (it copies and hashes a 9 MB item in a few milliseconds): the engine loop is held
# meanwhile, so a stuck writer costs each request this once, not a hang.
PUBLISH_WAIT_S = 1.0
# Polled, not signalled (the writer is in another process): a 16-byte read per poll, and
# a write found done at most half a millisecond late.
_POLL_FIRST_S, _POLL_MAX_S = 0.0001, 0.0005

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


class RdmaScheduler(LookupScheduler[_Pull]):
    """Scheduler-role logic; the connector class only routes to it."""

    in_flight = "pulling"

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
        super().__init__()
        rd = config.rdma
        assert rd is not None
        self.config = config
        self.rd = rd
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.model_dtype = model_dtype
        self.widths = widths
        self.resolver = metadata_resolver
        self.advertise_host = advertise_host
        self.key = channel_key
        self._refused_log = OncePerPeer("item coordinates naming")
        self.stats = RdmaStats()
        self.region = SharedRegion.create(rd.shm_dir, rd.buffer_bytes)
        self.alloc = SlotAllocator(rd.buffer_bytes)
        self.agent: ProducerAgent | None = None
        self.channel: SideChannelServer | None = None
        self.puller: Puller | None = None
        # producer
        self._slots: dict[str, Slot] = {}
        self._requests: dict[str, Request] = {}
        self._planned: set[str] = set()
        self._writes: list[WritePlan] = []
        self._warned_width: set[str] = set()
        self._last_full_warning = 0.0
        self._unsettled: dict[int, Slot] = {}  # by offset: writes still running, unannounced
        # consumer (and the lookups the base keeps)
        self._loads: list[LoadPlan] = []
        self._loading: dict[str, _Loading] = {}
        try:
            if is_producer:
                self.agent = ProducerAgent(self.region, rd.backends, key=channel_key)
                self.channel = SideChannelServer(
                    rd.bind_host,
                    rd.side_channel_port,
                    self.agent.side_channel_reply(config.model_fingerprint),
                    rd.metadata_timeout_ms / 1000.0,
                    key=channel_key,
                )
                logger.info(
                    "encoderpool rdma producer: agent %s, side channel %s:%d (advertised as "
                    "%s), %d bytes registered at %s",
                    self.agent.name,
                    rd.bind_host,
                    self.channel.port,
                    advertise_host,
                    rd.buffer_bytes,
                    self.region.path,
                )
            if is_consumer:
                self.puller = Puller(
                    self.region,
                    rd.backends,
                    fingerprint=config.model_fingerprint,
                    metadata_timeout=rd.metadata_timeout_ms / 1000.0,
                    key=channel_key,
                )
                logger.info(
                    "encoderpool rdma consumer: agent %s, %d bytes registered at %s",
                    self.puller.name,
                    rd.buffer_bytes,
                    self.region.path,
                )
        except BaseException:
            self.shutdown()
            raise

    # ---- both roles ----

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self.is_producer:
            self._requests[request.request_id] = request
        return not self.is_consumer or self._consumer_lookups(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> RdmaMetadata:
        meta = RdmaMetadata(region=self.region.path, region_bytes=self.region.size)
        inputs = getattr(scheduler_output, "scheduled_encoder_inputs", None)
        if isinstance(inputs, dict):
            # The very dict the model runner encodes from: a failed load is added to it.
            meta.encoder_inputs = inputs
        try:
            if self.is_producer:
                self._producer_housekeeping()
                scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
                for rid in scheduled:
                    request = self._requests.get(rid)
                    if request is not None and rid not in self._planned:
                        self._planned.add(rid)
                        for index in range(len(request.mm_features)):
                            self._plan_write(request, index)
                meta.writes, self._writes = self._writes, []
            if self.is_consumer:
                self._consumer_housekeeping()
                meta.loads, self._loads = self._loads, []
                self.wait_if_idle(scheduler_output)
        except Exception as e:  # the step goes on; affected items become misses
            logger.warning("encoderpool: rdma build_connector_meta: %r", e)
        return meta

    def update_connector_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, RdmaWorkerMetadata):
            return
        for mm_hash in worker_meta.loaded | worker_meta.failed:
            loading = self._loading.pop(mm_hash, None)
            if loading is None:
                continue
            self.alloc.free(loading.slot.offset)
        if worker_meta.failed:
            # Counted here, once per item, however many ranks failed: all ranks encoded it.
            self.stats.add("load_failures", len(worker_meta.failed))
        if worker_meta.stats:
            self.stats.aggregate(RdmaStats(data=dict(worker_meta.stats)))

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if not self.is_consumer:
            return
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

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        rid = request.request_id
        for feature in request.mm_features:
            loading = self._loading.get(feature.identifier)
            if loading is not None:
                loading.requests.discard(rid)
        self._finish_lookups(request)
        if not self.is_producer:
            return None
        self._requests.pop(rid, None)
        self._planned.discard(rid)
        try:
            return self._announce(request)
        except Exception as e:  # never fail a finishing request over its coordinates
            logger.warning("encoderpool: announcing items of request %s failed: %r", rid, e)
            return None

    def shutdown(self) -> None:
        if self.puller is not None:
            self.puller.close()
        if self.channel is not None:
            self.channel.close()
        if self.agent is not None:
            self.agent.close()
        self.region.close()

    # ---- producer ----

    def _plan_write(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        mm_hash = feature.identifier
        slot = self._slots.get(mm_hash)
        if slot is not None and self.alloc.get(slot.offset) is slot:
            slot.requests.add(request.request_id)
            return
        width = self.widths.get(feature.modality)
        if width is None:
            if feature.modality not in self._warned_width:
                self._warned_width.add(feature.modality)
                logger.warning(
                    "encoderpool: no encoder output width known for modality %r; its items are "
                    "not offered over RDMA (set encoder_output_widths.%s)",
                    feature.modality,
                    feature.modality,
                )
            return
        tokens = int(request.get_num_encoder_embeds(index))
        payload = payload_bytes(self.model_dtype, (tokens, width))
        slot, evicted = self.alloc.allocate(mm_hash, HEADER_BYTES + payload)
        for old in evicted:
            if self._slots.get(old.key) is old:
                del self._slots[old.key]
            self.stats.add("evicted")
            self.stats.add("evicted_bytes", old.size)
        if slot is None:
            now = time.monotonic()
            if now - self._last_full_warning > 10:
                self._last_full_warning = now
                logger.warning(
                    "encoderpool: rdma buffer (%d bytes) has no room for an item of %d bytes "
                    "(everything is being written); consumers will encode such items "
                    "(raise rdma.buffer_bytes)",
                    self.alloc.capacity,
                    payload,
                )
            return
        slot.requests.add(request.request_id)
        self._slots[mm_hash] = slot
        self._writes.append(
            WritePlan(mm_hash, slot.offset, slot.size - HEADER_BYTES, slot.generation)
        )

    def _announce(self, request: Request) -> dict[str, Any] | None:
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata

        assert self.agent is not None
        assert self.channel is not None
        self._producer_housekeeping()
        items = collect_ec_item_metadata(request.mm_features, self.resolver)
        deadline = time.monotonic() + PUBLISH_WAIT_S
        for mm_hash, item in items.items():
            coords = self._coordinates(mm_hash, request.request_id, deadline)
            self.stats.add("announced" if coords is not None else "unannounced")
            rdma = None
            if coords is not None:
                rdma = (
                    sign_coordinates(
                        self.key, coords, mm_hash, self.config.model_fingerprint, time.time()
                    )
                    if self.key is not None
                    else coords.to_json()
                )
            announce(item, Announcement(fingerprint=self.config.model_fingerprint, rdma=rdma))
        return items or None

    def _coordinates(self, mm_hash: str, rid: str, deadline: float) -> Coordinates | None:
        """The item's coordinates once its slot is written (waiting until ``deadline`` for a
        write the worker queued); None if it is not."""
        assert self.agent is not None
        assert self.channel is not None
        slot = self._slots.get(mm_hash)
        if slot is None or self.alloc.get(slot.offset) is not slot:
            return None
        slot.requests.discard(rid)
        if self._writing(slot) and not self._await_write(slot, deadline):
            self.stats.add("announce_waits_timed_out")
            if not slot.requests:  # nobody else will read it: settled once the write ends
                self._unsettled[slot.offset] = slot
            return None
        header = self._written(slot)
        if header is None:
            if not slot.requests:  # nobody else will write it: give the room back
                self.alloc.free(slot.offset)
                del self._slots[mm_hash]
            return None
        slot.locked = False
        slot.refs += 1
        return Coordinates(
            agent=self.agent.name,
            host=self.advertise_host,
            port=self.channel.port,
            offset=slot.offset + HEADER_BYTES,
            size=header.payload_bytes,
            dtype=header.dtype,
            shape=header.shape,
            checksum="blake3:" + header.checksum.hex(),
            gen=slot.generation,
        )

    def _writing(self, slot: Slot) -> bool:
        """Whether the slot shows its own generation's WRITING mark (a write is queued)."""
        raw = self.region.view[slot.offset : slot.offset + MARK_BYTES]
        return slot_state(raw) == (STATE_WRITING, slot.generation)

    def _await_write(self, slot: Slot, deadline: float) -> bool:
        """Poll the slot until its write ended (True) or ``deadline`` passed (False)."""
        t0 = now = time.monotonic()
        delay = _POLL_FIRST_S
        try:
            while self._writing(slot):
                if now >= deadline:
                    return False
                time.sleep(min(delay, deadline - now))
                delay = min(2 * delay, _POLL_MAX_S)
                now = time.monotonic()
            return True
        finally:
            self.stats.add("announce_wait_seconds", time.monotonic() - t0)

    def _written(self, slot: Slot) -> SlotHeader | None:
        """The slot's header if the writer completed it for this slot; None otherwise."""
        header = unpack_slot_header(self.region.view[slot.offset : slot.offset + HEADER_BYTES])
        if (
            header is None
            or header.generation != slot.generation
            or header.key != key_digest(slot.key)
            or header.payload_bytes > slot.size - HEADER_BYTES
        ):
            return None
        return header

    def _settle(self) -> None:
        """Slots whose write outlived ``request_finished``'s wait, once it ended: written ones
        become evictable (a repeat of the item announces them), the others are freed."""
        for offset, slot in list(self._unsettled.items()):
            if self.alloc.get(offset) is not slot:  # expired meanwhile
                del self._unsettled[offset]
                continue
            if self._writing(slot):
                continue
            del self._unsettled[offset]
            if slot.requests:  # a repeat of the item: its request_finished reads the slot
                continue
            if self._written(slot) is not None:
                slot.locked = False
            else:
                self.alloc.free(offset)
                if self._slots.get(slot.key) is slot:
                    del self._slots[slot.key]

    def _producer_housekeeping(self) -> None:
        assert self.agent is not None
        self._settle()
        for payload_offset, gen in self.agent.releases():
            slot = self.alloc.get(payload_offset - HEADER_BYTES)
            if slot is None or slot.generation != gen or slot.refs <= 0:
                continue  # already evicted or expired, or a forged notice
            slot.refs -= 1
            if slot.refs == 0 and not slot.locked and not slot.requests:
                self.alloc.free(slot.offset)
                if self._slots.get(slot.key) is slot:
                    del self._slots[slot.key]
                self.stats.add("released")
        if self.agent.bad_notices:
            self.stats.add("bad_notices", self.agent.bad_notices)
            self.agent.bad_notices = 0
        if self.agent.unauthenticated:
            self.stats.add("unauthenticated", self.agent.unauthenticated)
            self.agent.unauthenticated = 0
        if self.channel is not None:
            for name, n in self.channel.take_counts().items():
                if n:
                    self.stats.add(name, n)
        for old in self.alloc.expire(time.monotonic() - self.rd.slot_ttl_s):
            if self._slots.get(old.key) is old:
                del self._slots[old.key]
            self.stats.add("expired")

    # ---- consumer ----

    def _start(self, request: Request, index: int) -> _Pull:
        self.stats.add("lookups")
        pull = self._begin(request, index)
        if pull.state == "miss":
            self.stats.add("misses")
        return pull

    def _begin(self, request: Request, index: int) -> _Pull:
        """Validate the item's coordinates and start its READ, or decide it is a miss."""
        assert self.puller is not None
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
        assert self.puller is not None
        for offset in self.puller.released():
            self.alloc.free(offset)
        self._drop_orphans()  # pulls whose requests all finished while they were in flight
        cutoff = time.monotonic() - LOAD_GRACE_S
        for mm_hash in [h for h, ld in self._loading.items() if ld.since < cutoff]:
            self.alloc.free(self._loading.pop(mm_hash).slot.offset)

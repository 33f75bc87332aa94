"""Scheduler side of an rdma producer: slots, write plans, coordinates, releases.

When a request is first scheduled, each of its items gets a slot in the
registered region (oldest slots evicted when full) and the worker is told to
copy the encoder output there (``WritePlan``). ``request_finished`` reads the
slot header the worker's writer wrote; if it is complete, the item's
``ec_transfer_params`` carry its coordinates. A slot is freed when every READ
announced for it confirmed (NIXL notification), or after ``slot_ttl_s``.

The worker's step only queues the copy (``worker``, ``writer``), so a request can
finish while its slot is still being written. The coordinates carry the payload's
checksum, which exists only once the writer hashed the bytes; announcing earlier
would need another wire format, and the consumer acts on coordinates at once. So
``request_finished`` waits, at most ``PUBLISH_WAIT_S`` per request (and not at all
for ``BEHIND_S`` after a wait timed out), while a slot shows its own generation's
WRITING mark (the step set it, so that a write still to
come is told apart from one that will never come). Past the bound the item is
unannounced, as for an unwritten slot (the consumer encodes it itself), but the
slot is kept, not freed, until its write ended (``_settle``): a freed range could
be planned again under a write still to land.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

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
    sign_coordinates,
)
from encoderpool_connector.rdma.metadata import WritePlan
from encoderpool_connector.rdma.stats import RdmaStats
from encoderpool_connector.rdma.transfer import ProducerAgent
from encoderpool_contracts import (
    Announcement,
    ConnectorConfig,
    announce,
    payload_bytes,
)
from encoderpool_contracts.integrity import ChannelKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.ext." + __name__)

# request_finished waits at most this long in all for the writer to finish the request's
# slots (it copies and hashes a 9 MB item in a few milliseconds): the engine loop is held
# meanwhile, so a stuck writer costs each request this once, not a hang.
PUBLISH_WAIT_S = 1.0
# After a wait timed out the writer is behind (starved, or stuck): for this long nobody
# waits again (items it has not written are unannounced at once), so a stuck writer
# holds the engine loop for PUBLISH_WAIT_S once per BEHIND_S, not once per request.
BEHIND_S = 10.0
# Polled, not signalled (the writer is in another process): a 16-byte read per poll, and
# a write found done at most half a millisecond late.
_POLL_FIRST_S, _POLL_MAX_S = 0.0001, 0.0005


class RdmaProducerScheduler:
    """The producer role of ``RdmaScheduler``: the NIXL agent that registers the region, the
    side channel, and the slots it plans, announces and frees. The region, allocator and
    counters are ``RdmaScheduler``'s, shared with a consumer role on the same engine."""

    def __init__(
        self,
        config: ConnectorConfig,
        region: SharedRegion,
        alloc: SlotAllocator,
        stats: RdmaStats,
        *,
        model_dtype: str,
        widths: dict[str, int],
        metadata_resolver: Any,
        advertise_host: str,
        channel_key: ChannelKey | None,
    ) -> None:
        rd = config.rdma
        assert rd is not None
        self.config = config
        self.rd = rd
        self.region = region
        self.alloc = alloc
        self.stats = stats
        self.model_dtype = model_dtype
        self.widths = widths
        self.resolver = metadata_resolver
        self.advertise_host = advertise_host
        self.key = channel_key
        self._slots: dict[str, Slot] = {}
        self._behind_until = 0.0  # a wait timed out: no waiting until then (BEHIND_S)
        self._requests: dict[str, Request] = {}
        self._planned: set[str] = set()
        self._writes: list[WritePlan] = []
        self._warned_width: set[str] = set()
        self._last_full_warning = 0.0
        self._unsettled: dict[int, Slot] = {}  # by offset: writes still running, unannounced
        self.agent = ProducerAgent(region, rd.backends, key=channel_key)
        try:
            self.channel = SideChannelServer(
                rd.bind_host,
                rd.side_channel_port,
                self.agent.side_channel_reply(config.model_fingerprint),
                rd.metadata_timeout_ms / 1000.0,
                key=channel_key,
            )
        except BaseException:
            self.agent.close()
            raise
        logger.info(
            "encoderpool rdma producer: agent %s, side channel %s:%d (advertised as "
            "%s), %d bytes registered at %s",
            self.agent.name,
            rd.bind_host,
            self.channel.port,
            advertise_host,
            rd.buffer_bytes,
            region.path,
        )

    def track(self, request: Request) -> None:
        """A request vLLM asked about: its items get slots when it is first scheduled."""
        self._requests[request.request_id] = request

    def plan_writes(self, scheduler_output: Any) -> list[WritePlan]:
        """This step's plans: a slot for each item of each request scheduled first now."""
        self._producer_housekeeping()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for rid in scheduled:
            request = self._requests.get(rid)
            if request is not None and rid not in self._planned:
                self._planned.add(rid)
                for index in range(len(request.mm_features)):
                    self._plan_write(request, index)
        writes, self._writes = self._writes, []
        return writes

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """The request's items with their coordinates where their slots are written."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._planned.discard(rid)
        try:
            return self._announce(request)
        except Exception as e:  # never fail a finishing request over its coordinates
            logger.warning("encoderpool: announcing items of request %s failed: %r", rid, e)
            return None

    def shutdown(self) -> None:
        self.channel.close()
        self.agent.close()

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

        self._producer_housekeeping()
        items = collect_ec_item_metadata(request.mm_features, self.resolver)
        now = time.monotonic()
        deadline = now if now < self._behind_until else now + PUBLISH_WAIT_S
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
        slot = self._slots.get(mm_hash)
        if slot is None or self.alloc.get(slot.offset) is not slot:
            return None
        slot.requests.discard(rid)
        if self._writing(slot) and not self._await_write(slot, deadline):
            self.stats.add("announce_waits_timed_out")
            self._behind_until = max(self._behind_until, time.monotonic() + BEHIND_S)
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
        for name, n in self.channel.take_counts().items():
            if n:
                self.stats.add(name, n)
        for old in self.alloc.expire(time.monotonic() - self.rd.slot_ttl_s):
            if self._slots.get(old.key) is old:
                del self._slots[old.key]
            self.stats.add("expired")

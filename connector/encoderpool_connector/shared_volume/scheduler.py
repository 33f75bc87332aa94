"""Scheduler side of the shared-volume connector: look up, verify, pin, plan loads.

The scheduler's yes to ``has_cache_item`` is final: vLLM then skips the
encoder for that item and a worker that cannot deliver it crashes the engine
("Encoder cache miss"). So an item is a hit only after its entry has been
pinned (hard-linked, so eviction cannot take it away) and verified in full
(header and checksum). Verification runs on a small thread pool, started from
``ensure_cache_available``, which defers the request until every item is
decided; the engine loop never waits on disk.

A producer's response announces each item it encoded; a consumer request
carrying that announcement (the router passes ``ec_transfer_params`` on)
waits up to ``publish_wait_ms`` for the background writer to publish it,
then encodes the item itself.

A pin is dropped once the workers report the step that loaded it (vLLM merges
the reports of all tensor-parallel ranks first, so every rank has read it);
a load that failed on any rank was encoded in that step instead (``core.ranks``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from encoderpool_connector.core.lookups import LookupScheduler, short
from encoderpool_connector.shared_volume.entry import (
    EntryError,
    EntryMissing,
    EntryUnauthenticated,
    Expect,
    Header,
    entry_name,
)
from encoderpool_connector.shared_volume.metadata import (
    LoadSpec,
    SharedVolumeMetadata,
    SharedVolumeWorkerMetadata,
)
from encoderpool_connector.shared_volume.stats import SharedVolumeStats
from encoderpool_connector.shared_volume.store import Pins, SharedStore
from encoderpool_contracts import (
    Announcement,
    ConnectorConfig,
    announce,
    raw_announcement,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.ext." + __name__)

LOAD_GRACE_S = 120.0  # a pin no worker report released is dropped after this

State = Literal["waiting", "verifying", "hit", "miss"]


@dataclass
class _Verdict:
    ok: bool
    pin: str | None = None
    pinned: bool = True
    header: Header | None = None
    reason: str = ""
    seconds: float = 0.0
    subdir: str = ""
    inode: tuple[int, int] = (0, 0)
    offset: int = 0
    unauthenticated: bool = False


@dataclass
class _Lookup:
    name: str
    expect: Expect
    state: State
    deadline: float = 0.0
    future: Future[_Verdict] | None = None
    verdict: _Verdict | None = None
    requests: set[str] = field(default_factory=set)


class SharedVolumeScheduler(LookupScheduler[_Lookup]):
    """Scheduler-role logic; the connector class only routes to it."""

    in_flight = "verifying"

    def __init__(
        self,
        config: ConnectorConfig,
        store: SharedStore,
        *,
        is_producer: bool,
        is_consumer: bool,
        model_dtype: str,
        widths: dict[str, int],
        metadata_resolver: Any,
    ) -> None:
        super().__init__()
        sv = config.shared_volume
        assert sv is not None
        self.config = config
        self.store = store
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.model_dtype = model_dtype
        self.widths = widths
        self.wait_s = sv.publish_wait_ms / 1000.0
        self.resolver = metadata_resolver
        self.pins = Pins(store)
        self._pin_links = True
        self._pool = ThreadPoolExecutor(sv.verify_threads, thread_name_prefix="ep-verify")
        self._loads: list[LoadSpec] = []
        self._held: dict[str, float] = {}  # pins handed to the workers -> when
        self.stats = SharedVolumeStats()
        if is_consumer and store.layout() is None and not store.unsafe:
            logger.warning(
                "encoderpool: %s does not exist yet (no producer has written to this root); "
                "every item is a miss until one does",
                store.entries,
            )

    # ---- lookups ----

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Start or advance the lookup of each item still ahead; False defers the request."""
        return not self.is_consumer or self._consumer_lookups(request, num_computed_tokens)

    def _start(self, request: Request, index: int) -> _Lookup:
        feature = request.mm_features[index]
        mm_hash = feature.identifier
        expect = Expect(
            mm_hash=mm_hash,
            fingerprint=self.config.model_fingerprint,
            dtype=self.model_dtype,
            num_tokens=int(request.get_num_encoder_embeds(index)),
            width=self.widths.get(feature.modality),
            key=self.store.key,
        )
        name = entry_name(self.config.model_fingerprint, mm_hash)
        self.stats.add("lookups")
        if self.store.exists(name):
            lookup = _Lookup(name, expect, "verifying")
            lookup.future = self._pool.submit(self._verify, name, expect)
        elif self._announced(request, mm_hash):
            lookup = _Lookup(name, expect, "waiting", deadline=time.monotonic() + self.wait_s)
        else:
            lookup = _Lookup(name, expect, "miss")
            self.stats.add("misses")
        logger.debug("encoderpool: lookup of %s starts %s", short(mm_hash), lookup.state)
        return lookup

    def _announced(self, request: Request, mm_hash: str) -> bool:
        """Whether a producer of this model announced the item (then it is worth waiting
        for). During a model change the router may pair this consumer with a producer of
        the other model, whose entry this consumer would never find: not worth a wait."""
        raw = raw_announcement(request.ec_transfer_params, mm_hash)
        if raw is None:
            return False
        try:
            announcement = Announcement.parse(raw)
        except ValueError as e:
            logger.debug("encoderpool: item %s: %s", short(mm_hash), e)
            return False
        if announcement.fingerprint != self.config.model_fingerprint:
            self.stats.add("foreign_announcements")
            logger.debug(
                "encoderpool: item %s was announced by a producer of model %s; this is %s",
                short(mm_hash),
                announcement.fingerprint,
                self.config.model_fingerprint,
            )
            return False
        return True

    def _advance(self, mm_hash: str, lookup: _Lookup) -> bool:
        """Move a lookup on if it can; True once it is decided (hit or miss)."""
        if lookup.state == "waiting":
            if self.store.exists(lookup.name):
                lookup.state = "verifying"
                lookup.future = self._pool.submit(self._verify, lookup.name, lookup.expect)
            elif time.monotonic() > lookup.deadline:
                logger.warning(
                    "encoderpool: item %s was announced by a producer but not published within "
                    "%.0f ms; encoding it here",
                    short(lookup.expect.mm_hash),
                    self.wait_s * 1000,
                )
                lookup.state = "miss"
                self.stats.add("waits_timed_out")
                self.stats.add("misses")
        if lookup.state == "verifying":
            assert lookup.future is not None
            if not lookup.future.done():
                return False
            verdict = lookup.future.result()
            lookup.future = None
            lookup.verdict = verdict
            self.stats.add("verify_seconds", verdict.seconds)
            if verdict.ok:
                lookup.state = "hit"
                self.stats.add("hits")
            else:
                lookup.state = "miss"
                self.stats.add("misses")
                if verdict.reason != "vanished":
                    self.stats.add("rejected")
                    if verdict.unauthenticated:
                        self.stats.add("unauthenticated")
                    logger.warning(
                        "encoderpool: rejected entry for item %s: %s; encoding it here",
                        short(lookup.expect.mm_hash),
                        verdict.reason,
                    )
        return lookup.state in ("hit", "miss")

    def _verify(self, name: str, expect: Expect) -> _Verdict:
        """Pin, then verify the pin (runs on the pool; never raises)."""
        t0 = time.perf_counter()
        try:
            pin: str | None
            pinned = self._pin_links
            subdir = self.pins.subdir
            if pinned:
                try:
                    pin = self.pins.pin(name)
                except OSError as e:  # e.g. a filesystem without hard links
                    logger.warning(
                        "encoderpool: cannot pin entries under %s (%s); loading unpinned, "
                        "so an eviction racing a load fails that request",
                        self.store.root,
                        e.strerror,
                    )
                    self._pin_links = pinned = False
            if not pinned:
                pin, subdir = name, "entries"
            if pin is None:
                return _Verdict(False, reason="vanished", seconds=time.perf_counter() - t0)
            try:
                header, inode, offset = self.store.verify(subdir, pin, expect)
            except EntryError as e:
                if pinned:
                    self.pins.drop(pin)
                reason = "vanished" if isinstance(e, EntryMissing) else str(e)
                return _Verdict(
                    False,
                    reason=reason,
                    unauthenticated=isinstance(e, EntryUnauthenticated),
                    seconds=time.perf_counter() - t0,
                )
            self.store.touch(name)
            return _Verdict(
                True,
                pin,
                pinned,
                header,
                subdir=subdir,
                inode=inode,
                offset=offset,
                seconds=time.perf_counter() - t0,
            )
        except Exception as e:  # the per-item path never raises
            logger.warning("encoderpool: verifying %s failed: %r", name, e)
            return _Verdict(False, reason=repr(e), seconds=time.perf_counter() - t0)

    # ---- allocation, metadata, outputs ----

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        lookup = self._allocated_hit(request, index)
        if lookup is None:
            return
        mm_hash = request.mm_features[index].identifier
        verdict = lookup.verdict
        assert verdict is not None
        assert verdict.header is not None
        assert verdict.pin is not None
        header = verdict.header
        spec = LoadSpec(
            mm_hash,
            verdict.subdir,
            verdict.pin,
            verdict.pinned,
            header.dtype,
            header.shape,
            verdict.inode,
            verdict.offset,
            request.request_id,
            index,
        )
        self._loads.append(spec)
        if spec.pinned:
            self._held[spec.name] = time.monotonic()

    def build_connector_meta(self, scheduler_output: Any = None) -> SharedVolumeMetadata:
        meta = SharedVolumeMetadata(loads=self._loads)
        if self._loads:
            # The very dict the model runner encodes from: a failed load is added to it.
            inputs = getattr(scheduler_output, "scheduled_encoder_inputs", None)
            if isinstance(inputs, dict):
                meta.encoder_inputs = inputs
        self._loads = []
        self._drop_orphans()
        self.wait_if_idle(scheduler_output)
        cutoff = time.monotonic() - LOAD_GRACE_S
        for pin in [p for p, since in self._held.items() if since < cutoff]:
            del self._held[pin]
            self.pins.drop(pin)
        return meta

    def update_connector_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, SharedVolumeWorkerMetadata):
            return
        for pin in worker_meta.released:
            if self._held.pop(pin, None) is not None:  # only pins this side handed out
                self.pins.drop(pin)
        if worker_meta.failed:
            # Counted here, once per item, however many ranks failed: all ranks encoded it.
            self.stats.add("load_failures", len(worker_meta.failed))
        if worker_meta.stats:
            self.stats.aggregate(SharedVolumeStats(data=dict(worker_meta.stats)))

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request; a producer returns each item's placeholder metadata."""
        self._finish_lookups(request)
        if not self.is_producer:
            return None
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata

        items = collect_ec_item_metadata(request.mm_features, self.resolver)
        for item in items.values():
            # Tells a consumer this item is on its way to the shared volume.
            announce(item, Announcement(fingerprint=self.config.model_fingerprint))
        return items or None

    def _forget(self, mm_hash: str) -> None:
        lookup = self._lookups.pop(mm_hash)
        verdict = lookup.verdict
        if verdict is not None and verdict.ok and verdict.pinned and verdict.pin:
            self.pins.drop(verdict.pin)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.pins.close()

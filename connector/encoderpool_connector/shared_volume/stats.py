"""The shared-volume transport's counters, from one table: ``SharedVolumeStats`` (what
vLLM logs) and ``SharedVolumePromMetrics`` (``encoderpool_ec_<name>_total``, as
``core.stats`` names every transport's metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from encoderpool_connector.core.stats import CounterPromMetrics, CounterStats

# name -> help; every key the shared-volume connector counts. Seconds are summed. Worker
# counters (loads, load_*) are the lead rank's: one count per item, not per rank.
SHARED_VOLUME_COUNTERS: dict[str, str] = {
    "lookups": "Items the consumer looked up in the shared volume.",
    "hits": "Lookups that found a verified entry (the consumer skips its encoder).",
    "misses": "Lookups that found no entry (the consumer encodes the item itself).",
    "rejected": "Entries found but rejected: corrupt, truncated, foreign model, wrong shape.",
    "unauthenticated": "Entries rejected because this pool has a key (env "
    "ENCODERPOOL_CHANNEL_KEY) and their mac was missing or wrong: written by someone "
    "without the key. Also counted in rejected.",
    "waits_timed_out": "Items a producer announced that never appeared in time.",
    "foreign_announcements": "Items announced by a producer of another model (a model "
    "change rolling): a miss at once, never a wait.",
    "loads": "Entries loaded into the encoder cache by the worker.",
    "load_failures": "Items whose load failed after verification on any tensor-parallel "
    "rank; every rank encoded the item in the same step instead.",
    "load_bytes": "Payload bytes loaded.",
    "load_seconds": "Seconds the worker spent loading (on the step path).",
    "load_buffer_fallbacks": "Loads read into a freshly allocated tensor because every "
    "load buffer was lent out (raise shared_volume.load_buffer_bytes).",
    "verify_seconds": "Seconds spent verifying entries (scheduler side, off the step path).",
    "saves_queued": "Encoder outputs handed to the background writer.",
    "saves_dropped": "Saves dropped because the writer queue was full, no staging memory "
    "was free, or the save failed (the consumer encodes those items itself).",
    "saves_dropped_staging": "Saves dropped because no free range of the producer's staging "
    "memory fitted the output, or (host outputs, held by reference) the outputs waiting for "
    "the writer already held the staging limit (the writer is behind, or the output is "
    "bigger than the limit); nothing is allocated on the encoder step instead. Also counted "
    "in saves_dropped.",
    "published": "Entries written and renamed into place.",
    "publish_skipped": "Saves skipped: an identical entry was already published.",
    "publish_bytes": "Bytes published.",
    "write_seconds": "Seconds the background writer spent writing and publishing.",
    "evicted": "Entries evicted to keep the directory under its capacity.",
    "evicted_bytes": "Bytes evicted.",
}


@dataclass
class SharedVolumeStats(CounterStats):
    """The shared-volume connector's counters."""

    counters: ClassVar[dict[str, str]] = SHARED_VOLUME_COUNTERS


class SharedVolumePromMetrics(CounterPromMetrics):
    """The shared-volume connector's counters as Prometheus counters."""

    counters: ClassVar[dict[str, str]] = SHARED_VOLUME_COUNTERS

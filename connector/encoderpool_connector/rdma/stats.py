"""The rdma transport's counters, from one table: ``RdmaStats`` (what vLLM logs) and
``RdmaPromMetrics`` (``encoderpool_ec_<name>_total``, as ``core.stats`` names every
transport's metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from encoderpool_connector.core.stats import CounterPromMetrics, CounterStats

# name -> help; every key the rdma connector counts. Seconds are summed.
RDMA_COUNTERS: dict[str, str] = {
    "lookups": "Items the consumer looked at (announced by a producer or not).",
    "hits": "Items READ from a producer and verified (the consumer skips its encoder).",
    "misses": "Items the consumer encodes itself (not announced, or the transfer failed).",
    "bad_coordinates": "Announced items whose coordinates failed validation.",
    "no_room": "Items not pulled because the consumer's buffer was full of in-flight items.",
    "transfer_failures": "READs that failed, or whose producer was unreachable or refused.",
    "transfer_timeouts": "READs (metadata fetch included) that exceeded transfer_timeout_ms.",
    "corrupt": "READs whose bytes did not match the announced checksum.",
    "pulled_bytes": "Bytes READ and verified.",
    "pull_seconds": "Seconds from starting a pull to its verdict (off the engine loop).",
    "loads": "Verified items copied into the encoder cache by the worker.",
    "load_failures": "Items whose copy out of the region failed on any tensor-parallel "
    "rank; every rank encoded the item in the same step instead.",
    "load_seconds": "Seconds the worker spent copying loads (on the step path).",
    "load_buffer_fallbacks": "Loads onto a device staged in freshly allocated host memory "
    "because every pooled (pinned) load buffer was lent out.",
    "saves_queued": "Encoder outputs the producer's step handed to its writer thread.",
    "saves": "Encoder outputs the producer's writer copied into registered memory.",
    "saves_dropped": "Encoder outputs not copied (no slot planned, too large, writer queue "
    "full, no staging memory, or an error); consumers encode those items.",
    "saves_dropped_staging": "Saves dropped because no free range of the producer's staging "
    "memory fitted the device output, or (host outputs, held by reference) the outputs "
    "waiting for the writer already held the staging limit; nothing is allocated or waited "
    "for on the encoder step instead. Also counted in saves_dropped.",
    "save_bytes": "Bytes copied into registered memory.",
    "save_seconds": "Seconds the producer's writer thread spent copying and checksumming "
    "(off the encoder step).",
    "announce_wait_seconds": "Seconds a producer's scheduler waited in request_finished for "
    "its writer to finish slots the step had queued.",
    "announce_waits_timed_out": "Items whose write was still queued or running when the wait "
    "in request_finished ran out: not announced (consumers encode them), their slot kept "
    "until the write ends.",
    "announced": "Items whose coordinates a producer returned in ec_transfer_params.",
    "unannounced": "Items a producer finished without coordinates (no slot, or not written).",
    "released": "Producer slots freed because every announced READ confirmed.",
    "expired": "Producer slots freed by age (slot_ttl_s).",
    "evicted": "Slots evicted to make room for newer items.",
    "evicted_bytes": "Bytes evicted.",
    "bad_notices": "Malformed NIXL notifications a producer ignored.",
    "unauthenticated": "Messages refused because their channel-key MAC did not verify "
    "(unsigned, another key, changed, stale or replayed): coordinates and side-channel "
    "replies on consumers, side-channel requests and release notices on producers.",
    "channel_refused": "Side-channel connections a producer refused or cut: over the "
    "per-peer or total cap, past their deadline, or malformed.",
}


@dataclass
class RdmaStats(CounterStats):
    """The rdma connector's counters."""

    counters: ClassVar[dict[str, str]] = RDMA_COUNTERS


class RdmaPromMetrics(CounterPromMetrics):
    """The rdma connector's counters as Prometheus counters."""

    counters: ClassVar[dict[str, str]] = RDMA_COUNTERS

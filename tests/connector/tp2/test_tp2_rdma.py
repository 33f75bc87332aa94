"""The rdma connector at tensor-parallel size 2 on the real engine: a TP=2 producer and a
TP=2 consumer (tiny Qwen2-VL, NIXL over UCX tcp/self/sm) against a TP=2 monolithic server.

Each server is an API server, an engine core and two worker ranks bound to cores 0
and 1; they start one after another (2 cores). The monolithic server is the package's
(``mono_tp2``, shared with the shared-volume module). The consumer carries the connector's
test hook (env ``ENCODERPOOL_TEST_FAIL_LOADS``): its rank 1 fails every copy out of
the region while a flag file exists, which only the last test creates.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.media import chat_request, encoder_request, image, image_part, token_ids
from e2e.vllm_server import VllmServer, free_port, tensor_parallel
from encoderpool_connector.core.ranks import FAULT_ENV
from encoderpool_connector.rdma.channel import WireError, fetch_peer
from encoderpool_contracts.integrity import AuthError, ChannelKey
from tests.connector.fixtures import EpFactory, metric, tiny_fingerprint
from tests.connector.rdma.fixtures import CONNECTOR, MODULE, UCX_ENV, rdma_config
from tests.router.fixtures import encoded_hashes
from tests.waiting import wait_until

# Alone: beside the kind suite's cluster every pull of a run timed out, even at 10 s. The
# cause was the consumer's engine spinning while it waited (fixed by
# core.lookups.wait_if_idle; docs/connector.md); the slack stays until runs beside the
# kind suite show it is not needed.
pytestmark = [pytest.mark.vllm, pytest.mark.alone]


@dataclass
class Tp2Pool:
    mono: VllmServer
    producer: VllmServer
    consumer: VllmServer
    fault: Path  # while it exists, the consumer's rank 1 fails its loads
    side_channel_port: int  # the producer's

    def encode(self, png: bytes) -> tuple[str, dict[str, Any]]:
        out = self.producer.chat(encoder_request(image_part(png)))
        assert out["usage"]["completion_tokens"] == 0, out
        params = out["ec_transfer_params"]
        ((mm_hash, item),) = params.items()
        assert item["encoderpool"]["rdma"], item  # rank 0 filled the slot in time
        # The item goes to the consumer once the producer's side channel answers a real
        # fetch within a second: on two cores shared with other engines (and the kind
        # suite) it can be slow for a while after an encode (docs/connector.md).
        wait_until("the producer's side channel answers within 1 s", self.side_channel_answers)
        return mm_hash, params

    def side_channel_answers(self) -> bool:
        started = time.monotonic()
        try:
            fetch_peer("127.0.0.1", self.side_channel_port, 1.0, ChannelKey.from_env(UCX_ENV))
        except (OSError, WireError, AuthError):
            return False
        return time.monotonic() - started < 1.0

    def consume(self, png: bytes, params: dict[str, Any]) -> list[int]:
        return token_ids(self.consumer.chat({**chat_request(png), "ec_transfer_params": params}))

    def expected(self, png: bytes) -> list[int]:
        return token_ids(self.mono.chat(chat_request(png)))


@pytest.fixture(scope="module")
def tp2(
    ep_servers: EpFactory,
    mono_tp2: VllmServer,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Tp2Pool:
    fault = tmp_path_factory.mktemp("tp2-rdma") / "fail-rank-1"
    # Nine engine processes share two cores here, beside the kind suite's cluster: give
    # the side channel and READs slack (a deadline is only waited out when starved).
    port = free_port()
    extra = rdma_config(
        tiny_fingerprint(tiny_model, tensor_parallel_size=2),
        port,
        metadata_timeout_ms=10000,
        transfer_timeout_ms=20000,
    )
    args, env = tensor_parallel(2)
    kw: dict[str, Any] = {"connector": CONNECTOR, "module": MODULE, "args": args}
    servers = []
    for name, role, more in (
        ("producer", "ec_producer", {**UCX_ENV, **env}),
        ("consumer", "ec_consumer", {**UCX_ENV, **env, FAULT_ENV: f"1:{fault}"}),
    ):
        # One at a time: TP=2 engines loading at once on two cores time out.
        server = ep_servers(name, role=role, extra=extra, env=more, **kw)
        servers.append(server.wait_ready(300))
    producer, consumer = servers
    pool = Tp2Pool(mono_tp2, producer, consumer, fault, port)
    # Warm-up: the consumer's first side-channel fetch of this producer; later items reuse
    # the fetched metadata and only READ.
    png = image(719)
    _, params = pool.encode(png)
    assert pool.consume(png, params) == pool.expected(png)
    return pool


def test_tp2_consumer_matches_monolithic_one_copy_one_count(tp2: Tp2Pool) -> None:
    """Both consumer ranks copy every pulled item out (the consumer does not encode it),
    one producer rank copies in, slots are reused only after both ranks copied, and the
    counters count items, not items times ranks. A pull the starved producer does not
    serve in time is a miss the consumer encodes (counted, same answer): every answer is
    compared, and the rank properties are checked on the items that were pulled."""
    images = [image(i) for i in range(720, 724)]
    counters = ("hits", "loads", "load_failures")
    before = {k: metric(tp2.consumer, f"encoderpool_ec_{k}_total") for k in counters}
    hashes = []
    for png in images:
        expected = tp2.expected(png)
        mm_hash, params = tp2.encode(png)
        hashes.append(mm_hash)
        assert tp2.consume(png, params) == expected
    assert set(hashes) <= encoded_hashes(tp2.producer.log_text())
    log = tp2.consumer.log_text()
    pulled = [h for h in hashes if h not in encoded_hashes(log)]
    assert pulled, "no item was pulled; every pull timed out (see the consumer's log)"
    after = {k: metric(tp2.consumer, f"encoderpool_ec_{k}_total") for k in counters}
    assert after["hits"] - before["hits"] == len(pulled)
    assert after["loads"] - before["loads"] == len(pulled)  # not 2 x: rank 0 counts
    assert after["load_failures"] == 0
    assert "failed on rank" not in log
    assert "fingerprints as" not in log  # the served identity is the pool's, TP=2 included
    for server in (tp2.producer, tp2.consumer):
        text = server.log_text()
        assert "rdma worker: tensor-parallel rank 0 of 2: writes items" in text
        assert "rdma worker: tensor-parallel rank 1 of 2: loads only" in text
    # One copier: the producer workers' totals (logged at most every 30 s) come from one
    # process only.
    copiers = set(
        re.findall(r"pid=(\d+)\) INFO .*encoderpool rdma worker totals", tp2.producer.log_text())
    )
    assert len(copiers) <= 1, copiers


def test_tp2_a_copy_failing_on_one_rank_is_encoded_by_both(tp2: Tp2Pool) -> None:
    """Rank 1 cannot copy the item out: both ranks drop it and encode it in the same step,
    so the answer is still the monolithic one, never one made from zeros. Up to three
    items, until one is pulled (a pull can time out here, see above)."""
    failures = metric(tp2.consumer, "encoderpool_ec_load_failures_total")
    for i in range(730, 733):
        png = image(i)
        expected = tp2.expected(png)
        mm_hash, params = tp2.encode(png)
        hits = metric(tp2.consumer, "encoderpool_ec_hits_total")
        tp2.fault.touch()
        try:
            assert tp2.consume(png, params) == expected
        finally:
            tp2.fault.unlink()
        log = tp2.consumer.log_text()
        assert mm_hash in encoded_hashes(log)  # pulled or not, the consumer encoded it
        if metric(tp2.consumer, "encoderpool_ec_hits_total") > hits:
            break
    else:
        pytest.fail("no item was pulled; every pull timed out (see the consumer's log)")
    assert "failed on rank 1" in log
    assert metric(tp2.consumer, "encoderpool_ec_load_failures_total") == failures + 1

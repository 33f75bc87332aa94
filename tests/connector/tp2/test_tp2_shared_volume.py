"""The shared-volume connector at tensor-parallel size 2 on the real engine: a TP=2
producer and a TP=2 consumer (tiny Qwen2-VL, whose heads divide by 2) against a TP=2
monolithic server.

Each server is an API server, an engine core and two worker ranks bound to cores 0
and 1; they start one after another (2 cores). The monolithic server is the package's
(``mono_tp2``, shared with the rdma module). The consumer carries the connector's
test hook (env ``ENCODERPOOL_TEST_FAIL_LOADS``): its rank 1 fails every load while a
flag file exists, which only the last test creates.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.media import chat_request, encoder_request, image, image_part, token_ids
from e2e.vllm_server import VllmServer, tensor_parallel
from encoderpool_connector.core.ranks import FAULT_ENV
from encoderpool_connector.shared_volume.entry import entry_name
from encoderpool_contracts import CHANNEL_KEY_ENV
from tests.connector.fixtures import EpFactory, metric, sv_config, tiny_fingerprint
from tests.router.fixtures import encoded_hashes
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

CHANNEL_KEY = "test-tp2-shared-volume-key-0123456789"


@dataclass
class Tp2Pool:
    mono: VllmServer
    producer: VllmServer
    consumer: VllmServer
    root: Path
    fingerprint: str
    fault: Path  # while it exists, the consumer's rank 1 fails its loads

    def encode(self, png: bytes) -> tuple[str, dict[str, object]]:
        out = self.producer.chat(encoder_request(image_part(png)))
        assert out["usage"]["completion_tokens"] == 0, out
        params = out["ec_transfer_params"]
        ((mm_hash, _),) = params.items()
        path = self.root / "entries" / entry_name(self.fingerprint, mm_hash)
        wait_until(f"entry of {mm_hash} published", path.is_file, timeout=30)
        return mm_hash, params

    def consume(self, png: bytes, params: dict[str, object]) -> list[int]:
        return token_ids(self.consumer.chat({**chat_request(png), "ec_transfer_params": params}))

    def expected(self, png: bytes) -> list[int]:
        return token_ids(self.mono.chat(chat_request(png)))

    def pins(self) -> list[str]:
        return [f for _, _, files in os.walk(self.root / "pins") for f in files]


@pytest.fixture(scope="module")
def tp2(
    ep_servers: EpFactory,
    mono_tp2: VllmServer,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Tp2Pool:
    base = tmp_path_factory.mktemp("tp2-sv")
    root = base / "volume" / "ec"
    fault = base / "fail-rank-1"
    # The pool's identity has the producers' parallelism (what the width Job measures).
    fingerprint = tiny_fingerprint(tiny_model, tensor_parallel_size=2)
    extra = sv_config(root, fingerprint)
    args, env = tensor_parallel(2)
    keyed = {**env, CHANNEL_KEY_ENV: CHANNEL_KEY}
    servers = []
    for name, role, more in (
        ("producer", "ec_producer", keyed),
        ("consumer", "ec_consumer", {**keyed, FAULT_ENV: f"1:{fault}"}),
    ):
        # One at a time: TP=2 engines loading at once on two cores time out.
        server = ep_servers(name, role=role, extra=extra, env=more, args=args)
        servers.append(server.wait_ready(300))
    producer, consumer = servers
    return Tp2Pool(mono_tp2, producer, consumer, root, fingerprint, fault)


def test_tp2_consumer_matches_monolithic_one_write_one_count(tp2: Tp2Pool) -> None:
    """Both ranks of the consumer get every embedding from the volume (neither encodes),
    pins go once both have read them, one rank of the producer writes, and the counters
    count items, not items times ranks."""
    images = [image(i) for i in range(700, 703)]
    hashes = []
    for png in images:
        expected = tp2.expected(png)
        mm_hash, params = tp2.encode(png)
        hashes.append(mm_hash)
        assert tp2.consume(png, params) == expected
    produced = encoded_hashes(tp2.producer.log_text())
    assert set(hashes) <= produced
    assert not encoded_hashes(tp2.consumer.log_text()) & set(hashes), "the consumer encoded"
    assert metric(tp2.consumer, "encoderpool_ec_hits_total") == len(images)
    assert metric(tp2.consumer, "encoderpool_ec_loads_total") == len(images)
    assert metric(tp2.consumer, "encoderpool_ec_load_failures_total") == 0
    assert tp2.pins() == []  # released after both ranks loaded (else rank 1 had failed)
    log = tp2.consumer.log_text()
    assert "failed on rank" not in log
    assert "fingerprints as" not in log  # the served identity is the pool's, TP=2 included
    for server in (tp2.producer, tp2.consumer):
        text = server.log_text()
        assert "tensor-parallel rank 0 of 2: writes items" in text
        assert "tensor-parallel rank 1 of 2: loads only" in text
    # One writer: its totals (logged at most every 30 s) come from one process, and no
    # second writer ever found an entry already published.
    producer_log = tp2.producer.log_text()
    writers = set(re.findall(r"pid=(\d+)\) INFO .*encoderpool writer totals", producer_log))
    assert len(writers) <= 1, writers
    assert "publish_skipped" not in producer_log


def test_tp2_a_load_failing_on_one_rank_is_encoded_by_both(tp2: Tp2Pool) -> None:
    """Rank 1 cannot read the entry: both ranks drop it and encode the item in the same
    step, so the answer is still the monolithic one, never one made from zeros."""
    png = image(710)
    expected = tp2.expected(png)
    mm_hash, params = tp2.encode(png)
    tp2.fault.touch()
    try:
        assert tp2.consume(png, params) == expected
    finally:
        tp2.fault.unlink()
    log = tp2.consumer.log_text()
    assert "failed on rank 1" in log
    assert mm_hash in encoded_hashes(log), "the consumer did not encode the failed item"
    assert metric(tp2.consumer, "encoderpool_ec_load_failures_total") == 1
    assert tp2.pins() == []
    # The next item loads again on both ranks.
    png = image(711)
    expected = tp2.expected(png)
    mm_hash, params = tp2.encode(png)
    assert tp2.consume(png, params) == expected
    assert mm_hash not in encoded_hashes(tp2.consumer.log_text())

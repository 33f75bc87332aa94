"""The RDMA connector on the real engine: an EncoderPoolNixlConnector producer and consumer
(tiny Qwen2-VL, NIXL over UCX tcp/self/sm) against a monolithic server.

Servers are shared by the module; every test uses images no other test uses (a
consumer's encoder cache hides items it has seen). The producer is killed by the last
test, so test order matters: pytest runs them in file order.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from e2e.media import chat_request, image, token_ids
from e2e.vllm_server import post_json
from tests.connector.rdma.fixtures import RdmaPool, metric

pytestmark = pytest.mark.vllm


def test_consumer_matches_monolithic_without_running_its_encoder(rdma_pool: RdmaPool) -> None:
    """Six images through the real router: equal token ids, no consumer encoder run."""
    pool = rdma_pool
    images = [image(i) for i in range(300, 306)]
    hits = metric(pool.consumer, "encoderpool_ec_hits_total")
    for png in images:
        expected = pool.expected(png)
        out = post_json(pool.router.url + "/v1/chat/completions", chat_request(png))
        assert token_ids(out) == expected
    produced = pool.producer_encoded()
    assert len(produced) >= len(images)
    assert not (pool.consumer_encoded() & produced), "the consumer ran its encoder"
    assert metric(pool.consumer, "encoderpool_ec_hits_total") >= hits + len(images)
    assert metric(pool.consumer, "encoderpool_ec_loads_total") >= len(images)
    assert metric(pool.consumer, "encoderpool_ec_pulled_bytes_total") >= len(images) * 16 * 128 * 2
    assert "encoderpool rdma producer: agent" in pool.producer.log_text()


def test_params_passed_by_hand_and_the_producer_frees_confirmed_slots(rdma_pool: RdmaPool) -> None:
    pool = rdma_pool
    png = image(310)
    expected = pool.expected(png)
    mm_hash, params = pool.encode(png)
    coords = params[mm_hash]["encoderpool"]["rdma"]
    assert coords["host"] == "127.0.0.1"
    assert coords["port"] == pool.side_channel_port
    assert coords["shape"] == [16, 128]
    assert coords["size"] == 16 * 128 * 2
    assert pool.consume(png, params) == expected
    assert mm_hash not in pool.consumer_encoded()
    # The READ's notification reaches the producer; it frees the slot on its next step.
    pool.encode(image(311))
    assert metric(pool.producer, "encoderpool_ec_released_total") >= 1


def _set(path: list[str], value: Any) -> Any:
    def spoil(params: dict[str, Any], mm_hash: str) -> dict[str, Any]:
        out = copy.deepcopy(params)
        node = out[mm_hash]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return out

    return spoil


def _replace_item(value: Any) -> Any:
    def spoil(params: dict[str, Any], mm_hash: str) -> dict[str, Any]:
        return {mm_hash: value}

    return spoil


HOSTILE = {
    "closed_port": _set(["encoderpool", "rdma", "port"], 1),
    "bad_host": _set(["encoderpool", "rdma", "host"], "evil host/../x"),
    "offset_outside": _set(["encoderpool", "rdma", "offset"], 1 << 40),
    "huge_size": _set(["encoderpool", "rdma", "size"], 1 << 33),
    "shape_lies": _set(["encoderpool", "rdma", "shape"], [1 << 20, 128]),
    "wrong_checksum": _set(["encoderpool", "rdma", "checksum"], "blake3:" + "0" * 64),
    "wrong_agent": _set(["encoderpool", "rdma", "agent"], "ep-p-1-impostor"),
    "foreign_model": _set(["encoderpool", "fingerprint"], "ffffffffffffffff"),
    "rdma_garbage": _set(["encoderpool", "rdma"], "\x00garbage" * 100),
    "item_garbage": _replace_item([1, 2, {"x": None}]),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_bad_or_hostile_params_fall_back_to_encoding(rdma_pool: RdmaPool, case: str) -> None:
    pool = rdma_pool
    png = image(320 + list(HOSTILE).index(case))
    expected = pool.expected(png)
    mm_hash, params = pool.encode(png)
    misses = metric(pool.consumer, "encoderpool_ec_misses_total")
    assert pool.consume(png, HOSTILE[case](params, mm_hash)) == expected
    assert mm_hash in pool.consumer_encoded()
    if case != "item_garbage":  # an item that is not even a dict is simply unannounced
        assert metric(pool.consumer, "encoderpool_ec_misses_total") == misses + 1


def test_garbage_top_level_params_are_a_miss(rdma_pool: RdmaPool) -> None:
    pool = rdma_pool
    png = image(340)
    expected = pool.expected(png)
    assert pool.consume(png, {"not-a-hash": {"encoderpool": {"v": 1}}}) == expected
    assert token_ids(pool.consumer.chat(chat_request(image(341)))) == pool.expected(image(341))


def test_producer_killed_consumer_still_answers(rdma_pool: RdmaPool) -> None:
    """Runs last: the producer is gone, its announced items are encoded by the consumer."""
    pool = rdma_pool
    png = image(350)
    expected = pool.expected(png)
    mm_hash, params = pool.encode(png)
    pool.producer.stop()
    assert pool.consume(png, params) == expected
    assert mm_hash in pool.consumer_encoded()
    failures = metric(pool.consumer, "encoderpool_ec_transfer_failures_total")
    timeouts = metric(pool.consumer, "encoderpool_ec_transfer_timeouts_total")
    assert failures + timeouts >= 1
    # And through the router, whose producer is gone: the consumer still answers alone.
    png2 = image(351)
    assert pool.consume(png2, None) == pool.expected(png2)

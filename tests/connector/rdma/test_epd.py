"""The RDMA connector on the real engine: an EncoderPoolNixlConnector producer and consumer
(tiny Qwen2-VL, NIXL over UCX tcp/self/sm) against a monolithic server.

Servers are shared by the module; every test uses images no other test uses (a
consumer's encoder cache hides items it has seen). The producer is killed by the last
test, so test order matters: pytest runs them in file order.
"""

from __future__ import annotations

import copy
import socket
import time
from typing import Any

import pytest

from e2e.media import chat_request, image, token_ids
from e2e.vllm_server import post_json
from encoderpool_connector.rdma.auth import COORDINATES, META_REPLY
from encoderpool_connector.rdma.channel import encode_frame, fetch_peer, meta_request, read_frame
from encoderpool_contracts.integrity import ChannelKey
from tests.connector.fixtures import metric
from tests.connector.rdma.fixtures import CHANNEL_KEY, RdmaPool
from tests.connector.rdma.slow_loris import slow_loris

KEY = ChannelKey(CHANNEL_KEY.encode())
OTHER_KEY = ChannelKey(b"another-pool-s-channel-key-012345")


def resign(
    params: dict[str, Any], mm_hash: str, fp: str, key: ChannelKey = KEY, **over: Any
) -> Any:
    """The item's coordinates changed by ``over``, then signed with ``key``: what a holder of
    that key (a producer of that pool) could announce."""
    out = copy.deepcopy(params)
    rdma = out[mm_hash]["encoderpool"]["rdma"]
    if isinstance(rdma, dict):
        body = {k: v for k, v in rdma.items() if k != "mac"} | over
        mac = key.mac(COORDINATES, {"coords": body, "mm_hash": mm_hash, "fingerprint": fp})
        out[mm_hash]["encoderpool"]["rdma"] = {**body, "mac": mac}
    return out


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
    spoiled = HOSTILE[case](params, mm_hash)
    if case not in ("rdma_garbage", "item_garbage"):  # a key holder's bad coordinates
        spoiled = resign(spoiled, mm_hash, pool.fingerprint)
    assert pool.consume(png, spoiled) == expected
    assert mm_hash in pool.consumer_encoded()
    if case != "item_garbage":  # an item that is not even a dict is simply unannounced
        assert metric(pool.consumer, "encoderpool_ec_misses_total") == misses + 1


def test_garbage_top_level_params_are_a_miss(rdma_pool: RdmaPool) -> None:
    pool = rdma_pool
    png = image(340)
    expected = pool.expected(png)
    assert pool.consume(png, {"not-a-hash": {"encoderpool": {"v": 1}}}) == expected
    assert token_ids(pool.consumer.chat(chat_request(image(341)))) == pool.expected(image(341))


class Listener:
    """A TCP port that is no producer: counts who connects."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1


def _unsigned(params: dict[str, Any], mm_hash: str) -> dict[str, Any]:
    del params[mm_hash]["encoderpool"]["rdma"]["mac"]
    return params


FORGED = {
    "unsigned": lambda p, h, fp, port: _unsigned(resign(p, h, fp, port=port), h),
    "another_pool_s_key": lambda p, h, fp, port: resign(p, h, fp, OTHER_KEY, port=port),
    "changed_after_signing": lambda p, h, fp, port: _moved(p, h, port),
    "stale": lambda p, h, fp, port: resign(p, h, fp, port=port, ts=time.time() - 400),
    "other_item": None,
}


def _moved(params: dict[str, Any], mm_hash: str, port: int) -> dict[str, Any]:
    out = copy.deepcopy(params)
    out[mm_hash]["encoderpool"]["rdma"]["port"] = port  # the producer's mac kept
    return out


@pytest.mark.parametrize("case", list(FORGED))
def test_forged_replayed_or_moved_announcements_are_refused_before_any_read(
    rdma_pool: RdmaPool, case: str
) -> None:
    """Coordinates the pool's key did not sign for this item now, all but one naming a port
    that is no producer: the consumer never connects there, READs nothing, encodes the
    item itself and answers as monolithic; the counter and a warning say why."""
    pool = rdma_pool
    png = image(360 + list(FORGED).index(case))
    expected = pool.expected(png)
    mm_hash, params = pool.encode(png)
    listener = Listener()
    if case == "other_item":  # a genuine announcement of another item, replayed on this one
        other_hash, other = pool.encode(image(369))
        forged = {mm_hash: {**params[mm_hash], "encoderpool": other[other_hash]["encoderpool"]}}
    else:
        make = FORGED[case]
        assert make is not None
        forged = make(params, mm_hash, pool.fingerprint, listener.port)
    before = {
        name: metric(pool.consumer, f"encoderpool_ec_{name}_total")
        for name in ("unauthenticated", "pulled_bytes", "transfer_failures")
    }
    assert pool.consume(png, forged) == expected
    assert mm_hash in pool.consumer_encoded()
    assert metric(pool.consumer, "encoderpool_ec_unauthenticated_total") == (
        before["unauthenticated"] + 1
    )
    assert metric(pool.consumer, "encoderpool_ec_pulled_bytes_total") == before["pulled_bytes"]
    assert (
        metric(pool.consumer, "encoderpool_ec_transfer_failures_total")
        == (before["transfer_failures"])
    )
    assert listener.connections() == 0
    assert "encoderpool: refused item coordinates naming" in pool.consumer.log_text()
    # The honest path right after: a hit, equal to monolithic.
    png2 = image(370 + list(FORGED).index(case))
    h2, p2 = pool.encode(png2)
    assert pool.consume(png2, p2) == pool.expected(png2)
    assert h2 not in pool.consumer_encoded()


def _exchange(port: int, request: Any, source: str = "127.0.0.1") -> Any:
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        s.sendall(encode_frame(request))
        return read_frame(s, 1 << 20, time.monotonic() + 5)


def test_the_producer_s_side_channel_refuses_unsigned_forged_and_replayed_requests(
    rdma_pool: RdmaPool,
) -> None:
    """The real producer gives its agent metadata (its memory keys) only to a fresh request
    signed with the pool's key, once per nonce."""
    pool = rdma_pool
    port = pool.side_channel_port
    honest, nonce = meta_request(KEY, time.time())
    reply = _exchange(port, honest)
    assert KEY.check(META_REPLY, reply)["nonce"] == nonce
    assert reply["metadata"]
    for request in (
        {"v": 1, "op": "meta"},
        meta_request(OTHER_KEY, time.time())[0],
        honest,  # replayed
        meta_request(KEY, time.time() - 120)[0],
    ):
        assert _exchange(port, request) == {"v": 1, "ok": False, "error": "unauthenticated"}
    pool.encode(image(380))  # a step: the producer's counters reach its metrics
    assert metric(pool.producer, "encoderpool_ec_unauthenticated_total") >= 4
    assert "refused a side-channel request from 127.0.0.1" in pool.producer.log_text()


def test_a_slow_loris_is_cut_at_the_deadline_while_honest_peers_are_served(
    rdma_pool: RdmaPool,
) -> None:
    """Ten connections from 127.0.0.2 each sending a byte every 0.1 s: four are held until the
    1 s deadline (metadata_timeout_ms), six are refused at once (per-peer cap); meanwhile a
    signed fetch from 127.0.0.1 is served and an item goes producer -> consumer as a hit."""
    pool = rdma_pool
    served, served_at = None, -1.0

    def honest_fetch(elapsed: float) -> None:
        nonlocal served, served_at
        if served is None and elapsed > 0.2:
            served = fetch_peer("127.0.0.1", pool.side_channel_port, 5.0, KEY)
            served_at = elapsed

    times = slow_loris(pool.side_channel_port, 10, honest_fetch)
    print(f"slow loris: closed at {[round(t, 2) for t in times]} s; served at {served_at:.2f} s")
    assert served is not None
    assert served_at < 1.0  # while the four were held
    assert len(times) == 10, times
    assert sum(t < 0.6 for t in times) == 6, times
    assert all(0.8 < t < 3.0 for t in times[6:]), times
    png = image(385)
    mm_hash, params = pool.encode(png)
    assert pool.consume(png, params) == pool.expected(png)
    assert mm_hash not in pool.consumer_encoded()


@pytest.mark.breaks_shared_servers
def test_producer_killed_consumer_still_answers(rdma_pool: RdmaPool) -> None:
    """Runs last in the package: the producer is gone, its announced items are encoded by
    the consumer."""
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

"""Videos through an rdma pool on the real engine: an EncoderPoolNixlConnector producer and
consumer (tiny Qwen2-VL, NIXL over UCX tcp/self/sm) against a monolithic server, by hand
and through the real router (``rdma_pool``).

A video (``e2e.media.video``: 4 JPEG frames of 112x112) is 32 encoder tokens of width
128. Each test uses videos and images no other test uses (a consumer's encoder cache
hides items it has already seen).
"""

from __future__ import annotations

from typing import Any

import pytest

from e2e.media import Video, chat_request, encoder_request, image, token_ids, video, video_part
from e2e.vllm_server import post_json
from tests.connector.fixtures import TINY_WIDTHS, metric, producer_widths
from tests.connector.rdma.fixtures import RdmaPool

pytestmark = pytest.mark.vllm

TEXT = "Describe this video."
VIDEO_TOKENS = 32  # 4 frames -> 2 temporal patches x (8 x 8) / (2 x 2) merge


def expected(pool: RdmaPool, *media: bytes | Video) -> list[int]:
    return token_ids(pool.mono.chat(chat_request(*media, text=TEXT)))


def test_video_over_rdma_matches_monolithic_without_the_consumer_encoding(
    rdma_pool: RdmaPool,
) -> None:
    """The producer offers each video's 32 x 128 embedding; the consumer READs it and
    answers as the monolithic server, its encoder idle."""
    pool = rdma_pool
    assert producer_widths(pool.producer.log_text()) == TINY_WIDTHS  # as configured
    clips = [video(i) for i in range(500, 503)]
    pulled = metric(pool.consumer, "encoderpool_ec_pulled_bytes_total")
    answers, hashes = [], []
    for clip in clips:
        want = expected(pool, clip)
        out = pool.producer.chat(encoder_request(video_part(clip)))
        assert out["usage"]["completion_tokens"] == 0, out
        params: dict[str, Any] = out["ec_transfer_params"]
        ((mm_hash, item),) = params.items()
        assert item["metadata"] == {"video_grid_thw": [2, 8, 8]}, item
        coords = item["encoderpool"]["rdma"]
        assert coords["shape"] == [VIDEO_TOKENS, 128]
        assert coords["size"] == VIDEO_TOKENS * 128 * 2
        body = chat_request(clip, text=TEXT)
        body["ec_transfer_params"] = params
        assert token_ids(pool.consumer.chat(body)) == want
        answers.append(want)
        hashes.append(mm_hash)
    assert len({tuple(a) for a in answers}) > 1  # the videos' answers tell them apart
    assert set(hashes) <= pool.producer_encoded()
    assert not set(hashes) & pool.consumer_encoded(), "the consumer encoded a video itself"
    pulled_now = metric(pool.consumer, "encoderpool_ec_pulled_bytes_total")
    assert pulled_now - pulled >= len(clips) * VIDEO_TOKENS * 128 * 2


@pytest.mark.parametrize(
    "media",
    [(image(510), video(510)), (video(511), video(512))],
    ids=["image+video", "two-videos"],
)
def test_video_over_rdma_through_the_router_matches_monolithic(
    rdma_pool: RdmaPool, media: tuple[bytes | Video, ...]
) -> None:
    """Each item of a request goes to the producer; the consumer encodes none of them."""
    pool = rdma_pool
    want = expected(pool, *media)
    produced_before, consumed_before = pool.producer_encoded(), pool.consumer_encoded()
    out = post_json(pool.router.url + "/v1/chat/completions", chat_request(*media, text=TEXT))
    assert token_ids(out) == want
    assert len(pool.producer_encoded() - produced_before) == len(media)
    assert pool.consumer_encoded() == consumed_before, "the consumer encoded an item itself"

"""Videos through a shared-volume pool on the real engine (tiny Qwen2-VL): a producer and a
consumer against a monolithic server, by hand and through the real router.

A video is a few JPEG frames (``e2e.media.video``): 4 frames of 112x112 are 32 encoder
tokens of width 128, 2 temporal patches of 8x8 after the merge. Servers are shared by
the package (``sv_servers``: ``test_epd``'s too), the monolithic server by the session;
each test uses videos and images no other test uses (a consumer's encoder cache hides
items it has already seen).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.media import Video, chat_request, encoder_request, image, token_ids, video, video_part
from e2e.vllm_server import VllmServer, post_json
from encoderpool_connector.shared_volume.entry import (
    Header,
    encode_prefix,
    entry_name,
    parse_prefix,
)
from encoderpool_contracts.integrity import checksum
from tests.connector.fixtures import TINY_WIDTHS, producer_widths
from tests.connector.shared_volume.fixtures import KEY, SvServers
from tests.router.fixtures import RouterProcess, encoded_hashes
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

TEXT = "Describe this video."
VIDEO_TOKENS = 32  # 4 frames -> 2 temporal patches x (8 x 8) / (2 x 2) merge


@dataclass
class VideoPool:
    mono: VllmServer
    producer: VllmServer
    consumer: VllmServer
    router: RouterProcess
    root: Path
    fingerprint: str

    def expected(self, *media: bytes | Video, **fields: Any) -> list[int]:
        return token_ids(self.mono.chat({**chat_request(*media, text=TEXT), **fields}))

    def encode(self, clip: Video) -> tuple[str, dict[str, Any]]:
        """The router's per-item step by hand: the producer encodes the video alone."""
        out = self.producer.chat(encoder_request(video_part(clip)))
        assert out["usage"]["completion_tokens"] == 0, out
        params = out["ec_transfer_params"]
        ((mm_hash, item),) = params.items()
        # What a consumer that skipped preprocessing would need: the grid of patches.
        assert item["metadata"] == {"video_grid_thw": [2, 8, 8]}, item
        assert item["encoderpool"]["fingerprint"] == self.fingerprint
        return mm_hash, params

    def consume(self, clip: Video, params: dict[str, Any]) -> list[int]:
        body = chat_request(clip, text=TEXT)
        body["ec_transfer_params"] = params
        return token_ids(self.consumer.chat(body))

    def published(self, mm_hash: str) -> Path:
        path = self.root / "entries" / entry_name(self.fingerprint, mm_hash)
        wait_until(f"entry of {mm_hash} published", path.is_file, timeout=30)
        return path

    def encoded(self) -> tuple[set[str], set[str]]:
        """The hashes producer and consumer have run their encoders on so far."""
        return encoded_hashes(self.producer.log_text()), encoded_hashes(self.consumer.log_text())


@pytest.fixture(scope="module")
def video_pool(monolithic: VllmServer, sv_servers: SvServers) -> Iterator[VideoPool]:
    producer, consumer = sv_servers.producer, sv_servers.consumer
    # The servers take per-request media kwargs (--trust-request-mm-kwargs): so does the
    # router, else it refuses them as vLLM does by default.
    router = RouterProcess(
        ["--producers", producer.url, "--consumers", consumer.url,
         "--trust-request-mm-kwargs", "true"],
        sv_servers.root.parent / "video-router.log",
    ).start()  # fmt: skip
    try:
        yield VideoPool(
            monolithic, producer, consumer, router, sv_servers.root, sv_servers.fingerprint
        )
    finally:
        router.stop()


def test_video_through_producer_and_consumer_matches_monolithic(video_pool: VideoPool) -> None:
    """The producer measured and serves video; the consumer loads each video's entry
    (32 tokens x 128) and answers as the monolithic server, its encoder idle."""
    pool = video_pool
    assert producer_widths(pool.producer.log_text()) == TINY_WIDTHS  # as configured
    clips = [video(i) for i in range(400, 403)]
    answers = []
    hashes = []
    for clip in clips:
        expected = pool.expected(clip)
        mm_hash, params = pool.encode(clip)
        header, _ = parse_prefix(pool.published(mm_hash).read_bytes())
        assert header.shape == (VIDEO_TOKENS, 128)
        assert pool.consume(clip, params) == expected
        answers.append(expected)
        hashes.append(mm_hash)
    assert len({tuple(a) for a in answers}) > 1  # the videos' answers tell them apart
    produced, consumed = pool.encoded()
    assert set(hashes) <= produced
    assert not set(hashes) & consumed, "the consumer encoded a video itself"


def test_video_consumer_serves_the_entry_not_its_encoder(video_pool: VideoPool) -> None:
    """Video a's embedding published under video b's key: the consumer answers b as a."""
    pool = video_pool
    a, b = video(410), video(411)
    expected_a = pool.expected(a)
    assert pool.expected(b) != expected_a
    hash_a, _ = pool.encode(a)
    hash_b, params_b = pool.encode(b)
    raw = pool.published(hash_a).read_bytes()
    header, offset = parse_prefix(raw)
    payload = raw[offset:]
    forged = Header(hash_b, header.fingerprint, header.dtype, header.shape, checksum(payload))
    pool.published(hash_b).write_bytes(encode_prefix(forged.signed(KEY)) + payload)
    assert pool.consume(b, params_b) == expected_a
    assert hash_b not in pool.encoded()[1]


@pytest.mark.parametrize(
    ("media", "kwargs"),
    [
        ((image(420), video(420)), {}),
        ((video(421), video(422)), {}),
        # Decoding options travel with the item: the producer decodes 2 frames as the
        # consumer does (16 tokens), or the consumer could not use its entry.
        ((video(423),), {"media_io_kwargs": {"video": {"num_frames": 2}}}),
    ],
    ids=["image+video", "two-videos", "media_io_kwargs"],
)
def test_video_through_the_router_matches_monolithic(
    video_pool: VideoPool, media: tuple[bytes | Video, ...], kwargs: dict[str, Any]
) -> None:
    """Each item of a request goes to the producer; the consumer encodes none of them."""
    pool = video_pool
    expected = pool.expected(*media, **kwargs)
    produced_before, consumed_before = pool.encoded()
    body = {**chat_request(*media, text=TEXT), **kwargs}
    assert token_ids(post_json(pool.router.url + "/v1/chat/completions", body)) == expected
    produced, consumed = pool.encoded()
    assert len(produced - produced_before) == len(media)
    assert consumed == consumed_before, "the consumer encoded an item itself"


def test_a_video_decoded_otherwise_by_the_producer_is_encoded_by_the_consumer(
    video_pool: VideoPool,
) -> None:
    """What forwarding ``media_io_kwargs`` prevents: the producer encoded all 4 frames, the
    request wants 2. The consumer does not serve the 4-frame embedding: it encodes the
    video itself and answers as the monolithic server does."""
    pool = video_pool
    clip = video(430)
    fields = {"media_io_kwargs": {"video": {"num_frames": 2}}}
    expected = pool.expected(clip, **fields)
    assert expected != pool.expected(clip)  # 2 frames answer otherwise than 4
    _, params = pool.encode(clip)
    consumed_before = pool.encoded()[1]
    body = {**chat_request(clip, text=TEXT), **fields, "ec_transfer_params": params}
    assert token_ids(pool.consumer.chat(body)) == expected
    assert pool.encoded()[1] - consumed_before, "the consumer did not encode the video"

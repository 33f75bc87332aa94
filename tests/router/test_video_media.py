"""The router's view of video items (no engine): found, counted by modality, keyed, and
sent to a producer with the options that change how they are decoded. The real-engine
video tests are tests/connector/*/test_video.py."""

from __future__ import annotations

from e2e.media import chat_request, image, video, video_part
from encoderpool_router.content import read_media
from encoderpool_router.media import media_key, mm_kwargs_problem, over_limits
from encoderpool_router.producer_request import encoder_request


def test_video_items_are_media_counted_as_video() -> None:
    body = chat_request(image(1), video(1), video(2))
    items = read_media(body, trust_ids=False).parts
    assert [p["type"] for p in items] == ["image_url", "video_url", "video_url"]
    assert over_limits(items, 8, {"image": 1, "video": 2}) is None
    assert over_limits(items, 8, {"video": 1}) == (
        "2 video items in one request; this model accepts at most 1"
    )
    assert over_limits(items, 8, {"image": 1, "video": 0}) is not None


def test_video_keys_are_stable_and_distinct() -> None:
    assert media_key(video_part(video(3))) == media_key(video_part(video(3)))
    assert media_key(video_part(video(3))) != media_key(video_part(video(4)))
    assert media_key(video_part(video(3), uuid="clip")) == media_key(
        video_part(video(5), uuid="clip")
    )


def test_video_decoding_options_go_to_the_producer_with_the_item() -> None:
    """num_frames/fps change which frames are encoded: a producer that decoded otherwise
    would publish an embedding the consumer cannot use."""
    part = video_part(video(6))
    body = {
        **chat_request(image(6)),
        "media_io_kwargs": {"video": {"num_frames": 2}},
        "mm_processor_kwargs": {"max_pixels": 12544},
        "max_tokens": 50,
    }
    assert encoder_request(body, part) == {
        "model": body["model"],
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
        "stream": False,
        "mm_processor_kwargs": {"max_pixels": 12544},
        "media_io_kwargs": {"video": {"num_frames": 2}},
    }


def test_the_test_video_is_deterministic_and_small() -> None:
    a, b = video(7), video(7)
    assert a == b
    assert a != video(8)
    assert len(a.frames) == 4
    assert sum(len(f) for f in a.frames) < 40_000
    assert a.data_url().startswith("data:video/jpeg;base64,")
    assert a.data_url().count(",") == 4  # the prefix's, then one between frames


def test_media_kwargs_are_refused_unless_the_pool_trusts_them_and_then_bounded() -> None:
    """vLLM's rule (any non-empty value, unless --trust-request-mm-kwargs), applied before
    any producer is asked; trusted, a size bound."""
    frames = {"media_io_kwargs": {"video": {"num_frames": 2}}}
    assert mm_kwargs_problem({**chat_request(image(1)), **frames}, trusted=True) is None
    refused = mm_kwargs_problem({**chat_request(image(1)), **frames}, trusted=False)
    assert refused is not None
    assert "spec.router.trustRequestMmKwargs" in refused
    assert mm_kwargs_problem({"mm_processor_kwargs": {}}, trusted=False) is None  # empty: as vLLM
    huge = {"mm_processor_kwargs": {"k": "x" * 5000}}
    assert "4096 bytes" in str(mm_kwargs_problem(huge, trusted=True))
    assert mm_kwargs_problem({"media_io_kwargs": [1]}, trusted=True) == (
        "media_io_kwargs must be an object"
    )

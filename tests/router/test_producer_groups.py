"""Producer groups: each media item goes to its modality's producers, and an item of a
modality without a group goes to no producer (the consumer encodes it). Fake backends
in process; the real-engine test is test_vllm_groups.py."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from e2e.media import MODEL, image, image_part
from encoderpool_router.backends import BackendSet, producer_groups
from encoderpool_router.config import RouterSettings, parse_settings
from tests.router.fixtures import (
    FakeBackend,
    fake_mm_hash,
    fakes,
    router_at,
    run,
    sent_parts,
    video_part,
)

CONSUMER = "http://127.0.0.1:9000"


def audio_part(index: int) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": f"UklGR{index}", "format": "wav"}}


def request(*parts: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
        "max_tokens": 4,
    }


async def post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


def test_each_item_goes_to_its_modality_s_group_and_an_ungrouped_one_to_no_producer() -> None:
    img, vid, aud = image_part(image(1)), video_part(2), audio_part(3)
    body = request(img, vid, aud)

    async def scenario() -> None:
        pi, pv, c = FakeBackend("producer-img"), FakeBackend("producer-vid"), FakeBackend("c")
        async with (
            fakes(pi, pv, c) as (iurl, vurl, curl),
            router_at(
                consumers=[curl], producers_by_modality={"image": (iurl,), "video": (vurl,)}
            ) as (router, url),
        ):
            status, out = await post(url + "/v1/chat/completions", body)
            assert status == 200, out
            assert sent_parts(pi) == [img]  # images to the image group only
            assert sent_parts(pv) == [vid]  # video to the video group only
            (seen,) = c.seen
            assert seen.body is not None
            # Params for the two grouped items; the audio item has none: the consumer
            # encodes it.
            assert seen.body["ec_transfer_params"] == {
                fake_mm_hash(img): {"by": "producer-img"},
                fake_mm_hash(vid): {"by": "producer-vid"},
            }
            items = router.metrics.registry.get_sample_value
            assert items("encoderpool_router_media_items_total", {"encoded": "remote"}) == 2
            assert items("encoderpool_router_media_items_total", {"encoded": "local"}) == 1
            # By design, not a failure: no error is counted for the ungrouped item.
            assert items("encoderpool_router_errors_total", {"kind": "producer_unavailable"}) == 0
            status, health = await post_get(url + "/health")
            assert health["producers"] == 2

    run(scenario())


async def post_get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json(content_type=None)


def test_a_group_may_serve_several_modalities_and_shares_its_producers() -> None:
    s = RouterSettings(
        consumers=(CONSUMER,),
        producers_by_modality={
            "image": ("http://127.0.0.1:8001",),
            "video": ("http://127.0.0.1:8001",),
        },
    )
    groups = producer_groups(s, BackendSet("producer"))
    image_set, video_set = groups.by_modality.get("image"), groups.by_modality.get("video")
    assert image_set is video_set  # one set: in-flight counts are the producers' own
    assert image_set is not None
    assert image_set.role == "producer-image+video"
    assert groups.by_modality.get("audio") is None
    assert groups.sets == [image_set]


def test_without_groups_every_modality_goes_to_the_one_producer_set() -> None:
    s = RouterSettings(consumers=(CONSUMER,), producers=("http://127.0.0.1:8001",))
    producers = BackendSet("producer", s.producers)
    groups = producer_groups(s, producers)
    assert all(groups.by_modality.get(m) is producers for m in ("image", "video", "audio"))
    assert groups.sets == [producers]
    assert groups.services == {}


def test_groups_from_endpoint_slices_watch_one_service_per_group() -> None:
    s = parse_settings(
        [
            "--producer-services-by-modality",
            json.dumps({"image": "pool-producer-images", "video": "pool-producer-video"}),
            "--consumer-service",
            "pool-consumer",
            "--namespace",
            "ml",
        ]
    )
    assert s.discovery
    assert s.grouped
    groups = producer_groups(s, BackendSet("producer"))
    assert sorted(groups.services) == ["pool-producer-images", "pool-producer-video"]
    assert groups.services["pool-producer-images"] is groups.by_modality.get("image")
    assert groups.services["pool-producer-video"] is groups.by_modality.get("video")
    assert groups.by_modality.get("audio") is None


def test_groups_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    s = parse_settings(
        [
            "--producers-by-modality",
            '{"image": "http://127.0.0.1:8001,http://127.0.0.1:8002"}',
            "--consumers",
            CONSUMER,
        ]
    )
    assert s.producers_by_modality == {"image": ("http://127.0.0.1:8001", "http://127.0.0.1:8002")}
    monkeypatch.setenv(
        "ENCODERPOOL_ROUTER_PRODUCERS_BY_MODALITY", '{"video": ["http://127.0.0.1:8003/"]}'
    )
    monkeypatch.setenv("ENCODERPOOL_ROUTER_CONSUMERS", CONSUMER)
    assert parse_settings([]).producers_by_modality == {"video": ("http://127.0.0.1:8003",)}


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (
            ["--producers-by-modality", '{"smell": ["http://127.0.0.1:1"]}'],
            "--producers-by-modality (ENCODERPOOL_ROUTER_PRODUCERS_BY_MODALITY): unknown "
            "modality ['smell']",
        ),
        (["--producers-by-modality", '{"image": []}'], "list no producer"),
        (["--producers-by-modality", "image=http://x"], "not JSON"),
        (["--producers-by-modality", '{"image": ["ftp://x"]}'], "is not a base URL"),
        (
            ["--producers-by-modality", '{"image": ["http://127.0.0.1:1"]}', "--producers",
             "http://127.0.0.1:2"],
            "not both",
        ),
        (
            ["--producer-services-by-modality", '{"image": "Bad_Name"}', "--consumer-service",
             "c"],
            "is not a Service name",
        ),
        (
            ["--producer-services-by-modality", '{"image": "a"}', "--producer-service", "b",
             "--consumer-service", "c"],
            "not both",
        ),
        (
            ["--producer-services-by-modality", '{"image": "a"}', "--consumers", CONSUMER],
            "not both",
        ),
    ],
)  # fmt: skip
def test_bad_groups_are_refused_naming_the_flag(argv: list[str], problem: str) -> None:
    args = argv if "--consumers" in argv or "--consumer-service" in argv else [
        *argv, "--consumers", CONSUMER
    ]  # fmt: skip
    with pytest.raises(ValueError, match="invalid router settings") as info:
        parse_settings(args)
    assert problem in str(info.value)

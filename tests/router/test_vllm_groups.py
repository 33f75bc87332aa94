"""Producer groups on real vLLM: the router sends each item to its modality's group, and
an item of a modality without a group is encoded by the consumer.

The package's two producers with our shared-volume connector stand for two groups
(images, video), beside its consumer and the monolithic reference server. "Who encoded"
is read from each server's DEBUG log (``Finish execute for mm hash X``), as in
test_vllm.py. One request holds two images and a tiny video: each goes to its own
group's producer, and the consumer encodes none of them (routing for audio is covered
with fakes in test_producer_groups.py: the tiny model has no audio tower).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.media import chat_request, image, token_ids, video
from e2e.vllm_server import VllmServer, post_json
from tests.router.fixtures import API_KEY, RouterPool, RouterProcess, encoded_hashes

pytestmark = pytest.mark.vllm

ITEMS = "encoderpool_router_media_items_total"


@dataclass
class Groups:
    mono: VllmServer
    consumer: VllmServer
    images: VllmServer  # the image group's producer
    video: VllmServer  # the video group's producer
    logs: Path

    def router(self, groups: dict[str, list[str]], name: str) -> RouterProcess:
        """A router over these servers with ``groups`` as its producer groups."""
        return RouterProcess(
            [
                "--producers-by-modality", json.dumps(groups),
                "--consumers", self.consumer.url,
                "--log-level", "DEBUG",
            ],
            self.logs / f"groups-{os.getpid()}-{name}.log",
            env={"ENCODERPOOL_ROUTER_BACKEND_API_KEY": API_KEY},
        )  # fmt: skip

    def encoded(self) -> dict[str, set[str]]:
        """mm hashes each EPD server has encoded so far."""
        servers = {"consumer": self.consumer, "images": self.images, "video": self.video}
        return {name: encoded_hashes(s.log_text()) for name, s in servers.items()}


@pytest.fixture(scope="module")
def groups(router_servers: RouterPool, vllm_logs: Path, monolithic: VllmServer) -> Groups:
    """The package's servers: its producer is the image group, ``video`` the video group."""
    pool = router_servers
    return Groups(monolithic, pool.consumer, pool.producer, pool.video, vllm_logs)


def test_each_item_goes_to_its_modalitys_group(groups: Groups) -> None:
    router = groups.router(
        {"image": [groups.images.url], "video": [groups.video.url]}, "two-groups"
    ).start()
    try:
        body = chat_request(image(700), video(702), image(701))
        expected = token_ids(groups.mono.chat(body))
        before = groups.encoded()
        got = token_ids(post_json(router.url + "/v1/chat/completions", body))
        assert got == expected
        after = groups.encoded()
        assert len(after["images"] - before["images"]) == 2  # the image group: both images
        assert len(after["video"] - before["video"]) == 1  # the video group: the video
        assert not (after["images"] - before["images"]) & (after["video"] - before["video"])
        assert after["consumer"] == before["consumer"]  # and the consumer loaded all three
        assert router.metric(ITEMS, encoded="remote") == 3
        assert router.metric(ITEMS, encoded="local") == 0
    finally:
        router.stop()


def test_an_item_of_a_modality_without_a_group_is_encoded_by_the_consumer(
    groups: Groups,
) -> None:
    router = groups.router({"video": [groups.video.url]}, "video-only").start()
    try:
        body = chat_request(image(710))
        expected = token_ids(groups.mono.chat(body))
        before = groups.encoded()
        got = token_ids(post_json(router.url + "/v1/chat/completions", body))
        assert got == expected
        after = groups.encoded()
        assert len(after["consumer"] - before["consumer"]) == 1  # the consumer encoded it
        assert after["images"] == before["images"]
        assert after["video"] == before["video"]  # no producer was asked
        assert router.metric(ITEMS, encoded="local") == 1
        assert router.metric(ITEMS, encoded="remote") == 0
        assert router.metric("encoderpool_router_errors_total", kind="producer_unavailable") == 0
    finally:
        router.stop()

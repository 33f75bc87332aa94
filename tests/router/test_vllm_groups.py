"""Producer groups on real vLLM: the router sends each item to its modality's group, and
an item of a modality without a group is encoded by the consumer.

Two producers with our shared-volume connector stand for two groups (images, video),
beside a consumer and a monolithic reference server. "Who encoded" is read from each
server's DEBUG log (``Finish execute for mm hash X``), as in test_vllm.py. One request
holds two images and a tiny video: each goes to its own group's producer, and the
consumer encodes none of them (routing for audio is covered with fakes in
test_producer_groups.py: the tiny model has no audio tower).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.media import chat_request, image, token_ids, video
from e2e.vllm_server import VllmServer, base_env, ec_transfer_config, post_json, stop_all
from tests.connector.fixtures import LOGGING_CONFIG
from tests.router.fixtures import (
    API_KEY,
    CONNECTORS,
    EC_CONNECTOR,
    RouterProcess,
    encoded_hashes,
    keyed,
)

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
        return {
            s.name: encoded_hashes(s.log_text()) for s in (self.consumer, self.images, self.video)
        }


@pytest.fixture(scope="module")
def groups(
    tiny_model: Path,
    vllm_logs: Path,
    monolithic: VllmServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Groups]:
    work = tmp_path_factory.mktemp("groups")
    logging_config = work / "logging.json"
    logging_config.write_text(json.dumps(LOGGING_CONFIG))
    store = work / "ec"
    store.mkdir()
    name, extra, module = CONNECTORS[EC_CONNECTOR](store, tiny_model)

    def server(role: str, cpu: str, ec_role: str | None) -> VllmServer:
        args: list[str] = []
        env = {**base_env(cpu), "VLLM_LOGGING_CONFIG_PATH": str(logging_config)}
        if ec_role is not None:
            args += ["--ec-transfer-config", ec_transfer_config(name, ec_role, extra, module)]
            guard, env = keyed(env)
            args += guard
        log = vllm_logs / f"groups-{os.getpid()}-{role}.log"
        return VllmServer(name=role, model=tiny_model, log_path=log, args=args, env=env)

    servers = [
        server("consumer", "0", "ec_consumer"),
        server("images", "1", "ec_producer"),
        server("video", "1", "ec_producer"),
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(300)
        consumer, images, video = servers
        yield Groups(monolithic, consumer, images, video, vllm_logs)
    finally:
        stop_all(servers)


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

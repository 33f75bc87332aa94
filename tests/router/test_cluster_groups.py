"""Producer groups from EndpointSlices on the real local control plane: the router
watches each group's Service and routes each item to its modality's group, as the
operator renders it (``--producer-services-by-modality``). Slices and resolver from
fixtures.py; backends are fakes on loopback."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from e2e.cluster import LocalCluster
from e2e.media import MODEL, image, image_part
from encoderpool_router.app import Router, build_app
from encoderpool_router.config import RouterSettings
from tests.router.fixtures import (
    DOMAIN,
    FakeBackend,
    LoopbackResolver,
    endpoint_slice,
    fakes,
    run,
    sent_parts,
    serve,
    service,
    uid_of,
    video_part,
)
from tests.waiting import async_wait_until

pytestmark = pytest.mark.cluster


def test_each_group_s_service_is_followed_and_gets_its_modality(
    cluster: LocalCluster, namespace: str
) -> None:
    def kubectl(*args: str, obj: dict[str, Any] | None = None) -> str:
        return cluster.kubectl(*args, "-n", namespace, input=json.dumps(obj) if obj else None)

    names = ("pool-producer-images", "pool-producer-video", "pool-consumer")
    for name in names:
        kubectl("apply", "-f", "-", obj=service(name))
    uids = {name: uid_of(kubectl, "service", name) for name in names}
    img, vid = image_part(image(1)), video_part(2)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [img, vid, {"type": "text", "text": "hi"}]}],
    }

    async def scenario() -> None:
        pi, pv, c = FakeBackend("producer-i"), FakeBackend("producer-v"), FakeBackend("c")
        async with fakes(pi, pv, c) as (piu, pvu, cu):

            async def apply(svc: str, host: str, url: str, ready: bool) -> None:
                obj = endpoint_slice(svc, host, url, ready, uids[svc])
                await asyncio.to_thread(kubectl, "apply", "-f", "-", obj=obj)

            await apply("pool-producer-images", "pi", piu, True)
            await apply("pool-producer-video", "pv", pvu, True)
            await apply("pool-consumer", "c", cu, True)
            settings = RouterSettings(
                producer_services_by_modality={
                    "image": "pool-producer-images",
                    "video": "pool-producer-video",
                },
                consumer_service="pool-consumer",
                namespace=namespace,
                kubeconfig=str(cluster.kubeconfig),
            )
            router = Router(settings, resolver=LoopbackResolver())
            images, video = (
                router.groups.by_modality.get("image"),
                router.groups.by_modality.get("video"),
            )
            assert images is not None
            assert video is not None
            async with serve(build_app(router)) as url, aiohttp.ClientSession() as s:
                await async_wait_until(
                    "both groups and the consumer known",
                    lambda: len(images) == 1 and len(video) == 1 and len(router.consumers) == 1,
                )
                assert images.urls == [f"http://pi.{DOMAIN}:{piu.rsplit(':', 1)[1]}"]
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                assert sent_parts(pi) == [img]
                assert sent_parts(pv) == [vid]

                # The image group's pod stops being ready: its set empties, the video
                # group's stays, and an image item is left to the consumer.
                await apply("pool-producer-images", "pi", piu, False)
                await async_wait_until("image group empty", lambda: len(images) == 0)
                assert len(video) == 1
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                assert sent_parts(pi) == [img]  # nothing new
                assert sent_parts(pv) == [vid, vid]

    run(scenario(), timeout=120)

"""The router follows EndpointSlices on the real local control plane.

The API server refuses loopback addresses in EndpointSlices, and kwok pod IPs
are fake and must never be contacted; so the slices here carry FQDN addresses
of a test-only domain that the router's resolver maps to 127.0.0.1 (and only
those: any other name fails). Backends are fake producers/consumers on loopback.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from e2e.cluster import LocalCluster
from e2e.media import chat_request, image, image_part
from encoderpool_router.app import Router, build_app
from encoderpool_router.config import RouterSettings
from encoderpool_router.media import media_key
from encoderpool_router.policy import hrw_rank
from tests.router.fixtures import (
    DOMAIN,
    FakeBackend,
    LoopbackResolver,
    endpoint_slice,
    fakes,
    run,
    serve,
    service,
    uid_of,
)
from tests.waiting import async_wait_until

pytestmark = pytest.mark.cluster


def test_backends_follow_endpointslice_changes(cluster: LocalCluster, namespace: str) -> None:
    def kubectl(*args: str, obj: dict[str, Any] | None = None) -> str:
        return cluster.kubectl(*args, "-n", namespace, input=json.dumps(obj) if obj else None)

    for name in ("pool-producers", "pool-consumers"):
        kubectl("apply", "-f", "-", obj=service(name))
    uids = {name: uid_of(kubectl, "service", name) for name in ("pool-producers", "pool-consumers")}

    async def scenario() -> None:
        p0, p1 = FakeBackend("producer-0"), FakeBackend("producer-1")
        c0, c1 = FakeBackend("consumer-0"), FakeBackend("consumer-1")
        async with fakes(p0, p1, c0, c1) as (p0u, p1u, c0u, c1u):

            async def apply(svc: str, host: str, url: str, ready: bool) -> None:
                obj = endpoint_slice(svc, host, url, ready, uids[svc])
                await asyncio.to_thread(kubectl, "apply", "-f", "-", obj=obj)

            def url_of(host: str, url: str) -> str:
                return f"http://{host}.{DOMAIN}:{url.rsplit(':', 1)[1]}"

            await apply("pool-producers", "p0", p0u, True)
            await apply("pool-consumers", "c0", c0u, True)
            await apply("pool-consumers", "c1", c1u, False)
            settings = RouterSettings(
                producer_service="pool-producers",
                consumer_service="pool-consumers",
                namespace=namespace,
                kubeconfig=str(cluster.kubeconfig),
            )
            router = Router(settings, resolver=LoopbackResolver())
            async with serve(build_app(router)) as url, aiohttp.ClientSession() as s:

                async def chat(i: int) -> tuple[int, Any]:
                    async with s.post(
                        url + "/v1/chat/completions", json=chat_request(image(i))
                    ) as r:
                        return r.status, await r.json()

                # Producers and consumers are two watches: either may be seen first.
                await async_wait_until(
                    "c0 only", lambda: router.consumers.urls == [url_of("c0", c0u)]
                )
                await async_wait_until(
                    "p0 only", lambda: router.producers.urls == [url_of("p0", p0u)]
                )
                status, out = await chat(1)
                assert (status, out["served_by"]) == (200, "consumer-0")
                assert list(out["ec_transfer_params_seen"].values()) == [{"by": "producer-0"}]

                # A rolling update: c1 becomes ready, c0 stops being ready; a producer joins.
                await apply("pool-consumers", "c1", c1u, True)
                await apply("pool-consumers", "c0", c0u, False)
                await apply("pool-producers", "p1", p1u, True)
                await async_wait_until(
                    "c1 only", lambda: router.consumers.urls == [url_of("c1", c1u)]
                )
                await async_wait_until("two producers", lambda: len(router.producers) == 2)
                # Items whose first-ranked producer is each one in turn (rendezvous hashing
                # decides; which of ten random items land where is chance, so pick them).
                first = {
                    i: hrw_rank(media_key(image_part(image(i))), router.producers.backends)[0].url
                    for i in range(2, 40)
                }
                picks = [next(i for i, u in first.items() if u == url_of(h, pu))
                         for h, pu in (("p0", p0u), ("p1", p1u))]  # fmt: skip
                for i in [*picks, *[i for i in range(2, 40) if i not in picks][:8]]:  # ten
                    status, out = await chat(i)
                    assert (status, out["served_by"]) == (200, "consumer-1")
                assert p0.seen  # each producer got the item that ranks it first
                assert p1.seen

                # Scaled to zero: the slice goes away, the router says so, then recovers.
                await asyncio.to_thread(
                    kubectl, "delete", "endpointslice", "pool-consumers-c0", "pool-consumers-c1"
                )
                await async_wait_until("no consumers", lambda: len(router.consumers) == 0)
                async with s.get(url + "/health") as r:
                    assert r.status == 503
                assert (await chat(20))[0] == 503
                await apply("pool-consumers", "c0", c0u, True)
                await async_wait_until("c0 back", lambda: len(router.consumers) == 1)
                status, out = await chat(21)
                assert (status, out["served_by"]) == (200, "consumer-0")
        assert len(c0.seen) == 2
        assert len(c1.seen) == 10

    run(scenario(), timeout=120)


def test_only_slices_the_pool_s_own_services_own_are_used(
    cluster: LocalCluster, namespace: str
) -> None:
    """A forged slice (the Service's label, even the controller's managed-by label, but not
    owned by the Service) is ignored and counted; a Service the pool does not control gives
    no backends at all. A ConfigMap stands in for the pool (the router checks the uid)."""

    def kubectl(*args: str, obj: dict[str, Any] | None = None) -> str:
        return cluster.kubectl(*args, "-n", namespace, input=json.dumps(obj) if obj else None)

    kubectl("create", "configmap", "pool")
    pool_uid = uid_of(kubectl, "configmap", "pool")
    controlled = {"apiVersion": "v1", "kind": "ConfigMap", "name": "pool", "uid": pool_uid,
                  "controller": True}  # fmt: skip
    for name in ("own-producers", "own-consumers"):
        svc = service(name)
        svc["metadata"]["ownerReferences"] = [controlled]
        kubectl("apply", "-f", "-", obj=svc)
    kubectl("apply", "-f", "-", obj=service("their-producers"))  # not the pool's
    uids = {
        name: uid_of(kubectl, "service", name)
        for name in ("own-producers", "own-consumers", "their-producers")
    }

    async def scenario() -> None:
        c0, evil, p = FakeBackend("consumer-0"), FakeBackend("evil"), FakeBackend("producer")
        async with fakes(c0, evil, p) as (c0u, evilu, pu):

            async def apply(svc: str, host: str, url: str, owner: str | None) -> None:
                obj = endpoint_slice(svc, host, url, True, owner)
                await asyncio.to_thread(kubectl, "apply", "-f", "-", obj=obj)

            await apply("own-consumers", "c0", c0u, uids["own-consumers"])
            await apply("own-consumers", "evil", evilu, None)  # labels only
            await apply("own-consumers", "evil2", evilu, uids["their-producers"])  # another's
            await apply("their-producers", "p", pu, uids["their-producers"])
            settings = RouterSettings(
                producer_service="their-producers",
                consumer_service="own-consumers",
                namespace=namespace,
                kubeconfig=str(cluster.kubeconfig),
                pool_uid=pool_uid,
            )
            router = Router(settings, resolver=LoopbackResolver())
            async with serve(build_app(router)) as url, aiohttp.ClientSession() as s:
                want = f"http://c0.{DOMAIN}:{c0u.rsplit(':', 1)[1]}"
                await async_wait_until("c0 only", lambda: router.consumers.urls == [want])
                await async_wait_until(
                    "both watches", lambda: all(w.synced.is_set() for w in router.watchers)
                )
                assert router.producers.urls == []
                for i in range(4):
                    async with s.post(
                        url + "/v1/chat/completions", json=chat_request(image(i))
                    ) as r:
                        out = await r.json()
                    assert (r.status, out["served_by"]) == (200, "consumer-0")
                assert not evil.seen
                assert not p.seen  # the consumer encoded: no producer of a foreign Service
                ignored = router.metrics.endpointslices_ignored
                assert ignored.labels("not_owned")._value.get() >= 2
                assert ignored.labels("service_not_owned")._value.get() >= 1

    run(scenario(), timeout=120)

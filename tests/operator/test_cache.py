"""The read cache: index entries, the overlay of our own writes, a pass's view."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from encoderpool_connector.contracts import CONFIGMAP_PREFIX
from encoderpool_operator import render
from encoderpool_operator.cache import (
    BY_NAME,
    BY_POOL,
    Cache,
    Overlay,
    Packed,
    PassView,
    index_entries,
    pack,
)

NS, POOL = "ns", "tiny"
MINE = {"app.kubernetes.io/managed-by": render.MANAGED_BY, render.LABEL_POOL: POOL}


def obj(name: str, rv: str, labels: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": NS,
            "name": name,
            "resourceVersion": rv,
            "labels": labels or {},
            "managedFields": [{"manager": "x"}],
            "ownerReferences": [{"uid": "u1", "controller": True}],
        },
        **extra,
    }


def test_our_children_are_indexed_in_full_by_pool_and_name_others_as_stubs() -> None:
    ours = index_entries(obj("tiny-producer", "5", MINE, spec={"x": 1}), "apps/v1", "Deployment")
    assert set(ours) == {(BY_NAME, NS, "tiny-producer"), (BY_POOL, NS, POOL)}
    packed = ours[(BY_POOL, NS, POOL)]
    assert (packed.name, packed.resource_version) == ("tiny-producer", "5")
    full = packed.unpack()
    assert full["spec"] == {"x": 1}
    assert full["kind"] == "Deployment"
    assert "managedFields" not in full["metadata"]
    other = index_entries(obj("tiny-producer", "6", spec={"big": "x" * 1000}), "v1", "Service")
    (theirs,) = other.values()
    assert set(other) == {(BY_NAME, NS, "tiny-producer")}
    stub = theirs.unpack()
    assert "spec" not in stub  # only existence and the controller are kept
    assert stub["metadata"]["ownerReferences"] == [{"uid": "u1", "controller": True}]


def test_a_width_report_is_kept_in_full_whoever_made_it() -> None:
    name = f"{CONFIGMAP_PREFIX}0123456789abcdef"
    (entry,) = index_entries(obj(name, "3", data={"report": "{}"}), "v1", "ConfigMap").values()
    assert entry.unpack()["data"] == {"report": "{}"}


def packed(name: str, rv: str) -> Packed:
    return pack({"metadata": {"name": name, "resourceVersion": rv}})


def test_the_overlay_shows_a_write_until_the_cache_moves_on() -> None:
    ov = Overlay()
    ref = ("v1", "Service", "tiny")
    ov.record((NS, POOL), ref, "5", packed("tiny", "6"))
    assert ov.view((NS, POOL), ref, packed("tiny", "5")) == packed("tiny", "6")
    new = packed("tiny", "6")
    assert ov.view((NS, POOL), ref, new) is new  # the watch delivered it: entry dropped
    assert len(ov) == 0
    ov.record((NS, POOL), ref, None, new)  # created: shown while the cache has nothing
    assert ov.view((NS, POOL), ref, None) is new
    ov.record((NS, POOL), ref, "6", None)  # deleted: hidden while the cache still has it
    assert ov.view((NS, POOL), ref, new) is None


class NoApi:
    """The fallback reader of a pass whose reads must all come from the cache."""

    def get(self, *a: Any) -> Any:
        raise AssertionError(f"read the API: {a}")

    def list(self, *a: Any) -> Any:
        raise AssertionError(f"listed the API: {a}")


class FakeIndex(dict[Any, Any]):
    """kopf's Index: key -> a collection of values."""

    def put(self, entries: dict[Any, Any]) -> None:
        for key, value in entries.items():
            self.setdefault(key, []).append(value)


def test_a_pass_view_reads_the_cache_in_the_loop_and_records_what_it_wrote() -> None:
    deployments, services, pools = FakeIndex(), FakeIndex(), FakeIndex()
    deployments.put(index_entries(obj("tiny-producer", "5", MINE), "apps/v1", "Deployment"))
    services.put(index_entries(obj("tiny", "3"), "v1", "Service"))  # someone else's
    cache = Cache({("apps/v1", "Deployment"): deployments, ("v1", "Service"): services}, pools)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        view = PassView(cache, loop, (NS, POOL), NoApi())
        selector = f"{render.LABEL_POOL}={POOL}"
        (dep,) = view.list("apps/v1", "Deployment", NS, selector)
        assert dep["metadata"]["name"] == "tiny-producer"
        theirs = view.get("v1", "Service", NS, "tiny")
        assert theirs is not None
        assert theirs["metadata"]["resourceVersion"] == "3"
        assert view.get("v1", "Service", NS, "tiny-consumer") is None
        view.record(("v1", "Service", "tiny-consumer"), obj("tiny-consumer", "9", MINE))
        view.record(("apps/v1", "Deployment", "tiny-producer"), None)
        again = PassView(cache, loop, (NS, POOL), NoApi())
        assert again.get("v1", "Service", NS, "tiny-consumer") is not None
        assert again.list("apps/v1", "Deployment", NS, selector) == []
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_the_overlay_keeps_only_this_pool_s_owner_of_a_shared_object() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        cache = Cache({("v1", "ConfigMap"): FakeIndex()}, FakeIndex())
        view = PassView(cache, loop, (NS, POOL), NoApi(), pool_uid="mine")
        report = obj("encoderpool-widths-0123456789abcdef", "8")
        report["metadata"]["ownerReferences"] = [{"uid": f"pool-{i}"} for i in range(500)] + [
            {"uid": "mine"}
        ]
        view.record(("v1", "ConfigMap", "encoderpool-widths-0123456789abcdef"), report)
        again = PassView(cache, loop, (NS, POOL), NoApi(), pool_uid="mine")
        got = again.get("v1", "ConfigMap", NS, "encoderpool-widths-0123456789abcdef")
        assert got is not None
        assert got["metadata"]["ownerReferences"] == [{"uid": "mine"}]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

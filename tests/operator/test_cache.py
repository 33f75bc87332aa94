"""The read cache: index entries, the overlay of our own writes, a pass's view."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from encoderpool_contracts import CONFIGMAP_PREFIX
from encoderpool_operator.api import API_VERSION, KIND
from encoderpool_operator.cache import (
    BY_NAME,
    BY_POOL,
    MAX_CHILDREN_PER_POOL,
    MAX_ENTRY_BYTES,
    SKIPPED,
    Cache,
    Overlay,
    Packed,
    PassView,
    index_entries,
    pack,
)
from encoderpool_operator.naming import (
    FIELD_MANAGER,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    MANAGED_BY,
    REPORT_COMPONENT,
    replicas_managers,
)

NS, POOL = "ns", "tiny"
MINE = {"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_POOL: POOL}
POOL_REF = {"apiVersion": API_VERSION, "kind": KIND, "name": POOL, "uid": "u1", "controller": True}
REPORT = f"{CONFIGMAP_PREFIX}0123456789abcdef"
REPORT_LABELS = {
    LABEL_MANAGED_BY: MANAGED_BY,
    LABEL_COMPONENT: REPORT_COMPONENT,
}


def obj(
    name: str,
    rv: str,
    labels: dict[str, str] | None = None,
    owner: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": NS,
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": rv,
            "labels": labels or {},
            "managedFields": [{"manager": "x"}],
            "ownerReferences": [owner or {**POOL_REF, "blockOwnerDeletion": True}],
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
    assert stub["metadata"]["ownerReferences"] == [POOL_REF]
    assert theirs.stub
    assert theirs.owner == "u1"


def test_a_width_report_labelled_as_one_is_kept_in_full_whoever_made_it() -> None:
    owners = [
        {"apiVersion": API_VERSION, "kind": KIND, "name": f"p{i}", "uid": f"u{i}"} for i in range(3)
    ]
    report = obj(REPORT, "3", REPORT_LABELS, data={"report": "{}"})
    report["metadata"]["ownerReferences"] = owners
    (entry,) = index_entries(report, "v1", "ConfigMap").values()
    full = entry.unpack()
    assert full["data"] == {"report": "{}"}
    # Owners as uids only: what a pass reads of them (1,000 owners stay ~50 KiB).
    assert full["metadata"]["ownerReferences"] == [{"uid": f"u{i}"} for i in range(3)]
    # Named like one without the labels: a stub (the pass calls it foreign, by name).
    (other,) = index_entries(obj(REPORT, "3", data={"x": "y"}), "v1", "ConfigMap").values()
    assert other.stub
    assert "data" not in other.unpack()


def test_configmaps_not_named_like_a_report_are_not_kept_at_all() -> None:
    assert index_entries(obj("their-settings", "1", MINE, data={"a": "b"}), "v1", "ConfigMap") == {}


@pytest.mark.parametrize(
    "owner",
    [
        {**POOL_REF, "kind": "Deployment"},  # another kind's child
        {**POOL_REF, "apiVersion": "example.com/v1"},  # an EncoderPool of another group
        {**POOL_REF, "name": "other"},  # another pool than its label says
        {**POOL_REF, "controller": False},  # an owner, not the controller
    ],
    ids=["kind", "group", "name", "not-controller"],
)
def test_our_label_alone_is_not_a_claim_a_controller_encoderpool_of_that_name_is(
    owner: dict[str, Any],
) -> None:
    entries = index_entries(
        obj("tiny-router", "2", MINE, owner, spec={"big": "x" * 9000}), "v1", "Service"
    )
    (entry,) = entries.values()
    assert set(entries) == {(BY_NAME, NS, "tiny-router")}
    assert entry.stub
    assert len(entry.json) < 1000


def test_a_claim_over_the_size_bound_is_a_stub_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for i in range(3):  # its size changes with every status update: still logged once
        huge = obj("tiny-producer", "5", MINE, spec={"env": "x" * (MAX_ENTRY_BYTES + i)})
        entries = index_entries(huge, "apps/v1", "Deployment")
        (entry,) = entries.values()
        assert set(entries) == {(BY_NAME, NS, "tiny-producer")}
        assert entry.stub
        assert entry.owner == "u1"
        assert len(entry.json) < 1000
    logged = [r for r in caplog.records if "tiny-producer" in r.getMessage()]
    assert len(logged) == 1
    assert f"over {MAX_ENTRY_BYTES}" in logged[0].getMessage()
    big_report = obj(REPORT, "3", REPORT_LABELS, data={"report": "x" * (MAX_ENTRY_BYTES + 1)})
    (entry,) = index_entries(big_report, "v1", "ConfigMap").values()
    assert entry.stub


def test_claims_on_one_pool_are_bounded_in_number() -> None:
    index = FakeIndex()
    for i in range(MAX_CHILDREN_PER_POOL + 5):
        index.put(index_entries(obj(f"tiny-{i}", "1", MINE), "v1", "Service", index.get))
    assert len(index[(BY_POOL, NS, POOL)]) == MAX_CHILDREN_PER_POOL
    assert index[(BY_NAME, NS, f"tiny-{MAX_CHILDREN_PER_POOL}")][0].stub
    # An entry already counted is re-indexed in full (its own old entry is not a sibling).
    again = index_entries(obj("tiny-0", "2", MINE), "v1", "Service", index.get)
    assert (BY_POOL, NS, POOL) in again


@pytest.mark.parametrize(
    "meta",
    [None, {"namespace": NS}, {"name": 7}, {"name": "tiny-x", "labels": ["not", "a", "map"]}],
    ids=["no-metadata", "no-name", "name-not-a-string", "labels-not-a-map"],
)
def test_a_malformed_object_is_left_out_never_raises(meta: Any) -> None:
    body = {} if meta is None else {"metadata": meta}
    assert index_entries(body, "v1", "Service") == {}
    SKIPPED.warn({}, "x", "y")  # the log-once memory stays usable


def test_the_log_once_memory_is_bounded() -> None:
    SKIPPED.size, before = 8, SKIPPED.size
    try:
        for i in range(100):
            SKIPPED.warn({"uid": str(i)}, "x", "y")
        assert len(SKIPPED._seen) == 8
    finally:
        SKIPPED.size = before


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
        selector = f"{LABEL_POOL}={POOL}"
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


class OneObjectApi(NoApi):
    """The API server holding one object (what a pass falls back to for a stub of its own)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body, self.gets = body, 0

    def get(self, *a: Any) -> Any:
        self.gets += 1
        return self.body


def test_a_pass_parses_only_its_pool_s_children_and_reads_its_own_stubs_from_the_api() -> None:
    deployments = FakeIndex()
    deployments.put(index_entries(obj("tiny-producer", "5", MINE), "apps/v1", "Deployment"))
    forged = obj("tiny-consumer", "6", MINE, {**POOL_REF, "uid": "not-the-pool"})
    deployments.put(index_entries(forged, "apps/v1", "Deployment"))
    big = obj("tiny-router", "7", MINE, spec={"env": "x" * (MAX_ENTRY_BYTES + 1)})
    deployments.put(index_entries(big, "apps/v1", "Deployment"))
    cache = Cache({("apps/v1", "Deployment"): deployments}, FakeIndex())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        view = PassView(cache, loop, (NS, POOL), NoApi(), pool_uid="u1")
        listed = view.list("apps/v1", "Deployment", NS, f"{LABEL_POOL}={POOL}")
        assert [d["metadata"]["name"] for d in listed] == ["tiny-producer"]
        # Someone else's name is a stub, served from the cache (no API read).
        theirs = view.get("apps/v1", "Deployment", NS, "tiny-consumer")
        assert theirs is not None
        assert "spec" not in theirs
        api = OneObjectApi(big)
        view = PassView(cache, loop, (NS, POOL), api, pool_uid="u1")
        assert view.get("apps/v1", "Deployment", NS, "tiny-router") is big
        assert api.gets == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_of_managed_fields_only_who_owns_replicas_is_kept() -> None:
    """The replicas hand-over (render.vllm.deployment_replicas) reads who owns the field."""
    dep = obj("tiny-consumer", "5", MINE, spec={"replicas": 4})
    dep["metadata"]["managedFields"] = [
        {
            "manager": FIELD_MANAGER,
            "operation": "Apply",
            "fieldsV1": {"f:spec": {"f:template": {}}},
        },
        {
            "manager": "kube-controller-manager",
            "operation": "Update",
            "subresource": "scale",
            "time": "2026-12-01T12:00:00Z",
            "fieldsV1": {"f:spec": {"f:replicas": {}}},
        },
    ]
    (entry, _) = index_entries(dep, "apps/v1", "Deployment").values()
    kept = entry.unpack()["metadata"]["managedFields"]
    assert kept == [
        {
            "manager": "kube-controller-manager",
            "operation": "Update",
            "subresource": "scale",
            "fieldsV1": {"f:spec": {"f:replicas": {}}},
        }
    ]
    assert (
        replicas_managers(entry.unpack()) == replicas_managers(dep) == ("kube-controller-manager",)
    )


def test_the_hpa_keda_made_is_a_stub_with_a_bounded_status() -> None:
    """Not the pool's (a ScaledObject controls it), but status.autoscaling reads its status."""
    scaled_object = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "name": "tiny-consumer",
        "uid": "so",
        "controller": True,
    }
    status = {
        "currentReplicas": 2,
        "desiredReplicas": 3,
        "lastScaleTime": "2026-12-01T12:00:00Z",
        "currentMetrics": [{"type": "External", "external": {"current": {"value": "1"}}}] * 50,
        "conditions": [
            {"type": f"T{i}", "status": "True", "reason": "R", "message": "m" * 9000}
            for i in range(9)
        ],
    }
    hpa = obj("tiny-consumer", "5", MINE, scaled_object, spec={"maxReplicas": 4}, status=status)
    (entry,) = index_entries(hpa, "autoscaling/v2", "HorizontalPodAutoscaler").values()
    assert entry.stub
    got = entry.unpack()
    assert "spec" not in got
    assert got["status"]["currentReplicas"] == 2
    assert got["status"]["lastScaleTime"] == "2026-12-01T12:00:00Z"
    assert "currentMetrics" not in got["status"]
    assert len(got["status"]["conditions"]) == 4
    assert {len(c["message"]) for c in got["status"]["conditions"]} == {512}
    # Anyone else's HPA: existence and controller only.
    (other,) = index_entries(
        obj("x", "1", status=status), "autoscaling/v2", "HorizontalPodAutoscaler"
    ).values()
    assert "status" not in other.unpack()

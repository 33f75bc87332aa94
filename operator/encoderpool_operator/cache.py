"""The operator's read cache: what kopf's watches delivered, so a pass reads no API.

kopf indexes (``handlers``) keep, for each kind a pass reads, every object of the
watched namespaces: a pool's own children in full (trimmed) under the pool's key
and under their name, anyone else's as a stub (name and controller uid) under
its name only, so a pass tells "missing" from "someone else's" without a GET.
kopf runs no handler before every index is filled from its first list, so a
pass never mistakes a cold cache for missing children. Objects are kept as
``Packed``: their resourceVersion and compact JSON, about a fifth of the memory
of the parsed object (RSS is what limits pools per operator); a pass parses the
few it reads, in its own thread.

The indexes change in kopf's event loop, and passes run in threads; ``PassView``
does each lookup in the loop (``call_in_loop``), so a thread never iterates an
index while it changes. ``Overlay`` remembers what this operator wrote until the
watch delivers it, so the next pass does not write it again (during creation the
pool's events race each other: the first child's event would otherwise see the
other children missing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from encoderpool_connector.contracts import CONFIGMAP_PREFIX
from encoderpool_operator import render
from encoderpool_operator.api import API_VERSION, KIND

# (namespace, name) of a pool; (apiVersion, kind, name) of an object in its namespace.
PoolKey = tuple[str, str]
Ref = tuple[str, str, str]
T = TypeVar("T")

# Index keys: ("name", namespace, name) for every object, ("pool", namespace, pool)
# for the children of a pool.
BY_NAME = "name"
BY_POOL = "pool"
# Kept out of the cache: large, and nothing a pass compares.
_DROPPED_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)


class Reader(Protocol):
    """The reads of one pass: a ``kube.Kube`` (tests, fallbacks) or a ``PassView``."""

    def get(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> Mapping[str, Any] | None: ...

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str = ""
    ) -> Sequence[Mapping[str, Any]]: ...


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of ``obj``'s controller (its ownerReference with controller: true), if any."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid", ""))
    return None


def trim(obj: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    """``obj`` without what no pass reads (managedFields, last-applied), typed."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
    annotations = meta.get("annotations")
    if annotations and any(a in annotations for a in _DROPPED_ANNOTATIONS):
        meta["annotations"] = {
            k: v for k, v in annotations.items() if k not in _DROPPED_ANNOTATIONS
        }
    return {**obj, "apiVersion": api_version, "kind": kind, "metadata": meta}


def stub(obj: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    """What a pass needs of an object that is not a pool's: that it exists, and whose it is."""
    meta = obj["metadata"]
    owners = [r for r in meta.get("ownerReferences") or [] if r.get("controller")]
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {
            "namespace": meta.get("namespace"),
            "name": meta["name"],
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
            "ownerReferences": owners,
        },
    }


class Packed(NamedTuple):
    """An object in the cache: what lookups need, and its JSON; immutable, shared freely."""

    name: str
    resource_version: str | None
    json: bytes

    def unpack(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.json)
        return out


def pack(obj: Mapping[str, Any]) -> Packed:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return Packed(obj["metadata"]["name"], resource_version(obj), raw)


def index_entries(
    obj: Mapping[str, Any], api_version: str, kind: str
) -> dict[tuple[str, str, str], Packed]:
    """An object's entries in its kind's index (see the module docstring); width report
    ConfigMaps are kept in full whoever made them."""
    meta = obj["metadata"]
    labels = meta.get("labels") or {}
    namespace, name = meta.get("namespace", ""), meta["name"]
    ours = labels.get(render.LABEL_MANAGED_BY) == render.MANAGED_BY
    # A width report is read whoever made it (one may be seeded by hand or by GitOps).
    report = kind == "ConfigMap" and name.startswith(CONFIGMAP_PREFIX)
    if not ours and not report:
        return {(BY_NAME, namespace, name): pack(stub(obj, api_version, kind))}
    full = pack(trim(obj, api_version, kind))
    entries = {(BY_NAME, namespace, name): full}
    if pool := labels.get(render.LABEL_POOL):
        entries[(BY_POOL, namespace, pool)] = full
    return entries


def resource_version(obj: Mapping[str, Any] | None) -> str | None:
    return None if obj is None else obj.get("metadata", {}).get("resourceVersion")


def _matches(obj: Mapping[str, Any], selector: str) -> bool:
    """Equality-only label selectors (``a=b,c=d``): all the operator uses."""
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class Overlay:
    """Writes not yet seen by the watch, per pool: (the version they replaced, the result).

    A cached object still at the replaced version is shown as the result; once the
    cache moves on (our write's own event, or anyone's later one) the entry goes.
    Only equality of resourceVersions is used (Kubernetes does not order them).
    Used only in the event loop's thread.
    """

    def __init__(self) -> None:
        self._pools: dict[PoolKey, dict[Ref, tuple[str | None, Packed | None]]] = {}

    def record(self, pool: PoolKey, ref: Ref, before: str | None, after: Packed | None) -> None:
        self._pools.setdefault(pool, {})[ref] = (before, after)

    def view(self, pool: PoolKey, ref: Ref, cached: Packed | None) -> Packed | None:
        entries = self._pools.get(pool)
        if not entries or ref not in entries:
            return cached
        before, after = entries[ref]
        if (cached.resource_version if cached else None) == before:
            return after
        del entries[ref]
        return cached

    def pending(self, pool: PoolKey) -> list[Ref]:
        return list(self._pools.get(pool, ()))

    def forget(self, pool: PoolKey) -> None:
        self._pools.pop(pool, None)

    def __len__(self) -> int:
        return sum(len(v) for v in self._pools.values())


def call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> T:
    """Run ``fn`` in ``loop``'s thread and wait for its result (from another thread)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # handed to the waiting thread
            done.set_exception(e)

    loop.call_soon_threadsafe(run)
    return done.result()


class Cache:
    """kopf's indexes (one per cached kind) and the overlay; touched only in the loop."""

    def __init__(
        self, indexes: Mapping[tuple[str, str], Any], pools: Any, overlay: Overlay | None = None
    ) -> None:
        self.indexes = indexes  # (apiVersion, kind) -> kopf Index of index_entries()
        self.pools = pools  # kopf Index: (namespace, name) -> the pool, packed
        self.overlay = overlay or Overlay()

    def _first(self, index: Any, key: tuple[str, ...]) -> Packed | None:
        store = index.get(key)
        return next(iter(store), None) if store else None

    def pool(self, key: PoolKey) -> Packed | None:
        ref = (API_VERSION, KIND, key[1])
        return self.overlay.view(key, ref, self._first(self.pools, key))

    def get(self, pool: PoolKey, api_version: str, kind: str, name: str) -> Packed | None:
        cached = self._first(self.indexes[(api_version, kind)], (BY_NAME, pool[0], name))
        return self.overlay.view(pool, (api_version, kind, name), cached)

    def list(self, pool: PoolKey, api_version: str, kind: str) -> list[Packed]:
        """The pool's children of one kind, as this operator last wrote or saw them."""
        store = self.indexes[(api_version, kind)].get((BY_POOL, pool[0], pool[1])) or ()
        seen: dict[Ref, Packed | None] = {(api_version, kind, o.name): o for o in store}
        for ref in self.overlay.pending(pool):
            if ref[:2] == (api_version, kind):
                seen.setdefault(ref, None)
        out = []
        for ref, cached in seen.items():
            obj = self.overlay.view(pool, ref, cached)
            if obj is not None:
                out.append(obj)
        return out

    def cached(self, api_version: str, kind: str) -> bool:
        return (api_version, kind) in self.indexes


class PassView:
    """One pass's reads for one pool: from the cache (in the loop), else from ``fallback``.

    Lookups run in the loop; parsing the JSON runs here, in the pass's thread. It
    remembers the version of everything it served, so ``record`` can file a write in
    the overlay against what the pass saw.
    """

    def __init__(
        self,
        cache: Cache,
        loop: asyncio.AbstractEventLoop,
        pool: PoolKey,
        fallback: Reader,
        pool_uid: str | None = None,
    ) -> None:
        self.cache, self.loop, self.pool_key, self.fallback = cache, loop, pool, fallback
        self.pool_uid = pool_uid
        self.served: dict[Ref, str | None] = {}

    def get(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> Mapping[str, Any] | None:
        if namespace != self.pool_key[0] or not self.cache.cached(api_version, kind):
            return self.fallback.get(api_version, kind, namespace, name)
        got = call_in_loop(
            self.loop, lambda: self.cache.get(self.pool_key, api_version, kind, name)
        )
        self.served[(api_version, kind, name)] = got.resource_version if got else None
        return got.unpack() if got else None

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str = ""
    ) -> Sequence[Mapping[str, Any]]:
        pool_term = f"{render.LABEL_POOL}={self.pool_key[1]}"
        if (
            namespace != self.pool_key[0]
            or not self.cache.cached(api_version, kind)
            or pool_term not in label_selector.split(",")
        ):
            return self.fallback.list(api_version, kind, namespace, label_selector)
        items = call_in_loop(self.loop, lambda: self.cache.list(self.pool_key, api_version, kind))
        out = []
        for packed in items:
            obj = packed.unpack()
            if _matches(obj, label_selector):
                self.served[(api_version, kind, packed.name)] = packed.resource_version
                out.append(obj)
        return out

    def _own_view(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Of a shared object's owners (the report ConfigMap: one per pool of its model),
        only this pool's: all a pass reads of them, and the overlay holds one copy per
        pool until the watch catches up (1,000 owners x 1,000 pools was 100s of MB)."""
        owners = obj["metadata"].get("ownerReferences") or []
        if self.pool_uid is None or len(owners) < 2:
            return obj
        mine = [o for o in owners if o.get("uid") == self.pool_uid]
        return {**obj, "metadata": {**obj["metadata"], "ownerReferences": mine}}

    def record(self, ref: Ref, after: Mapping[str, Any] | None) -> None:
        """File a write of ``ref`` (its result; None: deleted) against what this pass saw."""
        before = self.served.get(ref)
        packed = pack(self._own_view(trim(after, ref[0], ref[1]))) if after is not None else None
        call_in_loop(
            self.loop, lambda: self.cache.overlay.record(self.pool_key, ref, before, packed)
        )

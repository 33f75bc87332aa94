"""The operator's read cache: what kopf's watches delivered, so a pass reads no API.

kopf indexes (``handlers``) keep, for each kind a pass reads, every object of the
watched namespaces: a pool's own children in full (trimmed) under the pool's key
and under their name, anyone else's as a stub (name and controller uid) under
its name only, so a pass tells "missing" from "someone else's" without a GET.
kopf runs no handler before every index is filled from its first list, so a
pass never mistakes a cold cache for missing children.

What counts as a pool's child here is what it claims: our managed-by label, the pool
label, and a controller ownerReference to an EncoderPool of that name (a pass keeps
only those whose controller uid is its pool's). Anyone who can write in a namespace
can claim that, so a claim is bounded: a full entry at most ``MAX_ENTRY_BYTES``
(trimmed) and ``MAX_CHILDREN_PER_POOL`` per kind under one pool name; past either the
object is a stub, logged once, and a pass that needs it as its own reads it from the
API server (bounded by the server's own object size). ConfigMaps are kept only when
named like a width report, in full only with the report labels. Objects are kept as
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
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from encoderpool_contracts import CONFIGMAP_PREFIX
from encoderpool_operator.api import API_VERSION, GROUP, KIND
from encoderpool_operator.naming import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    MANAGED_BY,
    REPORT_COMPONENT,
    Ref,
    replicas_entries,
)
from encoderpool_operator.render import FAMILY_KINDS

# (namespace, name) of a pool.
PoolKey = tuple[str, str]
# What a pass reads, cached: the pool's children, its width Jobs, the report ConfigMaps
# (``kinds.Kind.cached``: not the Secret, never read, nor the width Job's pods).
CACHED_KINDS: tuple[tuple[str, str], ...] = tuple(k.key for k in FAMILY_KINDS if k.cached)
T = TypeVar("T")

# Index keys: ("name", namespace, name) for every object, ("pool", namespace, pool)
# for the children of a pool.
BY_NAME = "name"
BY_POOL = "pool"
# Kept out of the cache: large, and nothing a pass compares.
_DROPPED_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)
# Bounds on a claim to be a pool's child (see the module docstring). Our own children
# are a few KiB and a pool has a handful of each kind; a width report with 1,000 owners
# is ~50 KiB (its owners are kept as uids only).
MAX_ENTRY_BYTES = 256 * 1024
MAX_CHILDREN_PER_POOL = 64
log = logging.getLogger("encoderpool_operator.cache")


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
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid", ""))
    return None


def claimed_pool(meta: Mapping[str, Any]) -> str | None:
    """The pool an object claims as its controller: our managed-by label, the pool label,
    and a controller ownerReference to an EncoderPool of that name; else None.

    Only a claim: the uid is checked by the pass (its pool's), and anyone who may write
    in the namespace can make one, which is why claims are bounded."""
    labels = meta.get("labels") or {}
    pool = labels.get(LABEL_POOL)
    if labels.get(LABEL_MANAGED_BY) != MANAGED_BY or not pool:
        return None
    for ref in meta.get("ownerReferences") or []:
        if (
            ref.get("controller")
            and ref.get("kind") == KIND
            and str(ref.get("apiVersion", "")).partition("/")[0] == GROUP
            and ref.get("name") == pool
        ):
            return str(pool)
    return None


def _is_report(meta: Mapping[str, Any]) -> bool:
    """Labelled as a width report the operator writes (``widths.foreign_reason`` checks
    the rest: the report key and the data's digest)."""
    labels = meta.get("labels") or {}
    return (
        labels.get(LABEL_MANAGED_BY) == MANAGED_BY
        and labels.get(LABEL_COMPONENT) == REPORT_COMPONENT
    )


def trim(obj: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    """``obj`` without what no pass reads (managedFields but who owns spec.replicas,
    last-applied), typed."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
    if replicas := replicas_entries(obj["metadata"]):
        meta["managedFields"] = replicas
    annotations = meta.get("annotations")
    if annotations and any(a in annotations for a in _DROPPED_ANNOTATIONS):
        meta["annotations"] = {
            k: v for k, v in annotations.items() if k not in _DROPPED_ANNOTATIONS
        }
    return {**obj, "apiVersion": api_version, "kind": kind, "metadata": meta}


def stub(obj: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    """What a pass needs of an object that is not a pool's: that it exists, and whose it is
    (and of an HPA a ScaledObject controls, what it reports: ``scaler_status``)."""
    meta = obj["metadata"]
    owners = [
        {k: r[k] for k in ("apiVersion", "kind", "name", "uid", "controller") if k in r}
        for r in meta.get("ownerReferences") or []
        if r.get("controller")
    ][:1]
    extra = {}
    if kind == "HorizontalPodAutoscaler" and owners and owners[0].get("kind") == "ScaledObject":
        extra = {"status": scaler_status(obj.get("status"))}
    return {
        **extra,
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


# What is kept of the status of an HPA KEDA made: the fields status.autoscaling shows,
# each condition's message cut (a stub stays small whoever wrote the object).
_SCALER_STATUS = ("currentReplicas", "desiredReplicas", "lastScaleTime")
_SCALER_CONDITION = ("type", "status", "reason", "message")
MAX_SCALER_MESSAGE = 512


def scaler_status(status: Any) -> dict[str, Any]:
    """The part of an HPA's status a pass reads (reconcile.scaling), bounded."""
    if not isinstance(status, Mapping):
        return {}
    out = {k: status[k] for k in _SCALER_STATUS if isinstance(status.get(k), (int, str))}
    conditions = []
    for c in (status.get("conditions") or [])[:4]:
        if isinstance(c, Mapping):
            kept = {k: str(c[k]) for k in _SCALER_CONDITION if k in c}
            kept["message"] = kept.get("message", "")[:MAX_SCALER_MESSAGE]
            conditions.append(kept)
    if conditions:
        out["conditions"] = conditions
    return out


class Packed(NamedTuple):
    """An object in the cache: what lookups need, and its JSON; immutable, shared freely."""

    name: str
    resource_version: str | None
    json: bytes
    owner: str | None = None  # the controller's uid: a pass lists only its pool's
    stub: bool = False  # only name and controller kept (``stub``)

    def unpack(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.json)
        return out


def pack(obj: Mapping[str, Any], is_stub: bool = False) -> Packed:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return Packed(obj["metadata"]["name"], resource_version(obj), raw, controller_uid(obj), is_stub)


class OncePerObject:
    """Log a skipped object once (per uid and reason), remembering a bounded number."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def warn(
        self,
        meta: Mapping[str, Any],
        where: str,
        why: str,
        kept: str = "keeping only its name and controller",
        reason: str = "",
    ) -> None:
        """Log ``why`` unless this object was logged for ``reason`` before (its size, say,
        changes with every status update: the reason is the kind of bound, not the text)."""
        key = (str(meta.get("uid") or where), reason or why)
        if key in self._seen:
            self._seen.move_to_end(key)
            return
        self._seen[key] = None
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        log.warning("cache: %s %s; %s", where, why, kept)


SKIPPED = OncePerObject()
# The entries already in the index under a key (kopf's index), to count a pool's claims.
Siblings = Callable[[tuple[str, str, str]], Iterable[Packed] | None]


def _report_view(obj: dict[str, Any]) -> dict[str, Any]:
    """A report's owners as uids only: all a pass reads of them (``widths._owner_uids``)."""
    meta = obj["metadata"]
    owners = [{"uid": r.get("uid")} for r in meta.get("ownerReferences") or []]
    return {**obj, "metadata": {**meta, "ownerReferences": owners}}


def index_entries(
    obj: Mapping[str, Any], api_version: str, kind: str, siblings: Siblings | None = None
) -> dict[tuple[str, str, str], Packed]:
    """An object's entries in its kind's index (see the module docstring).

    Never raises: an object it cannot read is left out, logged once."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str):
        SKIPPED.warn({}, f"a {kind}", "has no metadata.name", kept="left out")
        return {}
    namespace, name = str(meta.get("namespace") or ""), meta["name"]
    where = f"{kind} {namespace}/{name}"
    try:
        return _entries(obj, meta, api_version, kind, siblings, where)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        SKIPPED.warn(meta, where, f"is malformed ({e!r:.200})", kept="left out", reason="bad")
        return {}


def _entries(
    obj: Mapping[str, Any],
    meta: Mapping[str, Any],
    api_version: str,
    kind: str,
    siblings: Siblings | None,
    where: str,
) -> dict[tuple[str, str, str], Packed]:
    namespace, name = str(meta.get("namespace") or ""), meta["name"]
    by_name = (BY_NAME, namespace, name)
    if kind == "ConfigMap":
        if not name.startswith(CONFIGMAP_PREFIX):
            return {}  # no pass looks up any other ConfigMap
        if not _is_report(meta):  # a report is read whoever made it, if labelled as one
            return {by_name: pack(stub(obj, api_version, kind), is_stub=True)}
        full = pack(_report_view(trim(obj, api_version, kind)))
        if len(full.json) > MAX_ENTRY_BYTES:
            why = f"is {len(full.json)} bytes, over {MAX_ENTRY_BYTES}"
            SKIPPED.warn(meta, where, why, reason="size")
            return {by_name: pack(stub(obj, api_version, kind), is_stub=True)}
        return {by_name: full}
    pool = claimed_pool(meta)
    if pool is None:
        return {by_name: pack(stub(obj, api_version, kind), is_stub=True)}
    full = pack(trim(obj, api_version, kind))
    by_pool = (BY_POOL, namespace, pool)
    too_many = False
    if siblings is not None:
        others = [p for p in siblings(by_pool) or () if p.name != name]
        too_many = len(others) >= MAX_CHILDREN_PER_POOL
    if len(full.json) > MAX_ENTRY_BYTES or too_many:
        why = (
            f"is {len(full.json)} bytes, over {MAX_ENTRY_BYTES}"
            if not too_many
            else f"is one claim too many: {MAX_CHILDREN_PER_POOL} {kind}s already name pool {pool}"
        )
        SKIPPED.warn(meta, where, why, reason="count" if too_many else "size")
        return {by_name: pack(stub(obj, api_version, kind), is_stub=True)}
    return {by_name: full, by_pool: full}


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

    def list(
        self, pool: PoolKey, api_version: str, kind: str, uid: str | None = None
    ) -> list[Packed]:
        """The pool's children of one kind, as this operator last wrote or saw them; with
        ``uid``, only those it controls (others' claims are never parsed by the pass)."""
        store = self.indexes[(api_version, kind)].get((BY_POOL, pool[0], pool[1])) or ()
        seen: dict[Ref, Packed | None] = {
            (api_version, kind, o.name): o for o in store if uid is None or o.owner == uid
        }
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
        if got is not None and got.stub and self.pool_uid and got.owner == self.pool_uid:
            # Ours, but over the cache's bounds (or someone's claim with our uid): read it.
            return self.fallback.get(api_version, kind, namespace, name)
        return got.unpack() if got else None

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str = ""
    ) -> Sequence[Mapping[str, Any]]:
        pool_term = f"{LABEL_POOL}={self.pool_key[1]}"
        if (
            namespace != self.pool_key[0]
            or not self.cache.cached(api_version, kind)
            or pool_term not in label_selector.split(",")
        ):
            return self.fallback.list(api_version, kind, namespace, label_selector)
        items = call_in_loop(
            self.loop, lambda: self.cache.list(self.pool_key, api_version, kind, self.pool_uid)
        )
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

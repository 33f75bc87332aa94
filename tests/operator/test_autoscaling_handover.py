"""The replicas hand-over on the real control plane, with the HPA engine and the real HPA
controller (kube-controller-manager): a role switched from a fixed count to autoscaling
keeps its pods, the autoscaler takes the field when it first scales, and a fixed count
takes it back. Every version of the Deployment's spec.replicas the API server stores is
recorded through a watch, and the field is read every 0.1 s besides, so a dip is seen."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from encoderpool_operator.naming import FIELD_MANAGER, replicas_managers
from tests.operator.fixtures import apply_pool, get_json, ready_pool, sample_pool, seed_report
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster
# What the local control plane's HPA controller writes replicas as (through /scale).
HPA_MANAGER = "kube-controller-manager"
# The HPA controller's sync period (its default): how long one round of it takes at most.
HPA_SYNC_SECONDS = 15


@pytest.fixture
def hpa_operator(
    cluster: LocalCluster, crd: str, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(
        cluster.operator_kubeconfig,
        tmp_path / "operator.log",
        namespace=namespace,
        env={"ENCODERPOOL_RESYNC_SECONDS": "5", "ENCODERPOOL_AUTOSCALING_ENGINE": "hpa"},
    ).start()
    yield op
    op.stop()


class ReplicasRecorder:
    """A Deployment's spec.replicas through a test: every version the API server stores
    (a watch) and a read every 0.1 s (``samples``), each in a thread of its own."""

    def __init__(self, kube_client: Any, namespace: str, name: str, since: str) -> None:
        from kubernetes import client, watch

        self.seen: list[tuple[float, int | None, tuple[str, ...]]] = []
        self.samples: list[tuple[float, int | None]] = []
        apps = client.AppsV1Api(kube_client)
        self._watch = watch.Watch()
        self._stream = self._watch.stream(
            apps.list_namespaced_deployment,
            namespace,
            field_selector=f"metadata.name={name}",
            resource_version=since,
            timeout_seconds=600,
        )
        self._read: Any = lambda: apps.read_namespaced_deployment(name, namespace).spec.replicas
        self._start = time.monotonic()
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(target=self._guarded, args=(self._record,), daemon=True),
            threading.Thread(target=self._guarded, args=(self._sample,), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _now(self) -> float:
        return round(time.monotonic() - self._start, 1)

    def _guarded(self, run: Any) -> None:
        with contextlib.suppress(Exception):  # the stream ends when the test stops it
            run()

    def _record(self) -> None:
        for event in self._stream:
            obj = event["raw_object"]
            self.seen.append((self._now(), obj["spec"].get("replicas"), replicas_managers(obj)))

    def _sample(self) -> None:
        while not self._stopped.wait(0.1):
            self.samples.append((self._now(), self._read()))

    def values(self, since: float = 0.0) -> list[int]:
        """Every replicas value seen either way from ``since`` (a ``mark``) on."""
        out = [r for t, r, _ in self.seen if t >= since] + [
            r for t, r in self.samples if t >= since
        ]
        return [r if r is not None else 1 for r in out]  # unset reads as the default, 1

    def mark(self) -> float:
        return self._now()

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()


def _deployment(cluster: LocalCluster, namespace: str) -> dict[str, Any]:
    out = cluster.kubectl(
        "get", "deployment", "tiny-consumer", "-n", namespace, "-o", "json", "--show-managed-fields"
    )
    return dict(json.loads(out))


def _patch_consumer(cluster: LocalCluster, namespace: str, consumer: dict[str, Any]) -> None:
    body = json.dumps({"spec": {"consumer": consumer}})
    cluster.kubectl("patch", "encoderpool", "tiny", "-n", namespace, "--type=merge", "-p", body)


def _autoscaler(cluster: LocalCluster, namespace: str) -> dict[str, Any] | None:
    pool = get_json(cluster, "encoderpool", "tiny", "-n", namespace)
    found = pool.get("status", {}).get("autoscaling") or []
    return dict(found[0]) if found else None


def test_fixed_to_autoscaling_and_back_never_drops_a_pod(
    cluster: LocalCluster, namespace: str, hpa_operator: OperatorProcess, kube_client: Any
) -> None:
    pool = sample_pool()
    pool["spec"]["consumer"]["replicas"] = 3
    seed_report(cluster, namespace, pool)
    apply_pool(cluster, namespace, pool)
    ready_pool(cluster, namespace)
    dep = _deployment(cluster, namespace)
    assert (dep["spec"]["replicas"], replicas_managers(dep)) == (3, (FIELD_MANAGER,))
    recorder = ReplicasRecorder(
        kube_client, namespace, "tiny-consumer", dep["metadata"]["resourceVersion"]
    )
    try:
        # 1. Fixed 3 -> autoscaling 3..6. No adapter serves the External metrics here, so
        # the HPA cannot compute a count and leaves 3 (in its bounds) alone: the operator
        # keeps applying the live 3, through the HPA controller's rounds.
        _patch_consumer(cluster, namespace, {"autoscaling": {"minReplicas": 3, "maxReplicas": 6}})

        def reported() -> dict[str, Any] | None:
            got = _autoscaler(cluster, namespace)
            return got if got and got.get("currentReplicas") == 3 else None

        entry = wait_until("the HPA's first round in status.autoscaling", reported, timeout=60)
        assert (entry["engine"], entry["minReplicas"], entry["maxReplicas"]) == ("hpa", 3, 6)
        assert (entry["active"], entry["reason"]) == (False, "FailedGetExternalMetric")
        time.sleep(HPA_SYNC_SECONDS + 5)  # one more round of the HPA controller
        dep = _deployment(cluster, namespace)
        assert min(recorder.values()) >= 3, (recorder.seen, recorder.samples)
        assert (dep["spec"]["replicas"], replicas_managers(dep)) == (3, (FIELD_MANAGER,))
        wide = cluster.kubectl("get", "epool", "tiny", "-n", namespace, "-o", "wide")
        # current/desired as the HPA reports them: it has computed no count yet (0).
        assert "consumer 3/0 (3-6) inactive" in wide, wide
        switched = recorder.mark()

        # 2. Bounds 1..2: the HPA controller scales 3 -> 2 (above its max) through /scale,
        # which makes it the field's manager; the operator then stops sending it, and the
        # field stays 2 (dropped while the operator alone held it, it would default to 1).
        _patch_consumer(cluster, namespace, {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}})

        def handed_over() -> dict[str, Any] | None:
            d = _deployment(cluster, namespace)
            return d if replicas_managers(d) == (HPA_MANAGER,) else None

        dep = wait_until("the HPA controller holding replicas alone", handed_over, timeout=90)
        assert dep["spec"]["replicas"] == 2
        time.sleep(HPA_SYNC_SECONDS + 5)
        assert _deployment(cluster, namespace)["spec"]["replicas"] == 2
        assert min(recorder.values(switched)) >= 2, (recorder.seen, recorder.samples)

        def scaled_in_status() -> dict[str, Any] | None:
            got = _autoscaler(cluster, namespace) or {}
            counts = (got.get("currentReplicas"), got.get("desiredReplicas"))
            return got if got.get("lastScaleTime") and counts == (2, 2) else None

        # The HPA's next round reports 2 current; the pool writes such progress within 30 s.
        wait_until("status.autoscaling with the HPA's scale", scaled_in_status, timeout=90)
        scaled = recorder.mark()

        # 3. Back to a fixed 2: the operator applies the field again (it shares it with the
        # HPA controller's old entry: same value; a later count is forced through), and the
        # HPA is pruned.
        _patch_consumer(cluster, namespace, {"autoscaling": None, "replicas": 2})

        def fixed_again() -> dict[str, Any] | None:
            d = _deployment(cluster, namespace)
            hpas = cluster.kubectl("get", "hpa", "-n", namespace, "-o", "name").split()
            return d if FIELD_MANAGER in replicas_managers(d) and not hpas else None

        dep = wait_until("the operator holding replicas again, the HPA gone", fixed_again)
        assert dep["spec"]["replicas"] == 2
        assert _autoscaler(cluster, namespace) is None
        ready_pool(cluster, namespace)
        assert set(recorder.values(scaled)) <= {2}, (recorder.seen, recorder.samples)
    finally:
        recorder.stop()
    print(f"\ntiny-consumer spec.replicas, each version (s, replicas, managers): {recorder.seen}")
    print(f"read every 0.1 s: {len(recorder.samples)} reads, {_runs(recorder.samples)}")


def _runs(samples: list[tuple[float, int | None]]) -> list[tuple[float, float, int | None]]:
    """(from, to, value) of each run of equal values: the reads, shortly."""
    out: list[tuple[float, float, int | None]] = []
    for t, v in samples:
        if out and out[-1][2] == v:
            out[-1] = (out[-1][0], t, v)
        else:
            out.append((t, t, v))
    return out

"""A vLLM pod that refuses the width report says so on the pool.

vLLM measures its encoder's output widths at start-up (as the width Job did); the
connector refuses a report that disagrees and leaves why (``WidthMismatch``) as the
container's termination message. The operator reads it back from the pods of a role
that is not available, and the role's condition (and Ready) carries it, naming the pod,
the widths and what to do.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from encoderpool_contracts import (
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    WIDTH_MISMATCH,
    WidthMismatch,
    configmap_name,
)
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.conditions import PROBLEM_REASONS
from encoderpool_operator.naming import VLLM_CONTAINER, name_of
from encoderpool_operator.reconcile.observe import (
    REFUSAL_PODS_READ,
    width_mismatch_of,
    width_refusals,
)
from encoderpool_operator.reconcile.plan import plan
from encoderpool_operator.render.widths import report_key
from tests.operator.fixtures import (
    DEFAULTS,
    NOW,
    children,
    container,
    live_children,
    plan_condition,
    pool_object,
    report_cm,
    report_of,
    settled,
    snapshot,
)


def refusal(fingerprint: str = "0123456789abcdef") -> WidthMismatch:
    return WidthMismatch(
        fingerprint=fingerprint, configured={"image": 128}, measured={"image": 256}
    )


def pod(name: str, message: str | None, container: str = VLLM_CONTAINER) -> dict[str, Any]:
    state: dict[str, Any] = {"waiting": {"reason": "CrashLoopBackOff"}}
    last = {"terminated": {"exitCode": 1, "message": message}} if message is not None else {}
    return {
        "metadata": {"name": name},
        "status": {"containerStatuses": [{"name": container, "state": state, "lastState": last}]},
    }


class Pods:
    """A reader that answers pod lists (and counts them); nothing else is asked."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.lists: list[str] = []

    def get(self, *_: str) -> Mapping[str, Any] | None:
        raise AssertionError("width_refusals reads no object by name")

    def list(self, api_version: str, kind: str, namespace: str, selector: str = "") -> list[Any]:
        assert (api_version, kind) == ("v1", "Pod")
        self.lists.append(selector)
        return copy.deepcopy(self.pods)


def unavailable_consumers(obj: dict[str, Any]) -> dict[Any, Any]:
    pool = EncoderPool.from_object(obj)
    live = live_children(pool, report_of(obj))
    dep = live[("apps/v1", "Deployment", name_of(pool, "consumer"))]
    dep["status"] = {**dep["status"], "availableReplicas": 0, "readyReplicas": 0}
    return live


def test_the_vllm_pods_are_told_where_to_leave_a_refusal() -> None:
    pool = EncoderPool.from_object(pool_object())
    objs = children(pool)
    for name in (name_of(pool, "producer"), name_of(pool, "consumer")):
        c = container(objs, name)
        assert c["name"] == VLLM_CONTAINER
        assert {"name": TERMINATION_LOG_ENV, "value": TERMINATION_LOG} in c["env"]
        assert (c["terminationMessagePath"], c["terminationMessagePolicy"]) == (
            TERMINATION_LOG,
            "File",
        )


def test_a_refusing_consumer_is_the_pools_condition_naming_pod_widths_and_remedy() -> None:
    obj = settled(pool_object())
    live = unavailable_consumers(obj)
    report = report_of(obj)
    snap = snapshot(obj, report_cm=report_cm(report), live=live)
    found = width_refusals(Pods([pod("tiny-consumer-1", refusal().to_termination_message())]), snap)
    assert found == {"consumer": ("tiny-consumer-1", refusal())}
    p = plan(snapshot(obj, report_cm=report_cm(report), live=live, refusals=found), DEFAULTS, NOW)
    status, reason, message = plan_condition(p, "ConsumersAvailable")
    assert (status, reason) == ("False", WIDTH_MISMATCH)
    pool = EncoderPool.from_object(obj)
    for part in (
        "pod tiny-consumer-1 refused to start",
        "image: report 128, the pod's vLLM 256",
        f"ConfigMap {configmap_name(report_key(pool))}",
        "delete it and the operator measures again",
    ):
        assert part in message, message
    assert plan_condition(p, "Ready")[:2] == ("False", WIDTH_MISMATCH)
    assert WIDTH_MISMATCH in PROBLEM_REASONS  # a Warning event, not progress


def test_pods_are_read_only_for_a_role_that_lacks_pods_and_never_past_the_bound() -> None:
    obj = settled(pool_object())
    report = report_of(obj)
    healthy = snapshot(obj, report_cm=report_cm(report), live=live_children(
        EncoderPool.from_object(obj), report
    ))  # fmt: skip
    reader = Pods([pod("p", refusal().to_termination_message())])
    assert width_refusals(reader, healthy) == {}
    assert reader.lists == []  # a healthy pool costs no pod list

    crowd = [pod(f"p{i}", "OOMKilled") for i in range(REFUSAL_PODS_READ)]
    crowd.append(pod("late", refusal().to_termination_message()))
    snap = snapshot(obj, report_cm=report_cm(report), live=unavailable_consumers(obj))
    reader = Pods(crowd)
    assert width_refusals(reader, snap) == {}  # the refusal past the bound is not read
    assert len(reader.lists) == 1
    assert "app.kubernetes.io/component=consumer" in reader.lists[0]


def test_only_a_well_formed_refusal_of_the_vllm_container_counts() -> None:
    good = refusal().to_termination_message()
    assert width_mismatch_of(pod("a", good)) == refusal()
    assert width_mismatch_of(pod("a", good, container="sidecar")) is None
    assert width_mismatch_of(pod("a", "Traceback ... ValueError: WidthMismatch")) is None
    forged = good.replace('"image":256', '"image":99999999')
    assert width_mismatch_of(pod("a", forged)) is None  # out of bounds: not ours
    assert width_mismatch_of(pod("a", None)) is None
    assert width_mismatch_of({"metadata": {"name": "a"}}) is None

"""The EncoderPool models: samples parse, invalid pools are refused naming the field,
each validation rule refuses its sample with its message, helpers the reconcile uses,
and condition transitions (pure, no cluster)."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from encoderpool_contracts import ConnectorConfig
from encoderpool_operator.api import (
    CHILDREN_OWNED,
    CONSUMERS_AVAILABLE,
    PRODUCERS_AVAILABLE,
    READY,
    ROUTER_AVAILABLE,
    WIDTHS_MEASURED,
    Condition,
    ConditionUpdate,
    EncoderPool,
    EncoderPoolStatus,
    ReplicaStatus,
    parse_quantity,
    quantity_bytes,
)
from encoderpool_operator.conditions import find_condition, ready_condition, set_condition
from tests.operator.api_cases import (
    BASE,
    INVALID,
    PYDANTIC_ONLY,
    RULE_CASES,
    SAMPLES,
    TRANSITION_CASES,
    patched,
    refusal,
    rule_at,
    rules,
)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T1 = T0 + timedelta(minutes=5)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_parse_and_round_trip(path: Path) -> None:
    pool = EncoderPool.from_object(yaml.safe_load(path.read_text()))
    again = EncoderPool.model_validate(pool.model_dump(mode="json"))
    assert again == pool
    assert pool.name
    assert pool.spec.model.name


def test_both_transports_have_a_sample() -> None:
    transports = {
        EncoderPool.from_object(yaml.safe_load(p.read_text())).spec.connector.transport
        for p in SAMPLES
    }
    assert transports == {"sharedVolume", "rdma"}


def test_minimal_pool_gets_fixed_defaults() -> None:
    spec = EncoderPool.model_validate(BASE).spec
    assert spec.model.dtype == "bfloat16"
    assert (spec.producer.replicas, spec.consumer.replicas) == (1, 1)
    assert spec.router.enabled
    assert spec.router.port == 8000
    assert spec.router.service_type == "ClusterIP"
    assert spec.router.consumer_policy == "LeastBusy"
    sv = spec.connector.shared_volume
    assert sv is not None
    assert sv.mount_path == "/var/cache/encoderpool"
    assert sv.eviction == "lru"
    assert spec.width_job.active_deadline_seconds == 1800
    assert spec.served_model_name() == "/models/tiny"


def test_what_the_api_server_returns_parses() -> None:
    """Server-filled metadata, int quantities, status with conditions, kopf-like mappings."""
    obj = patched(
        {
            "metadata": {
                "namespace": "ml",
                "uid": "0b7c",
                "generation": 3,
                "resourceVersion": "42",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}],
            },
            "spec": {"producer": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
            "status": {
                "observedGeneration": 3,
                "producers": {"desired": 2, "ready": 1, "available": 1, "summary": "1/2"},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "False",
                        "reason": "ProducersUnavailable",
                        "message": "1/2 producers",
                        "observedGeneration": 3,
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }
                ],
            },
        }
    )
    pool = EncoderPool.from_object(obj)
    assert (pool.name, pool.namespace, pool.generation) == ("pool", "ml", 3)
    assert pool.spec.producer.resources.limits == {"nvidia.com/gpu": "1"}
    assert find_condition(pool.status.conditions, READY) is not None
    assert pool.status.producers == ReplicaStatus(desired=2, ready=1, available=1)


@pytest.mark.parametrize(
    ("case", "patch", "field", "fix"),
    INVALID + PYDANTIC_ONLY,
    ids=[c[0] for c in INVALID + PYDANTIC_ONLY],
)
def test_invalid_pool_is_refused_naming_the_field(
    case: str, patch: dict[str, Any], field: str, fix: str
) -> None:
    with pytest.raises(ValueError, match="invalid") as info:
        EncoderPool.from_object(patched(patch))
    message = str(info.value)
    assert message.startswith("EncoderPool "), message
    assert field in message, message
    assert fix in message, message


@pytest.mark.parametrize(("case", "patch", "path"), RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_rule_refuses_its_sample_with_its_message(
    case: str, patch: dict[str, Any], path: str
) -> None:
    where, message = refusal(patch)
    assert where == path
    rule = rule_at(where, message)
    with pytest.raises(ValueError, match=r"^EncoderPool \S+ is invalid: ") as info:
        EncoderPool.from_object(patched(patch))
    assert str(info.value).endswith(f" is invalid: {path}: {rule.message}"), info.value


def test_every_rule_has_one_invalid_sample() -> None:
    """RULE_CASES and TRANSITION_CASES exercise each rule once: a new rule needs a case."""
    checked = [id(rule_at(*refusal(patch))) for _, patch, _ in RULE_CASES]
    transitions = [id(rule_at(path)) for *_, path in TRANSITION_CASES]
    assert len(set(checked)) == len(checked)
    assert len(set(transitions)) == len(transitions)
    every = {id(r): f"{path}{r.field_path}: {r.message}" for path, r in rules()}
    missing = {every[i] for i in every.keys() - {*checked, *transitions}}
    assert not missing, f"rules without a sample in api_cases.py: {missing}"


def test_rules_have_a_check_unless_they_compare_with_the_stored_object() -> None:
    for path, rule in rules():
        if rule.check is None:
            assert rule.cel is not None, (path, rule)
            assert "oldSelf" in rule.cel, (path, rule)
        else:
            assert rule.cel is None or "oldSelf" not in rule.cel, (path, rule)


def test_error_names_the_object() -> None:
    obj = patched({"metadata": {"namespace": "ml"}, "spec": {"model": {"dtype": "fp8"}}})
    with pytest.raises(ValueError, match=r"^EncoderPool ml/pool is invalid: spec\.model\.dtype"):
        EncoderPool.from_object(obj)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Gi", 1 << 30),
        ("1.5Gi", 3 << 29),
        ("500M", 500_000_000),
        ("1e3", 1000),
        ("2E", 2e18),
        ("1E3", 1000),
        ("250m", 0.25),
        ("3", 3),
        (3, 3),
    ],
)
def test_quantity(text: str | int, value: float) -> None:
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "1GB", "-1Gi", "Gi", "1 Gi"])
def test_bad_quantity(text: str) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(text)


def test_fractional_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        quantity_bytes("1500m")


def test_model_identity_is_stable_and_follows_the_spec() -> None:
    spec = EncoderPool.model_validate(BASE).spec
    identity = spec.model_identity("0.32.0")
    assert identity.model == "/models/tiny"
    assert identity.vllm_version == "0.32.0"
    assert identity.fingerprint() == spec.model_identity("0.32.0").fingerprint()
    other = EncoderPool.model_validate(patched({"spec": {"model": {"dtype": "float32"}}})).spec
    assert other.model_identity("0.32.0").fingerprint() != identity.fingerprint()


@pytest.mark.parametrize(
    "rdma",
    [
        {"ucxTransports": "tcp,sm,self"},  # the kind and local test beds
        {"ucxTransports": "rc,tcp"},
        {"ucxTransports": "^rc"},  # every transport but rc: tcp included
        {"ucxTransports": "all"},
        {"resourceName": "rdma/hca"},
        {"networks": ["rdma-net"]},
    ],
)
def test_rdma_that_can_reach_another_node_is_accepted(rdma: dict[str, Any]) -> None:
    obj = patched({"spec": {"connector": {"sharedVolume": None, "rdma": rdma}}})
    assert EncoderPool.from_object(obj).spec.connector.transport == "rdma"


@pytest.mark.parametrize(
    ("connector", "transport"),
    [
        ({"sharedVolume": {"size": "10Gi"}}, "sharedVolume"),
        ({"sharedVolume": {"existingClaim": "c", "capacity": "5Gi"}}, "sharedVolume"),
        ({"rdma": {"bufferSize": "2Gi", "sideChannelPort": 6000, "networks": ["n"]}}, "rdma"),
    ],
)
def test_connector_config_round_trips_through_the_connector(
    connector: dict[str, Any], transport: str
) -> None:
    obj = copy.deepcopy(BASE)
    obj["spec"]["connector"] = connector
    spec = EncoderPool.model_validate(obj).spec
    config = spec.connector_config("0123456789abcdef", {"image": 128})
    parsed = ConnectorConfig.from_extra_config(config.to_extra_config())
    assert parsed == config
    assert parsed.transport == transport
    if parsed.shared_volume is not None:
        cap = connector["sharedVolume"].get("capacity")
        want = quantity_bytes(cap) if cap else (10 << 30) * 9 // 10
        assert parsed.shared_volume.capacity_bytes == want
    if parsed.rdma is not None:
        assert (parsed.rdma.buffer_bytes, parsed.rdma.side_channel_port) == (2 << 30, 6000)


def test_replica_summary_is_derived() -> None:
    assert ReplicaStatus(desired=3, ready=2, available=1).summary == "2/3"
    assert ReplicaStatus.model_validate({"desired": 3, "ready": 3, "summary": "9/9"}).summary == (
        "3/3"
    )


def test_status_summaries_are_derived_from_their_lists() -> None:
    scaler = {
        "role": "producer-video",
        "group": "video",
        "engine": "keda",
        "name": "p-producer-video",
        "minReplicas": 0,
        "maxReplicas": 2,
        "currentReplicas": 0,
        "desiredReplicas": 0,
        "reason": "ScalerNotActive",
    }
    status = EncoderPoolStatus.model_validate(
        {
            "producerGroups": [{"name": "images", "desired": 2, "ready": 1}, {"name": "video"}],
            "autoscaling": [scaler, {**scaler, "role": "consumer", "active": True}],
            "autoscalingSummary": "forged",
        }
    )
    assert status.producer_groups_summary == "images 1/2, video 0/0"
    assert status.autoscaling_summary == ("producer-video 0/0 (0-2) inactive, consumer 0/0 (0-2)")
    again = EncoderPoolStatus.model_validate(status.model_dump(by_alias=True))
    assert again == status
    assert EncoderPoolStatus().autoscaling_summary is None


def test_times_are_utc_seconds() -> None:
    cond = Condition.model_validate(
        {
            "type": READY,
            "status": "True",
            "reason": "AllAvailable",
            "lastTransitionTime": "2026-01-01T02:00:00.123456+02:00",
        }
    )
    assert cond.last_transition_time == T0
    assert cond.model_dump(mode="json")["lastTransitionTime"] == "2026-01-01T00:00:00Z"


# ------------------------------------------------------------------ conditions


def _update(type_: str, status: str, reason: str = "Because", **kw: Any) -> ConditionUpdate:
    return ConditionUpdate.model_validate({"type": type_, "status": status, "reason": reason, **kw})


def _set(*updates: ConditionUpdate, now: datetime = T0) -> tuple[Condition, ...]:
    conds: tuple[Condition, ...] = ()
    for u in updates:
        conds = set_condition(conds, u, now)
    return conds


@pytest.mark.parametrize(
    ("old", "new", "moves"),
    [
        ("True", "True", False),
        ("False", "False", False),
        ("True", "False", True),
        ("False", "True", True),
        ("Unknown", "True", True),
        ("True", "Unknown", True),
    ],
)
def test_transition_time_moves_only_when_status_flips(old: str, new: str, moves: bool) -> None:
    before = _set(_update(READY, old, "Old", message="old", observed_generation=1))
    after = set_condition(
        before, _update(READY, new, "New", message="new", observed_generation=2), T1
    )
    (cond,) = after
    assert cond.last_transition_time == (T1 if moves else T0)
    # Everything else always follows the update.
    assert (cond.status, cond.reason, cond.message, cond.observed_generation) == (
        new,
        "New",
        "new",
        2,
    )


def test_new_type_is_appended_and_others_are_untouched() -> None:
    before = _set(_update(WIDTHS_MEASURED, "True"), _update(PRODUCERS_AVAILABLE, "False"))
    after = set_condition(before, _update(CONSUMERS_AVAILABLE, "True"), T1)
    assert [c.type for c in after] == [WIDTHS_MEASURED, PRODUCERS_AVAILABLE, CONSUMERS_AVAILABLE]
    assert after[:2] == before
    assert after[2].last_transition_time == T1
    replaced = set_condition(after, _update(WIDTHS_MEASURED, "False"), T1)
    assert [c.type for c in replaced] == [c.type for c in after]


def test_unchanged_condition_gives_an_identical_status() -> None:
    """A reconcile pass that observes nothing new must not produce a write."""
    status = EncoderPoolStatus(conditions=_set(_update(READY, "True", "AllAvailable")))
    again = status.model_copy(
        update={
            "conditions": set_condition(
                status.conditions, _update(READY, "True", "AllAvailable"), T1
            )
        }
    )
    assert again.model_dump(mode="json") == status.model_dump(mode="json")


ALL_TRUE = (
    CHILDREN_OWNED,
    WIDTHS_MEASURED,
    PRODUCERS_AVAILABLE,
    CONSUMERS_AVAILABLE,
    ROUTER_AVAILABLE,
)


@pytest.mark.parametrize(
    ("statuses", "router", "want"),
    [
        (dict.fromkeys(ALL_TRUE, "True"), True, ("True", "AllAvailable")),
        (dict.fromkeys(ALL_TRUE[:-1], "True"), False, ("True", "AllAvailable")),
        (dict.fromkeys(ALL_TRUE[:-1], "True"), True, ("Unknown", "Pending")),
        ({**dict.fromkeys(ALL_TRUE, "True"), PRODUCERS_AVAILABLE: "False"}, True, ("False", "R")),
        ({**dict.fromkeys(ALL_TRUE, "True"), WIDTHS_MEASURED: "Unknown"}, True, ("Unknown", "R")),
        ({}, True, ("Unknown", "Pending")),
    ],
)
def test_ready_summarizes_the_others(
    statuses: dict[str, str], router: bool, want: tuple[str, str]
) -> None:
    conds = _set(*[_update(t, s, "R" if s != "True" else "Ok") for t, s in statuses.items()])
    ready = ready_condition(conds, router_enabled=router, observed_generation=7)
    assert (ready.type, ready.status, ready.reason) == (READY, *want)
    assert ready.observed_generation == 7

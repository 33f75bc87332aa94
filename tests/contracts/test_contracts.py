"""The shared contracts: identity comparison and fingerprints agree on both sides; the
announcement keeps its wire form; none of it needs torch or vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from encoderpool_contracts import (
    ANNOUNCE_KEY,
    TERMINATION_MESSAGE_LIMIT,
    Announcement,
    ConnectorConfig,
    ModelIdentity,
    WidthReport,
    announce,
    raw_announcement,
)

OPERATOR = ModelIdentity(
    model="/models/m", dtype="bfloat16", vllm_version="registry/vllm:0.32.0",
    limit_mm_per_prompt={"image": 1},
)  # fmt: skip


def served(**changes: object) -> ModelIdentity:
    base = {
        "model": "/models/m",
        "dtype": "bfloat16",
        "vllm_version": "0.32.0+cpu",
        "limit_mm_per_prompt": {"image": 1, "video": 0},
    }
    return ModelIdentity.model_validate({**base, **changes})


def test_the_image_name_and_limits_vllm_filled_in_are_not_differences() -> None:
    assert OPERATOR.differences(served()) == []
    assert OPERATOR.fingerprint() != served().fingerprint()  # the operator's key is its own


def test_each_real_difference_is_named() -> None:
    problems = OPERATOR.differences(
        served(model="/models/other", dtype="float16", limit_mm_per_prompt={"image": 4})
    )
    assert len(problems) == 3
    assert problems[0].startswith("model: '/models/m', but vLLM serves '/models/other'")
    assert problems[1].startswith("dtype:")
    assert problems[2].startswith("limit_mm_per_prompt:")


def test_the_connector_config_carries_the_identity_round_trip() -> None:
    config = ConnectorConfig(
        transport="sharedVolume",
        model_fingerprint=OPERATOR.fingerprint(),
        model_identity=OPERATOR,
        shared_volume={"root": "/cache", "capacity_bytes": 1 << 30},
    )
    again = ConnectorConfig.from_extra_config(config.to_extra_config())
    assert again == config
    assert again.model_identity is not None
    assert again.model_identity.fingerprint() == again.model_fingerprint


def test_the_announcement_keeps_its_wire_form_and_rejects_what_is_not_one() -> None:
    fp = OPERATOR.fingerprint()
    item: dict[str, Any] = {"metadata": {}}
    announce(item, Announcement(fingerprint=fp))
    assert item == {"metadata": {}, ANNOUNCE_KEY: {"v": 1, "fingerprint": fp}}
    params = {"h": item, "x": "garbage"}
    assert Announcement.parse(raw_announcement(params, "h")) == Announcement(fingerprint=fp)
    assert raw_announcement(params, "x") is None
    assert raw_announcement(params, "missing") is None
    assert raw_announcement(None, "h") is None
    with pytest.raises(ValueError, match="announcement: v"):
        Announcement.parse({"v": 2, "fingerprint": fp})
    with pytest.raises(ValueError, match="fingerprint"):
        Announcement.parse({"v": 1, "fingerprint": "not-hex"})
    with pytest.raises(ValueError, match="rdma"):
        Announcement.parse({"v": 1, "fingerprint": fp, "rdma": "\x00garbage"})


def test_the_contracts_import_neither_torch_nor_vllm() -> None:
    """The operator and the router import the contracts without either installed."""
    code = (
        "import sys, encoderpool_connector, encoderpool_contracts;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'kopf'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_router_args_are_router_settings_and_parse_back_to_the_same_values() -> None:
    """What the operator writes (``RouterArgs.argv``) the router parses, field by field:
    one name per flag on both sides, and every value survives the trip."""
    from encoderpool_contracts.router_args import RouterArgs
    from encoderpool_router.config import RouterSettings, parse_settings

    assert set(RouterArgs.model_fields) <= set(RouterSettings.model_fields)
    full = RouterArgs(
        producer_services_by_modality={"image": "p-images", "video": "p-video"},
        consumer_service="p-consumer",
        namespace="ml",
        host="0.0.0.0",  # noqa: S104 - the pod's address
        port=8000,
        metrics_port=9090,
        trust_client_media_ids=True,
        trust_request_mm_kwargs=True,
        consumer_policy="media-affinity",
        dispatch="when-faster",
        allowed_media_domains=("a.example", "b.example"),
        allow_private_media=True,
        limit_mm_per_prompt={"image": 2, "video": 1},
        reuse_encoded_s=60,
        auth_token_file="/etc/tokens",
    )
    assert set(full.model_fields_set) == set(RouterArgs.model_fields) - {"producer_service"}
    parsed = parse_settings(full.argv())
    for name in full.model_fields_set:
        want = getattr(full, name)
        got = getattr(parsed, name)
        assert (str(got) if name == "auth_token_file" else got) == want, name
    # Unset fields are not rendered: the router's defaults apply.
    minimal = RouterArgs(
        consumer_service="c", namespace="ml", host="h", port=1, metrics_port=2
    ).argv()
    assert minimal == [
        "--consumer-service", "c", "--namespace", "ml", "--host", "h",
        "--port", "1", "--metrics-port", "2",
    ]  # fmt: skip


def test_the_encode_times_env_is_a_router_setting_and_parses_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The width Job's encode times reach the router as the env of its --encode-seconds:
    one name and one format on both sides, to three significant digits."""
    from encoderpool_contracts.router_args import (
        ENCODE_SECONDS_ENV,
        ENV_PREFIX,
        encode_seconds_value,
    )
    from encoderpool_router.config import RouterSettings, parse_settings

    name = ENCODE_SECONDS_ENV.removeprefix(ENV_PREFIX).lower()
    assert name in RouterSettings.model_fields
    value = encode_seconds_value({"video": 1.23456, "image": 0.078312, "audio": 0.0004567})
    assert value == '{"audio": 0.000457, "image": 0.0783, "video": 1.23}'
    monkeypatch.setenv(ENCODE_SECONDS_ENV, value)
    got = parse_settings(["--consumers", "http://127.0.0.1:1"]).encode_seconds
    assert got == {"audio": 0.000457, "image": 0.0783, "video": 1.23}


def earlier_report() -> dict[str, Any]:
    """A width report as releases before the encode timing wrote it (version 1)."""
    return {
        "version": 1,
        "fingerprint": OPERATOR.fingerprint(),
        "identity": OPERATOR.model_dump(mode="json"),
        "encoder_output_widths": {"image": 3584, "video": 3584},
        "hidden_size": 3584,
        "dtype": "bfloat16",
        "bytes_per_token": {"image": 7168, "video": 7168},
        "max_tokens_per_item": {"image": 16384, "video": 32768},
        "measured_at": "2026-11-02T10:00:00Z",
    }


def test_a_width_report_of_an_earlier_release_still_parses_without_encode_times() -> None:
    text = json.dumps(earlier_report())
    report = WidthReport.from_termination_message(text)
    assert report.version == 1
    assert report.encode_seconds == {}
    assert WidthReport.from_configmap_data({"report.json": text}) == report


def test_encode_times_round_trip_through_the_termination_message_and_configmap() -> None:
    report = WidthReport.model_validate(
        {**earlier_report(), "encode_seconds": {"image": 0.078312, "video": 1.5}}
    )
    assert report.version == 1  # an added optional field keeps the version
    text = report.to_termination_message()
    assert len(text.encode()) <= TERMINATION_MESSAGE_LIMIT
    assert '"encode_seconds":{"image":0.078312,"video":1.5}' in text
    again = WidthReport.from_termination_message(text)
    assert again == report
    assert again.encode_seconds == {"image": 0.078312, "video": 1.5}
    assert WidthReport.from_configmap_data(report.to_configmap_data()) == report


@pytest.mark.parametrize(
    "seconds",
    [0.0, -1.0, float("nan"), float("inf"), 3600.5],
)
def test_an_encode_time_out_of_bounds_is_refused(seconds: float) -> None:
    with pytest.raises(ValidationError) as info:
        WidthReport.model_validate({**earlier_report(), "encode_seconds": {"image": seconds}})
    assert "encode_seconds.image" in str(info.value)


def test_an_encode_time_only_for_a_measured_modality() -> None:
    with pytest.raises(ValidationError) as info:
        WidthReport.model_validate({**earlier_report(), "encode_seconds": {"audio": 0.1}})
    assert "encode_seconds has audio" in str(info.value)

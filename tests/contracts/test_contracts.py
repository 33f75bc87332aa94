"""The shared contracts: identity comparison and fingerprints agree on both sides."""

from __future__ import annotations

from encoderpool_connector.contracts import ConnectorConfig, ModelIdentity

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

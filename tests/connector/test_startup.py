"""The start-up checks both transports make (core.startup), without an engine: a
stand-in for the parts of vLLM's config they read."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vllm

from encoderpool_connector.core.startup import encoder_widths, parse_config
from encoderpool_contracts import (
    TERMINATION_LOG_ENV,
    ConnectorConfig,
    ModelIdentity,
    WidthMismatch,
)

WIDTH = 8


def engine(
    tp: int = 1, model: str = "/m", measured: dict[str, int] | None = None
) -> SimpleNamespace:
    """What the start-up checks read of a VllmConfig: the producer's measured widths, the
    served model and its parallelism."""
    return SimpleNamespace(
        ec_transfer_config=SimpleNamespace(
            mm_encoder_output_widths={"image": WIDTH} if measured is None else measured
        ),
        model_config=SimpleNamespace(
            model=model, revision=None, dtype=torch.bfloat16, multimodal_config=None
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
    )


def sv_config(widths: dict[str, int], identity: ModelIdentity | None = None) -> ConnectorConfig:
    identity = identity or ModelIdentity(model="/m", vllm_version=str(vllm.__version__))
    return ConnectorConfig(
        transport="sharedVolume",
        model_fingerprint=identity.fingerprint(),
        model_identity=identity,
        encoder_output_widths=widths,
        shared_volume={"root": "/tmp/x", "capacity_bytes": 1 << 20},
    )


def test_the_widths_are_what_was_measured_and_what_the_report_names() -> None:
    config = sv_config({"image": WIDTH, "video": 16})
    merged = {"image": WIDTH, "video": 16, "audio": 4}
    assert encoder_widths(config, engine(measured={"image": WIDTH, "audio": 4})) == merged
    assert encoder_widths(config, engine(measured={})) == {"image": WIDTH, "video": 16}


def test_a_report_the_encoder_disagrees_with_stops_the_start() -> None:
    config = sv_config({"image": WIDTH + 1})
    with pytest.raises(ValueError, match=r"encoder_output_widths\.image: configured 9, but"):
        encoder_widths(config, engine())


def test_a_refusal_is_left_as_the_termination_message_where_the_operator_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator reads it from the pod's status (WidthMismatch, in contracts)."""
    config = sv_config({"image": WIDTH + 1, "video": 16})
    log = tmp_path / "termination-log"
    monkeypatch.delenv(TERMINATION_LOG_ENV, raising=False)
    with pytest.raises(ValueError, match="measure again"):  # unset: nothing written
        encoder_widths(config, engine(measured={"image": WIDTH, "video": 16, "audio": 4}))
    assert not log.exists()
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(log))
    with pytest.raises(ValueError, match="measure again"):
        encoder_widths(config, engine(measured={"image": WIDTH, "video": 16, "audio": 4}))
    said = WidthMismatch.from_termination_message(log.read_text())
    assert said.fingerprint == config.model_fingerprint
    assert said.configured == {"image": WIDTH + 1, "video": 16}
    assert said.measured == {"image": WIDTH, "video": 16}  # only what the report names
    assert said.summary() == f"image: report {WIDTH + 1}, the pod's vLLM {WIDTH}"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(ValueError, match="measure again"):  # unwritable: the refusal stands
        encoder_widths(config, engine(measured={"image": WIDTH}))


def test_the_transport_must_be_the_connectors_own() -> None:
    extra = sv_config({"image": WIDTH}).to_extra_config()
    vllm_config = SimpleNamespace(
        ec_transfer_config=SimpleNamespace(ec_connector_extra_config=extra)
    )
    assert parse_config(vllm_config, "sharedVolume", "X").transport == "sharedVolume"
    with pytest.raises(ValueError, match="transport: EncoderPoolNixlConnector needs 'rdma'"):
        parse_config(vllm_config, "rdma", "EncoderPoolNixlConnector")


def test_a_consumer_of_another_parallelism_is_not_warned_about_the_identity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pool's identity carries the producers' parallelism (the width Job's); a consumer
    at another tensor-parallel size serves the same model."""
    identity = ModelIdentity(model="/m", vllm_version=str(vllm.__version__), tensor_parallel_size=2)
    config = sv_config({"image": WIDTH}, identity)

    with caplog.at_level(logging.WARNING, logger="vllm.ext"):
        assert encoder_widths(config, engine(1), producer=False) == {"image": WIDTH}
        assert "may be for another model" not in caplog.text
        encoder_widths(config, engine(2), producer=True)
        assert "may be for another model" not in caplog.text
        encoder_widths(config, engine(1), producer=True)
        assert "tensor_parallel_size: 2, but vLLM serves 1" in caplog.text
        caplog.clear()
        encoder_widths(config, engine(1, model="/other"), producer=False)
        assert "model: '/m', but vLLM serves '/other'" in caplog.text

"""The width Job's entrypoint on the real engine (tiny Qwen2-VL): the report it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from e2e.vllm_server import base_env
from encoderpool_connector.programs.encode_timing import encode_seconds
from encoderpool_connector.programs.measure import MeasureError, parse_args, publish
from encoderpool_contracts import (
    MAX_ENCODE_SECONDS,
    TERMINATION_MESSAGE_LIMIT,
    ModelIdentity,
    WidthReport,
)
from encoderpool_contracts.pod import MEASURE_MODULE
from tests.connector.fixtures import tiny_fingerprint


def run_measure(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", MEASURE_MODULE, *args],
        env=base_env("0"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.vllm
def test_measure_writes_the_report_as_a_termination_message(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The Job writes compact JSON to /dev/termination-log; here a file stands in for it."""
    out = tmp_path / "termination-log"
    done = run_measure(
        "--model", str(tiny_model), "--max-model-len", "2048", "--output-file", str(out)
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    report = WidthReport.from_termination_message(text)
    assert report.encoder_output_widths["image"] == 128
    assert report.bytes_per_token["image"] == 256  # 128 x bf16
    assert report.hidden_size == 128
    assert report.max_tokens_per_item["image"] == 64  # 224x224 max pixels / 14^2 / 2x2 merge
    # vLLM's default limits admit videos too: each modality is measured on its own.
    assert report.encoder_output_widths["video"] == 128
    assert report.bytes_per_token["video"] == 256
    assert report.max_tokens_per_item["video"] == 448  # vLLM's budget for one video item
    # One warm encode of each modality's dummy item, timed on this CPU.
    assert set(report.encode_seconds) == {"image", "video"}
    assert all(0 < s < 60 for s in report.encode_seconds.values()), report.encode_seconds
    # The Job and the serving pods fingerprint the model the same way.
    assert report.fingerprint == tiny_fingerprint(tiny_model)
    # What the operator stores: compact, within the kubelet's limit, and it round-trips.
    assert text == report.model_dump_json()
    assert len(text.encode()) <= TERMINATION_MESSAGE_LIMIT
    assert WidthReport.from_configmap_data(report.to_configmap_data()) == report


def test_encode_times_take_the_slowest_rank_per_measured_modality() -> None:
    reports = [{"image": 0.0781234567, "video": 1.0}, {"image": 0.08}, {}]
    # Tensor-parallel ranks encode together: the slowest is the encode's time.
    assert encode_seconds(reports, ["image", "video"]) == {"image": 0.08, "video": 1.0}
    # Only what was measured, whole microseconds, at least one, at most the report's bound.
    assert encode_seconds([{"image": 0.0781234567, "audio": 2.0}], ["image"]) == {"image": 0.078123}
    assert encode_seconds([{"image": 1e-9}], ["image"]) == {"image": 1e-6}
    assert encode_seconds([{"image": 1e9}], ["image"]) == {"image": MAX_ENCODE_SECONDS}
    assert encode_seconds([{"image": float("nan")}], ["image"]) == {}
    assert encode_seconds([], ["image"]) == {}


def test_a_report_too_large_for_a_termination_message_fails_clearly(tmp_path: Path) -> None:
    # A model path long enough to pass the limit (a report's counts are bounded).
    identity = ModelIdentity(model="/models/" + "m" * 5000, vllm_version="v")
    modalities = {"image": 128, "video": 128}
    report = WidthReport(
        fingerprint=identity.fingerprint(),
        identity=identity,
        encoder_output_widths=modalities,
        hidden_size=128,
        dtype="bfloat16",
        bytes_per_token={m: 256 for m in modalities},
        max_tokens_per_item={m: 64 for m in modalities},
        measured_at=datetime.now(timezone.utc),
    )
    out = tmp_path / "termination-log"
    with pytest.raises(MeasureError) as e:
        publish(report, parse_args(["--model", "/x", "--output-file", str(out)]))
    assert e.value.code == 4
    assert "4096" in str(e.value)
    assert "termination message" in str(e.value)
    assert not out.exists()


def test_missing_model_path_fails_clearly(tmp_path: Path) -> None:
    done = run_measure("--model", str(tmp_path / "nope"), "--output-file", str(tmp_path / "r"))
    assert done.returncode == 2
    assert "--model" in done.stderr
    assert "does not exist" in done.stderr
    assert not (tmp_path / "r").exists()


def test_model_without_multimodal_encoder_fails_clearly(tiny_model: Path, tmp_path: Path) -> None:
    """A text-only Qwen2 (random, tiny) with the tiny model's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text = tmp_path / "text-only"
    cfg = Qwen2Config(
        vocab_size=json.loads((tiny_model / "config.json").read_text()).get("vocab_size", 151936),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(text)
    for f in tiny_model.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("vocab.json", "merges.txt"):
            (text / f.name).write_bytes(f.read_bytes())
    done = run_measure("--model", str(text), "--output-file", str(tmp_path / "r"))
    assert done.returncode == 3, done.stderr[-3000:]
    assert "no multimodal encoder" in done.stderr
    assert not (tmp_path / "r").exists()


def test_measure_needs_an_output_and_no_api_access() -> None:
    done = run_measure("--model", "/x")
    assert done.returncode == 2
    assert "--output-file" in done.stderr
    # The Job does not talk to the API server (the operator writes the ConfigMap): no
    # ConfigMap flags.
    done = run_measure("--model", "/x", "--output-file", "/tmp/r", "--configmap-namespace", "ns")
    assert done.returncode == 2
    assert "unrecognized arguments: --configmap-namespace" in done.stderr

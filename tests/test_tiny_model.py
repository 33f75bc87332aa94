"""The locally built model is deterministic, so token ids can be compared across runs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from e2e.tiny_model import HIDDEN, build


def _digests(root: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.iterdir())
        if p.is_file()
    }


def test_two_builds_give_the_same_bytes(tmp_path: Path) -> None:
    first = _digests(build(tmp_path / "one"))
    second = _digests(build(tmp_path / "two"))
    assert "model.safetensors" in first
    assert first == second


def test_shape_is_what_the_tests_rely_on(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == HIDDEN == 128
    assert config["vision_config"]["hidden_size"] == HIDDEN  # encoder output width
    assert (
        config["text_config"]["hidden_size"] // config["text_config"]["num_attention_heads"] == 64
    )

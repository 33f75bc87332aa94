"""The GPU data-path benchmark's CPU smoke (the GPU figures come from runs on a GPU machine,
docs/benchmarks-gpu.md): it runs end to end without vLLM, its RESULT line parses, the
CPU figures are finite, and the real-size models it times on CUDA build and run at a
tiny size here."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import torch

from benchmarks.gpu_datapath import (
    encode_once,
    language_model,
    parse_result,
    prefill_once,
    vision_tower,
)
from e2e.vllm_server import REPO, base_env


def test_the_cpu_smoke_reports_finite_figures_and_a_result_line() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_datapath", "--stand-in-vllm", "--iters", "2"],
        env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "stood in" in out
    figures = {k.strip(): float(v) for k, v in re.findall(r"^  (.+?) +(\d+\.\d+) ms$", out, re.M)}
    for label in (
        "save on the step: ours (staging + copy stream)",
        "save on the step: previous (to cpu non_blocking)",
        "save on the step: example (safetensors, sync)",
        "load until usable on the device: ours",
        "load: raw (one thread, read + pinned copy)",
        "load: example (safetensors load_file)",
    ):
        assert math.isfinite(figures[label]), out
    assert "saves dropped (ours): 0" in out
    assert out.count("no device") == 4  # H2D pinned, pageable, encode, prefill
    last = out.strip().splitlines()[-1]
    result = parse_result(last)
    assert list(result) == [
        "gpu_save_block_ratio",
        "gpu_load_ratio",
        "gpu_fraction_of_raw",
        "encode_over_load",
    ]
    assert all(math.isfinite(result[k]) and result[k] > 0 for k in list(result)[:3])
    assert math.isnan(result["encode_over_load"])


def test_the_models_it_times_on_cuda_build_and_run_at_a_tiny_size_on_cpu() -> None:
    cpu = torch.device("cpu")
    tower = vision_tower(cpu, torch.float32, depth=1, embed_dim=32, num_heads=2, hidden_size=64)
    assert tower.config.spatial_merge_size == 2
    assert tuple(encode_once(tower, (8, 8), cpu).shape) == (16, 64)  # 64 patches merged 2x2
    lm = language_model(
        cpu,
        torch.float32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    assert tuple(prefill_once(lm, 40, cpu).shape) == (1, 1, 1000)


def test_the_default_vision_tower_is_qwen2_vl_7b_s() -> None:
    """The sizes the GPU run uses, without building them here (0.7B parameters)."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    c = Qwen2VLVisionConfig()
    assert (c.depth, c.embed_dim, c.hidden_size, c.num_heads) == (32, 1280, 3584, 16)

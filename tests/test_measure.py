"""The width Job's entrypoint on the real engine (tiny Qwen2-VL) and the local control plane."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e.cluster import LocalCluster
from e2e.vllm_server import base_env
from encoderpool_connector.contracts import LABEL_FINGERPRINT, WidthReport, configmap_name
from tests.fixtures_connector import tiny_fingerprint


def run_measure(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "encoderpool_connector.measure", *args],
        env=base_env("0"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.vllm
@pytest.mark.cluster
def test_measure_writes_the_report_to_a_file_and_a_configmap(
    tiny_model: Path, cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    done = run_measure(
        "--model", str(tiny_model), "--max-model-len", "2048",
        "--output-file", str(out),
        "--configmap-namespace", namespace, "--kubeconfig", str(cluster.kubeconfig),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = WidthReport.model_validate_json(out.read_text())
    assert report.encoder_output_widths["image"] == 128
    assert report.bytes_per_token["image"] == 256  # 128 x bf16
    assert report.hidden_size == 128
    assert report.max_tokens_per_item["image"] == 64  # 224x224 max pixels / 14^2 / 2x2 merge
    # The Job and the serving pods fingerprint the model the same way.
    assert report.fingerprint == tiny_fingerprint(tiny_model)

    cm = json.loads(
        cluster.kubectl(
            "get",
            "configmap",
            configmap_name(report.fingerprint),
            "-n",
            namespace,
            "-o",
            "json",
            "--show-managed-fields",
        )
    )
    assert WidthReport.from_configmap_data(cm["data"]) == report
    assert cm["metadata"]["labels"][LABEL_FINGERPRINT] == report.fingerprint
    managers = {m["manager"] for m in cm["metadata"]["managedFields"]}
    assert managers == {"encoderpool-measure"}
    assert [m["operation"] for m in cm["metadata"]["managedFields"]] == ["Apply"]


@pytest.mark.vllm
@pytest.mark.cluster
def test_measure_without_permission_fails_clearly(
    tiny_model: Path, cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    token = cluster.kubectl("create", "token", "nobody", "-n", namespace).strip()
    kubeconfig = tmp_path / "nobody.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": cluster.server,
                            "certificate-authority": str(cluster.pki / "ca.crt"),
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    done = run_measure(
        "--model", str(tiny_model), "--max-model-len", "2048",
        "--configmap-namespace", namespace, "--kubeconfig", str(kubeconfig),
    )  # fmt: skip
    assert done.returncode == 4, done.stderr[-3000:]
    assert "forbidden" in done.stderr.lower()
    assert "create/patch on configmaps" in done.stderr
    assert token not in done.stderr + done.stdout


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


def test_measure_needs_an_output() -> None:
    done = run_measure("--model", "/x")
    assert done.returncode == 2
    assert "--output-file and/or --configmap-namespace" in done.stderr

"""The image's vLLM model-class cache (encoderpool_connector.programs.vllm_cache) on the real vLLM:
after ``fill``, vLLM's own start-up lookup is answered from the cache, without the
inspection subprocess; an entry whose source hash no longer matches is not used. The
image build runs the same module (docker/vllm.Dockerfile); tests/kind checks the pods'
logs for the cache hit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from e2e.vllm_server import base_env

ARCH = "Qwen2VLForConditionalGeneration"  # the tiny test model's

# One process (importing vLLM costs ~10 s of CPU): fill, then ask vLLM as it asks at start-up.
SCRIPT = """
import importlib.util, json, pathlib, sys
from vllm.model_executor.models import registry
from encoderpool_connector.programs.vllm_cache import fill, main

arch = sys.argv[1]
done, skipped = fill([arch, "NoSuchArchitecture"])
def no_subprocess(fn):
    raise AssertionError("vLLM inspected the model in a subprocess: the cache missed")
registry._run_in_subprocess = no_subprocess
model = registry.ModelRegistry.models[arch]
info = model.inspect_model_cls()

# A changed model source: vLLM's hash check refuses the entry.
path = model._get_cache_dir() / model._get_cache_filename()
entry = json.loads(path.read_text())
entry["hash"] = "0" * len(entry["hash"])
path.write_text(json.dumps(entry))
source = pathlib.Path(importlib.util.find_spec(model.module_name).origin)
stale = model._load_modelinfo_from_cache(model._get_modelinfo_module_hash(source))
print(json.dumps({
    "done": done, "skipped": skipped, "multimodal": info.supports_multimodal,
    "stale_used": stale is not None, "unknown_rc": main(["NoSuchArchitecture"]),
}))
"""


def test_filled_cache_answers_vllms_start_up_lookup(tmp_path: Path) -> None:
    env = {**base_env(), "VLLM_CACHE_ROOT": str(tmp_path / "vllm")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ARCH],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["done"] == [ARCH]
    assert out["skipped"] == {"NoSuchArchitecture": "not a registered architecture"}
    assert out["multimodal"] is True  # vLLM's answer, read back from the cache
    assert out["stale_used"] is False
    assert out["unknown_rc"] == 1  # asked for one architecture and got none: a failure
    assert (tmp_path / "vllm" / "modelinfos").is_dir()


def test_without_a_cache_root_it_says_what_to_set() -> None:
    env = {k: v for k, v in base_env().items() if k != "VLLM_CACHE_ROOT"}
    done = subprocess.run(
        [sys.executable, "-m", "encoderpool_connector.programs.vllm_cache"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "set VLLM_CACHE_ROOT" in done.stderr

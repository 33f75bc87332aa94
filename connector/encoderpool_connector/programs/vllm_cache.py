"""Fill vLLM's model-class cache (``$VLLM_CACHE_ROOT/modelinfos``) when the image is built.

At every start vLLM inspects the model's class (is it multimodal, does it support
pipeline parallelism, ...). Without a cached answer it imports the model in a fresh
Python process (``python -m vllm.model_executor.models.registry``): about 10 s of CPU
per pod start on a small CPU node, because a pod's cache directory starts empty. The
image computes the answers for every registered architecture once (~20 s at build time,
~1.3 MB) and points ``VLLM_CACHE_ROOT`` at them (docker/vllm.Dockerfile).

vLLM checks each entry against a hash of the model's source, so a stale or missing entry
costs only the subprocess again, never a wrong answer. This uses vLLM's private registry
API (the image pins vLLM 0.32); if that API moves, the build prints why and goes on
without the cache instead of failing.

    python -m encoderpool_connector.programs.vllm_cache [ARCH ...]   # default: every architecture

It imports nothing of ours, so the image runs it as a plain script before our install.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def fill(archs: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """Cache the class info of ``archs`` (every lazily registered one by default) under
    ``$VLLM_CACHE_ROOT/modelinfos``. Returns the cached architectures and, for the
    others, why not (a missing optional dependency, a class vLLM itself cannot inspect)."""
    from vllm.model_executor.models.registry import (
        ModelRegistry,
        _LazyRegisteredModel,
        _ModelInfo,
    )

    done: list[str] = []
    skipped: dict[str, str] = {}
    for arch, model in sorted(ModelRegistry.models.items()):
        if archs is not None and arch not in archs:
            continue
        if not isinstance(model, _LazyRegisteredModel):
            continue  # registered as a class: vLLM inspects it in-process, nothing to cache
        try:
            spec = importlib.util.find_spec(model.module_name)
            if spec is None or spec.origin is None:
                raise ImportError(f"no source file for {model.module_name}")
            # The key vLLM checks at start-up: a hash of the module's source as installed.
            key = model._get_modelinfo_module_hash(Path(spec.origin))
            model._save_modelinfo_to_cache(_ModelInfo.from_model_cls(model.load_model_cls()), key)
            done.append(arch)
        except Exception as e:  # one architecture failing must not stop the rest
            skipped[arch] = f"{type(e).__name__}: {str(e)[:200]}"
    missing = sorted(set(archs or ()) - set(done) - set(skipped))
    skipped.update({arch: "not a registered architecture" for arch in missing})
    return done, skipped


def main(argv: list[str]) -> int:
    root = os.environ.get("VLLM_CACHE_ROOT")
    if not root:
        print("vllm_cache: set VLLM_CACHE_ROOT to the image's cache directory", file=sys.stderr)
        return 2
    try:
        done, skipped = fill(argv or None)
    except Exception as e:  # vLLM's private API moved: build without the cache
        print(f"vllm_cache: not filled ({type(e).__name__}: {e}); pods inspect at start-up")
        return 0
    for arch, why in sorted(skipped.items()):
        print(f"vllm_cache: skipped {arch}: {why}")
    print(f"vllm_cache: {len(done)} architectures cached in {Path(root) / 'modelinfos'}")
    return 0 if done or not argv else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

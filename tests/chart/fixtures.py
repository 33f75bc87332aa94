"""What the chart tests share: where the chart is, the built helm, manifests as objects."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.runner import bin_dir

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "encoderpool-operator"


def helm(
    *args: str, check: bool = True, kubeconfig: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The built helm 4 (e2e/cluster/build.sh), with no user config or cache leaking in."""
    argv = [str(bin_dir() / "helm"), *args]
    if kubeconfig is not None:
        argv += ["--kubeconfig", str(kubeconfig)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    if check and res.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({res.returncode}):\n{res.stderr}")
    return res


def documents(manifest: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(manifest) if d]

"""The router benchmarks' own logic (the load runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import re
import subprocess
import sys

from e2e.vllm_server import REPO, base_env


def test_the_floor_benchmark_times_each_pass_and_sums_them() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.router_floor", "--mb", "1", "--reps", "3"],
        env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    passes = [float(m) for m in re.findall(r"^  .+? +(\d+\.\d+) ms$", res.stdout, re.M)]
    assert len(passes) == 5, res.stdout
    assert min(passes) >= 0
    (floor,) = re.findall(r"^RESULT floor_ms=(\d+\.\d+)$", res.stdout, re.M)
    assert float(floor) > 0
    assert abs(float(floor) - sum(passes)) < 0.01

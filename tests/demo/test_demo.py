"""`make demo` keeps working: the README's main command, run as a newcomer would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]


# The README's default transport. The rdma transport runs through the same demo code with
# another manifest; it is tested on real pods in tests/kind/test_pool_rdma.py and on real
# vLLM in tests/connector/rdma/test_epd.py, so a second ~100 s demo run buys little.
@pytest.mark.parametrize(
    ("transport", "source"), [("sharedVolume", "loaded from the shared volume")]
)
def test_the_demo_answers_a_request_through_the_pool(transport: str, source: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "e2e.demo", "--transport", transport],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "1 image encoded by the producer" in res.stdout
    assert f"1 embedding {source}" in res.stdout
    assert "demo: OK" in res.stdout

"""Each supported vLLM release beyond the CPU build, by contract: the release's own
Python modules (its wheel, unpacked without dependencies by tools/vllm-releases.sh) put
ahead of the venv's vLLM 0.32 in a pytest subprocess (this process has imported 0.32
already), which runs every test written against "the vLLM importable here":

- the connector's contract with vLLM (tests/contracts/test_vllm_api.py),
- the operator's rendered `vllm serve` and width Job command lines read by the release's
  own parser (tests/operator/test_vllm_serve_parser.py),
- the router's content-part agreement with the release's chat parser
  (tests/router/test_content_vllm.py), and its reading of Responses input items and
  Anthropic content blocks (tests/router/test_apis_vllm.py),
- the connector's unit suite (tests/connector without real engines, clusters or kind).

What cannot run here: a release's engine (its compiled ops are CUDA builds), so nothing
of these releases serves a request on these machines. A release moving anything these
tests use fails, never skips: the release missing from the cache fails too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.contracts.vllm_api import REPO

PINS = REPO / "requirements" / "vllm-releases.txt"
PYTHONPATH = ("contracts", "operator", "connector", "router", ".")
# The modules run against each release, and the unit tests' selection of tests/connector.
CONTRACT_MODULES = (
    "tests/contracts/test_vllm_api.py",
    "tests/operator/test_vllm_serve_parser.py",
    "tests/router/test_content_vllm.py",
    "tests/router/test_apis_vllm.py",
)
UNIT_SUITES = ("tests/connector",)
UNIT_MARKERS = "not vllm and not kind and not cluster and not alone"


class Release(NamedTuple):
    version: str
    sha256: str

    @property
    def folder(self) -> Path:
        """Where tools/vllm-releases.sh unpacks it (the same key: version, hash prefix)."""
        cache = os.environ.get("ENCODERPOOL_CACHE") or str(
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "encoderpool"
        )
        return Path(cache) / "vllm-releases" / f"{self.version}-{self.sha256[:16]}"


def releases(pins: Path = PINS) -> list[Release]:
    found = re.findall(r"^vllm==(\S+) --hash=sha256:([0-9a-f]{64})$", pins.read_text(), flags=re.M)
    return [Release(v, h) for v, h in found]


RELEASES = releases()


def test_the_supported_releases_are_pinned() -> None:
    assert [r.version for r in RELEASES] == ["0.33.0", "0.34.0"]


def _outcomes(junit: Path) -> dict[str, list[str]]:
    """Test ids by outcome ("failed", "skipped"), from pytest's JUnit XML."""
    out: dict[str, list[str]] = {"failed": [], "skipped": [], "passed": []}
    # Our own child pytest's report, not outside input.
    for case in ET.parse(junit).getroot().iter("testcase"):  # noqa: S314
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"].append(name)
        elif case.find("skipped") is not None:
            out["skipped"].append(name)
        else:
            out["passed"].append(name)
    return out


@pytest.mark.vllm_release
@pytest.mark.parametrize("release", RELEASES, ids=[r.version for r in RELEASES])
def test_the_release_keeps_every_contract(release: Release, tmp_path: Path) -> None:
    folder = release.folder
    assert (folder / ".complete").exists(), (
        f"vLLM {release.version} is not in {folder}: run tools/vllm-releases.sh "
        "(make test's tools/prepare.sh does)"
    )
    junit = tmp_path / "junit.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(folder), *(str(REPO / p) for p in PYTHONPATH)]),
        "ENCODERPOOL_VLLM_RELEASE": release.version,
        "ENCODERPOOL_VLLM_RELEASE_DIR": str(folder),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
         "--continue-on-collection-errors",
         "-o", "addopts=", "-m", UNIT_MARKERS, f"--junitxml={junit}",
         *CONTRACT_MODULES, *UNIT_SUITES],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert junit.exists(), f"pytest under vLLM {release.version} ran nothing:\n{tail}"
    outcomes = _outcomes(junit)
    assert outcomes["failed"] == [], f"under vLLM {release.version}:\n{tail}"
    assert run.returncode == 0, f"under vLLM {release.version}:\n{tail}"
    contract_ids = tuple(m.removesuffix(".py").replace("/", ".") for m in CONTRACT_MODULES)
    skipped = [t for t in outcomes["skipped"] if t.startswith(contract_ids)]
    assert skipped == [], f"contract tests skipped under vLLM {release.version}"
    for module in contract_ids:  # each module ran (80 tests in all under 0.32)
        ran = [t for t in outcomes["passed"] if t.startswith(module + "::")]
        assert ran, f"no test of {module} ran under vLLM {release.version}:\n{tail}"

"""The static checks gate the tests: a lint, format or type error fails `make test`.

``tools/checks.sh`` is run on a throwaway project with one error of each kind
(each tool must fail on its own), and ``make test`` with the checks replaced by
``false`` must stop before pytest runs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = """
[tool.ruff]
line-length = 100
[tool.ruff.lint]
select = ["E", "F", "I"]
[tool.mypy]
packages = ["bad"]
strict = true
"""
GOOD = "def f(x: int) -> int:\n    return x\n"
ERRORS = {
    "ruff check": "import os\n\n\n" + GOOD,  # F401: unused import
    "ruff format": "def f(x: int) -> int:\n    return   x\n",
    "mypy": "def f(x: int) -> int:\n    return str(x)\n",
}


def checks(project: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "tools" / "checks.sh"), str(project)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("tool", list(ERRORS))
def test_each_check_fails_on_its_own_kind_of_error(tmp_path: Path, tool: str) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "__init__.py").write_text(ERRORS[tool])
    out = checks(tmp_path)
    assert out.returncode != 0, out.stdout + out.stderr
    assert f"checks: {tool}" in out.stderr


def test_an_import_across_the_cut_fails_the_checks(tmp_path: Path) -> None:
    """The router importing the connector (clean to ruff, ruff format and mypy)."""
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "__init__.py").write_text(GOOD)
    router = tmp_path / "router" / "encoderpool_router"
    router.mkdir(parents=True)
    (router / "__init__.py").write_text("from encoderpool_connector import contracts\n")
    out = checks(tmp_path)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "checks: import rules" in out.stderr
    assert "encoderpool_router imports encoderpool_connector" in out.stderr


def test_a_clean_project_passes(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "__init__.py").write_text(GOOD)
    out = checks(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def make_test(checks: str) -> subprocess.CompletedProcess[str]:
    args = f"--collect-only -q {Path(__file__).relative_to(ROOT)}"
    return subprocess.run(
        ["make", "-C", str(ROOT), "test", f"CHECKS={checks}", f"PYTEST_ARGS={args}"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MAKEFLAGS": ""},
        check=False,
    )


def test_make_test_runs_pytest_only_when_the_checks_pass() -> None:
    passed = make_test("true")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "tests collected" in passed.stdout
    failed = make_test("false")
    assert failed.returncode != 0
    assert "collected" not in failed.stdout

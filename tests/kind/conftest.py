"""The kind tests' fixtures: our engine, the images, one kind cluster, the chart installed.

Session-scoped and built in that order, each from the project's own scripts, so
these tests run what a user runs. Heavy steps are cached by content outside the
repo (images, node image, binaries); the cluster itself is made fresh per session
and deleted at the end, and the engine is stopped if this session started it.
A failing test prints the pods, events and logs of its namespaces.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.cluster.runner import bin_dir
from e2e.kind.cluster import RELEASE, Engine, Images, KindCluster, host_sysctls
from e2e.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def sysctls_before() -> dict[str, str]:
    """The host's sysctls before any container of ours started."""
    return host_sysctls()


@pytest.fixture(scope="session")
def engine(sysctls_before: dict[str, str]) -> Iterator[Engine]:
    e = Engine.ensure()
    yield e
    e.stop()


@pytest.fixture(scope="session")
def built_images(engine: Engine) -> Images:
    """The images, built (or found cached by content) in our engine."""
    return Images.build({**os.environ, "DOCKER_HOST": engine.host})


@pytest.fixture(scope="session")
def kind(engine: Engine) -> Iterator[KindCluster]:
    cluster = KindCluster.up("encoderpool-test", engine, bin_dir())
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="session")
def images(kind: KindCluster, built_images: Images) -> Images:
    """The images as pods name them: pushed to the cluster's registry."""
    return kind.push_images(built_images)


@pytest.fixture(scope="session")
def operator(kind: KindCluster, images: Images) -> str:
    """The chart, installed as users install it, running our operator image."""
    kind.install_operator(images)
    return RELEASE


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A kind test's timeout bounds its own body, not its fixtures: on a cold machine the
    first test's fixtures build the images, make the cluster and push to it, tens of
    minutes that say nothing about the test. Each of those steps carries its own bound
    (``run``'s timeout, ``helm --wait``, ``kubectl``'s)."""
    seconds = float(config.getini("timeout") or 0)
    for item in items:
        if item.get_closest_marker("kind") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(seconds, func_only=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed kind test's report carries the pods, events and logs of every namespace of
    ours (not kube-*), so the failing pod is named and its logs are at hand."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    cluster = getattr(item, "funcargs", {}).get("kind")
    if rep.failed and isinstance(cluster, KindCluster):
        names = cluster.kubectl("get", "ns", "-o", "name", check=False).split()
        ours = [n.split("/", 1)[1] for n in names if not n.startswith("namespace/kube-")]
        rep.sections.append(("kind: pods, events, logs", cluster.diagnose(ours)))

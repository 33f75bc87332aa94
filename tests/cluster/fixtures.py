"""Fixtures for tests on the local control plane (registered in conftest.pytest_plugins).

One control plane per test session (it starts in about 5 s warm); each test
gets its own namespace.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster import LocalCluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """etcd + kube-apiserver + controller-manager + scheduler + kwok on 127.0.0.1."""
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="session")
def kube_client(cluster: LocalCluster) -> Any:
    """A kubernetes.client.ApiClient for the admin user."""
    from kubernetes import config

    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (without waiting)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)

"""Two operator processes on one Lease, on the real control plane: only the holder writes,
and when it is SIGKILLed the other takes over within the lease duration.

Who wrote what: each process logs every write it sends, with its identity and the wall
time (``GuardedKube``, at debug: the processes run with --verbose), so the check is on
the writers' own records. Both processes share the machine's clock, so their write times
compare. The API server's audit log cannot tell them apart (one user for both).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.operator_process import OperatorProcess
from tests.operator.fixtures import get_json, ready_sample_pool
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster

LEASE = "encoderpool-failover"
LEASE_SECONDS, RETRY_SECONDS = 15.0, 2.0  # the defaults (settings.py)
WRITE = re.compile(r"write by (\S+) at (\d+\.\d+): (\w+) (\S+)")
LEADS = re.compile(r"leader election: (\S+) leads")


def writes(op: OperatorProcess) -> list[tuple[float, str, str]]:
    """(wall time, method, path) of each write the process sent but the Lease's."""
    return [(float(t), m, p) for _, t, m, p in WRITE.findall(op.log_text())]


def identity_of(op: OperatorProcess) -> str | None:
    found = LEADS.findall(op.log_text())
    return found[0] if found else None


@pytest.fixture
def replicas(
    cluster: LocalCluster, crd: str, namespace: str, tmp_path: Path
) -> Iterator[list[OperatorProcess]]:
    env = {
        "ENCODERPOOL_LEASE_NAME": LEASE,
        "ENCODERPOOL_LEASE_NAMESPACE": namespace,
        "ENCODERPOOL_RESYNC_SECONDS": "5",
    }
    ops = [
        OperatorProcess(cluster.operator_kubeconfig, tmp_path / f"op{i}.log", namespace, env)
        for i in (0, 1)
    ]
    ops[0].start()
    time.sleep(1)  # the first one creates the Lease: which leads is then known
    ops[1].start()
    yield ops
    for op in ops:
        op.stop()


def test_the_standby_takes_over_within_the_lease_duration_and_never_writes_beside_the_leader(
    cluster: LocalCluster, namespace: str, replicas: list[OperatorProcess]
) -> None:
    def lease() -> dict[str, object]:
        return dict(get_json(cluster, "lease", LEASE, "-n", namespace)["spec"])

    leader, standby = wait_until(
        "one replica to lead",
        lambda: next(
            ((a, b) for a, b in (replicas, replicas[::-1]) if identity_of(a) is not None), None
        ),
    )
    holder = identity_of(leader)
    assert lease()["holderIdentity"] == holder
    ready_sample_pool(cluster, namespace)
    time.sleep(6)  # a resync (5 s) and renewals while both run
    assert writes(leader), leader.log_tail()
    assert writes(standby) == [], standby.log_tail()  # it watched, and wrote nothing
    assert identity_of(standby) is None

    leader.stop(kill=True)
    killed = time.time()
    router = "deployment/tiny-router"
    cluster.kubectl("delete", "-n", namespace, router, "--wait=false")  # for the new leader

    def taken_over() -> str | None:
        got = lease()["holderIdentity"]
        return str(got) if got not in (None, holder) else None

    new_holder = wait_until("the standby to take the lease", taken_over, 3 * LEASE_SECONDS, 0.1)
    took = time.time() - killed
    print(f"\nfailover: the lease changed hands {took:.1f}s after SIGKILL")
    # The standby's clock starts on the last renewal it saw (at most RETRY_SECONDS
    # before the kill, plus its own round of RETRY_SECONDS): never early, never late.
    assert LEASE_SECONDS - 2 * RETRY_SECONDS <= took <= LEASE_SECONDS + 2 * RETRY_SECONDS + 1
    assert new_holder == identity_of(standby)
    assert lease()["leaseTransitions"] == 1

    wait_until("the new leader to restore the router Deployment", lambda: cluster.kubectl(
        "get", "-n", namespace, router, "--ignore-not-found", "-o", "name"
    ).strip())  # fmt: skip
    restored = time.time() - killed
    print(f"failover: the router Deployment was restored {restored:.1f}s after SIGKILL")
    old, new = writes(leader), writes(standby)
    assert new, standby.log_tail()
    assert max(t for t, _, _ in old) < killed < min(t for t, _, _ in new)
    assert any(m == "PATCH" and p.endswith("/deployments/tiny-router") for _, m, p in new)

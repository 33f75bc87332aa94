"""Everything that differs between the two transports, sharedVolume and rdma.

The rest of rendering asks this module and never branches on the transport
itself, so one place says what each transport needs of the pool's objects:

    sharedVolume  the cache PVC (unless an existing claim is named), mounted in
                  every vLLM pod, whose servers report its free space; the router
                  may skip producers for items encoded a moment ago (the entry is
                  still on the volume)
    rdma          pod networks, UCX env, the NIC's extended resource, a sized
                  /dev/shm, IPC_LOCK, the NIXL side-channel port; consumers may
                  reach producers (they READ from them)

The connector classes per transport are the contracts' (``CONNECTOR_CLASSES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from encoderpool_contracts import ADVERTISE_HOST_ENV
from encoderpool_contracts.pod import CACHE_DIR_ENV, VOLUME_METRICS_MIDDLEWARE
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kinds import PERSISTENT_VOLUME_CLAIM
from encoderpool_operator.naming import CACHE, Ref, child_meta, name_of, ref_of
from encoderpool_operator.render.family import Defaults, Family, Inputs

# How long the router trusts that an item a producer encoded is still on the shared
# volume (router flag --reuse-encoded-s).
ROUTER_REUSE_SECONDS = 60


@dataclass(frozen=True)
class VllmPodTransport:
    """What the transport adds to every vLLM pod, producers and consumers alike."""

    annotations: dict[str, str] = field(default_factory=dict)
    env: list[dict[str, Any]] = field(default_factory=list)
    # Added to the container's requests and to its limits (extended resources need both).
    extended_resources: dict[str, str] = field(default_factory=dict)
    shm_size: str | None = None  # the /dev/shm emptyDir's sizeLimit
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    capabilities: tuple[str, ...] = ()  # added to the vllm container's (all else dropped)
    ports: list[dict[str, Any]] = field(default_factory=list)  # after the http port
    middleware: tuple[str, ...] = ()  # `vllm serve --middleware`, after the API guard


def vllm_pod(pool: EncoderPool) -> VllmPodTransport:
    """The transport's additions to a vLLM pod."""
    shared = pool.spec.connector.shared_volume
    if shared is not None:
        claim = shared.existing_claim or name_of(pool, CACHE)
        return VllmPodTransport(
            volumes=[{"name": "ec-cache", "persistentVolumeClaim": {"claimName": claim}}],
            mounts=[{"name": "ec-cache", "mountPath": shared.mount_path}],
            # The volume's free bytes and files on /metrics (alerts: nearly full).
            env=[{"name": CACHE_DIR_ENV, "value": shared.mount_path}],
            middleware=(VOLUME_METRICS_MIDDLEWARE,),
        )
    rdma = pool.spec.connector.rdma
    assert rdma is not None  # exactly one transport (ConnectorSpec validates it)
    annotations = {}
    if rdma.networks:
        annotations["k8s.v1.cni.cncf.io/networks"] = ",".join(rdma.networks)
    env: list[dict[str, Any]] = [
        {"name": "UCX_TLS", "value": rdma.ucx_transports},
        # Producers tell consumers where to READ from: their own pod IP.
        {
            "name": ADVERTISE_HOST_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
    ]
    if rdma.ucx_net_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": rdma.ucx_net_devices})
    return VllmPodTransport(
        annotations=annotations,
        env=env,
        extended_resources=(
            {rdma.resource_name: str(rdma.resource_count)} if rdma.resource_name else {}
        ),
        shm_size=rdma.shm_size or None,
        # Registering memory with an RDMA NIC pins pages: the one capability RDMA needs.
        capabilities=("IPC_LOCK",) if rdma.ipc_lock else (),
        ports=[{"name": "nixl", "containerPort": rdma.side_channel_port, "protocol": "TCP"}],
    )


def cache_claim(pool: EncoderPool) -> dict[str, Any] | None:
    """The ReadWriteMany PVC every vLLM pod mounts; None with an existing claim or rdma."""
    shared = pool.spec.connector.shared_volume
    if shared is None or shared.existing_claim or shared.size is None:
        return None
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": shared.size}},
    }
    if shared.storage_class_name:
        spec["storageClassName"] = shared.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": child_meta(pool, name_of(pool, CACHE), CACHE),
        "spec": spec,
    }


def consumers_reach_producers(pool: EncoderPool) -> bool:
    """rdma: consumers READ from producers, over the side channel and UCX, whose ports
    are ephemeral (so the producers' NetworkPolicy lets consumers in on any port)."""
    return pool.spec.connector.rdma is not None


def router_reuse_encoded_s(pool: EncoderPool) -> int | None:
    """sharedVolume: a file stays on the volume after a producer wrote it, so repeats of
    a recently encoded item can skip the producer's round trip (~12 ms on a CPU); an
    entry evicted meanwhile is only a miss: the consumer encodes. Not for rdma:
    consumers need the producer's transfer coordinates."""
    return ROUTER_REUSE_SECONDS if pool.spec.connector.shared_volume else None


def _claims(pool: EncoderPool, _: Inputs | None = None) -> list[dict[str, Any]]:
    claim = cache_claim(pool)
    return [claim] if claim is not None else []


def _claim_refs(pool: EncoderPool, _: Defaults | None, __: frozenset[str]) -> list[Ref]:
    return [ref_of(c) for c in _claims(pool)]


FAMILY = Family("transport", (PERSISTENT_VOLUME_CLAIM,), _claims, _claim_refs)

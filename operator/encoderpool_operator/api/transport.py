"""``spec.connector``: how embeddings travel from producers to consumers.

Exactly one transport: ``sharedVolume`` (files on a ReadWriteMany volume) or
``rdma`` (NIXL over UCX); each turns into the connector's settings
(``ConnectorConfig``) here, beside the fields it comes from.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from encoderpool_contracts import RdmaSettings, SharedVolumeSettings
from encoderpool_operator.api.quantity import ByteRange, Quantity, quantity_bytes
from encoderpool_operator.api.schema import (
    DNS_SUBDOMAIN_PATTERN,
    DOT_SEGMENT_PATTERN,
    ApiModel,
    Rule,
)

DEFAULT_MOUNT_PATH = "/var/cache/encoderpool"
DEFAULT_UCX_TRANSPORTS = "rc,sm,self"
# A Multus network: `name`, `namespace/name`, optionally `@interface`.
NETWORK_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(@[A-Za-z0-9_.-]{1,15})?$"
)


def _capacity_fits(volume: SharedVolumeSpec) -> bool:
    if volume.capacity is None or volume.size is None:
        return True
    return quantity_bytes(volume.capacity) <= quantity_bytes(volume.size)


def _clean_mount_path(path: str) -> bool:
    """No '.' or '..' segment and no empty one ('//'): the path says where it mounts."""
    return not re.search(DOT_SEGMENT_PATTERN, path) and "//" not in path


class SharedVolumeSpec(ApiModel):
    """A filesystem every producer and consumer mounts; embeddings are files on it."""

    rules: ClassVar[tuple[Rule[SharedVolumeSpec], ...]] = (
        Rule(
            "",
            cel="has(self.size) != has(self.existingClaim)",
            check=lambda v: (v.size is None) != (v.existing_claim is None),
            message="set exactly one of size (the operator creates a ReadWriteMany PVC of "
            "that size) or existingClaim (a PVC you created)",
        ),
        Rule(
            "",
            cel="!has(self.storageClassName) || has(self.size)",
            check=lambda v: v.storage_class_name is None or v.size is not None,
            message="storageClassName applies only to a new claim: remove it, or use size "
            "instead of existingClaim",
        ),
        Rule(
            "",
            cel="has(self.capacity) || has(self.size)",
            check=lambda v: v.capacity is not None or v.size is not None,
            message="capacity is required with existingClaim: the operator cannot tell the "
            "claim's size",
        ),
        Rule(
            ".capacity",
            cel="!has(self.capacity) || !has(self.size) || "
            "quantity(string(self.capacity)).compareTo(quantity(string(self.size))) <= 0",
            check=_capacity_fits,
            message="capacity must not exceed size: lower capacity or grow size",
        ),
        Rule(
            ".mountPath",
            cel=f"!self.mountPath.matches('{DOT_SEGMENT_PATTERN}') && "
            "!self.mountPath.contains('//')",
            check=lambda v: _clean_mount_path(v.mount_path),
            message="mountPath must be a clean absolute path: no '.' or '..' segments, no '//'",
        ),
        # Transition rules: only the API server holds the stored object to compare with.
        Rule(
            ".size",
            cel="!has(self.size) || !has(oldSelf.size) || "
            "quantity(string(self.size)).compareTo(quantity(string(oldSelf.size))) >= 0",
            check=None,
            message="size cannot shrink (a PVC can only grow): keep it or raise it",
        ),
        Rule(
            "",
            cel="!has(self.size) || !has(oldSelf.size) || "
            "(has(self.storageClassName) ? self.storageClassName : '') == "
            "(has(oldSelf.storageClassName) ? oldSelf.storageClassName : '')",
            check=None,
            message="storageClassName cannot change (a PVC keeps its storage class): restore "
            "it, or use a new pool",
        ),
    )

    size: Annotated[Quantity, ByteRange(1 << 20, 1 << 50)] | None = Field(
        default=None,
        description="Size of a new ReadWriteMany PVC the operator creates for the pool, "
        "e.g. 200Gi. It can grow (if the storage class allows expansion), never shrink.",
    )
    storage_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Storage class of the new PVC; it must offer ReadWriteMany and cannot "
        "change. Default: the cluster's default class.",
    )
    existing_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Name of a ReadWriteMany PVC in the pool's namespace to use instead "
        "of a new one.",
    )
    mount_path: str = Field(
        default=DEFAULT_MOUNT_PATH,
        min_length=2,
        max_length=256,
        pattern=r"^/[^\s]*[^/\s]$",
        description="Where the volume is mounted in the pods (an absolute path); the cache "
        "lives there.",
    )
    capacity: Annotated[Quantity, ByteRange(1 << 20, 1 << 50)] | None = Field(
        default=None,
        description="Most bytes the cache keeps before evicting, e.g. 180Gi; at most size. "
        "Default with size: 90% of size. Required with existingClaim.",
    )
    eviction: Literal["lru", "fifo"] = Field(
        default="lru",
        description="lru (the default) evicts the least recently loaded entry; fifo the "
        "oldest written.",
    )

    def capacity_bytes(self) -> int:
        """The cache bound: capacity, else 90% of a new claim's size (room for temp files)."""
        if self.capacity is not None:
            return quantity_bytes(self.capacity)
        assert self.size is not None, "validated: capacity or size is set"
        return quantity_bytes(self.size) * 9 // 10

    def settings(self) -> SharedVolumeSettings:
        """What the connector reads (ConnectorConfig.shared_volume)."""
        return SharedVolumeSettings(
            root=self.mount_path, capacity_bytes=self.capacity_bytes(), eviction=self.eviction
        )


# UCX_TLS values that let UCX cross nodes without an RDMA device: tcp, all, or an
# exclusion list (^x: every transport but x, tcp included).
CROSSES_NODES_PATTERN = r"(^|,)(tcp|all)(,|$)"


def _shm_fits(rdma: RdmaSpec) -> bool:
    if rdma.shm_size is None:
        return True
    return quantity_bytes(rdma.shm_size) >= quantity_bytes(rdma.buffer_size)


def _reaches_other_nodes(rdma: RdmaSpec) -> bool:
    return bool(
        rdma.resource_name
        or rdma.networks
        or rdma.ucx_transports.startswith("^")
        or re.search(CROSSES_NODES_PATTERN, rdma.ucx_transports)
    )


class RdmaSpec(ApiModel):
    """NIXL over UCX: producers keep embeddings in registered memory, consumers READ them.

    ``rdma: {}`` would render UCX_TLS=rc,sm,self with no device: pods start, but
    every read across nodes fails, and consumers silently encode everything
    themselves. Refused at admission with what to set instead.
    """

    rules: ClassVar[tuple[Rule[RdmaSpec], ...]] = (
        Rule(
            ".shmSize",
            cel="!has(self.shmSize) || !has(self.bufferSize) || "
            "quantity(string(self.shmSize)).compareTo(quantity(string(self.bufferSize))) >= 0",
            check=_shm_fits,
            message="shmSize must be at least bufferSize: the registered buffer lives in "
            "/dev/shm; raise shmSize or lower bufferSize",
        ),
        Rule(
            ".ucxTransports",
            cel="has(self.resourceName) || (has(self.networks) && size(self.networks) > 0) || "
            "(has(self.ucxTransports) && (self.ucxTransports.startsWith('^') || "
            f"self.ucxTransports.matches('{CROSSES_NODES_PATTERN}')))",
            check=_reaches_other_nodes,
            message="ucxTransports lists no transport that reaches another node without an "
            "RDMA device (rc, ud, dc, ... need one; sm, self, cma stay on the node), and "
            "neither resourceName nor networks gives the pods one: set resourceName (your "
            "RDMA device plugin's resource, e.g. rdma/hca), or networks (a Multus network "
            "with an RDMA NIC), or add tcp to ucxTransports (e.g. tcp,sm,self) where there "
            "is no RDMA NIC",
        ),
    )

    resource_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="Extended resource of the RDMA device plugin to request (requests and "
        "limits), e.g. rdma/hca or nvidia.com/hostdev. Omit where UCX uses TCP or shared "
        "memory.",
    )
    resource_count: int = Field(
        default=1, ge=1, le=16, description="How many of resourceName each pod requests."
    )
    networks: tuple[Annotated[str, Field(max_length=253, pattern=NETWORK_PATTERN)], ...] = Field(
        default=(),
        max_length=8,
        description="Multus NetworkAttachmentDefinitions to attach (name, namespace/name, "
        "optionally @interface); rendered into the k8s.v1.cni.cncf.io/networks annotation.",
    )
    ucx_transports: str = Field(
        default=DEFAULT_UCX_TRANSPORTS,
        min_length=1,
        max_length=256,
        pattern=r"^\^?[a-z0-9_]+(,[a-z0-9_]+)*$",
        description="UCX_TLS: UCX transports in order, e.g. rc,sm,self (verbs, the default) "
        "or tcp,sm,self; ^x means every transport but x.",
    )
    ucx_net_devices: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$",
        description="UCX_NET_DEVICES, e.g. mlx5_0:1; default: UCX picks.",
    )
    side_channel_port: int = Field(
        default=5600,
        ge=1024,
        le=65535,
        description="TCP port of the producers' NIXL metadata side channel.",
    )
    ipc_lock: bool = Field(
        default=True,
        description="Add the IPC_LOCK capability so UCX can pin registered memory.",
    )
    shm_size: Annotated[Quantity, ByteRange(1 << 20, 1 << 40)] | None = Field(
        default=None,
        description="Size limit of the pods' memory-backed /dev/shm, which holds the "
        "registered buffer (at least bufferSize) and UCX's shared-memory segments, e.g. 8Gi; "
        "default: no limit but the container's memory limit.",
    )
    buffer_size: Annotated[Quantity, ByteRange(1 << 20, 1 << 40)] = Field(
        default="1Gi",
        description="Registered host memory per producer that holds embeddings until "
        "consumers read them. Count it in the producer's memory request.",
    )

    def settings(self) -> RdmaSettings:
        """What the connector reads (ConnectorConfig.rdma)."""
        return RdmaSettings(
            side_channel_port=self.side_channel_port,
            buffer_bytes=quantity_bytes(self.buffer_size),
        )


class ConnectorSpec(ApiModel):
    """How embeddings travel from producers to consumers: exactly one transport."""

    rules: ClassVar[tuple[Rule[ConnectorSpec], ...]] = (
        Rule(
            "",
            cel="has(self.sharedVolume) != has(self.rdma)",
            check=lambda c: (c.shared_volume is None) != (c.rdma is None),
            message="set exactly one of sharedVolume (a ReadWriteMany volume) or rdma (NIXL "
            "over UCX)",
        ),
    )

    shared_volume: SharedVolumeSpec | None = Field(
        default=None, description="Embeddings as files on a ReadWriteMany volume."
    )
    rdma: RdmaSpec | None = Field(
        default=None, description="Embeddings read over RDMA (NIXL with UCX)."
    )

    @property
    def transport(self) -> Literal["sharedVolume", "rdma"]:
        """The transport's name as ConnectorConfig and status.transport spell it."""
        return "sharedVolume" if self.shared_volume is not None else "rdma"

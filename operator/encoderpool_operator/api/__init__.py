"""The ``EncoderPool`` API (encoderpool.io/v1alpha1), one module per concern.

    schema        base model, validation rules (CEL and check in one Rule), small
                  field types and references several parts share
    quantity      Kubernetes quantities: field type, exact parsing, byte ranges
    spec          EncoderPool.spec (what users write): the root and the rules that
                  span its parts, which are
      model         spec.model
      roles         spec.producer, spec.consumer, spec.producerGroups
      pod_template  a role's podTemplate: what a pool owner may add to its pods
      autoscaling   a role's autoscaling
      transport     spec.connector (sharedVolume or rdma)
      network       spec.networkPolicy
      router        spec.router
      widths        spec.widthJob
    status        EncoderPool.status and its conditions (what the operator writes)
    pool          the whole object: names (group, kind, plural), metadata rules, parsing

These models are the contract between users and the operator: the CRD's
openAPIV3Schema is generated from them (``encoderpool_codegen.crd``). No kopf
and no Kubernetes client here: the reconcile, tests and tools import it. This
package exports the names callers use, so ``from encoderpool_operator.api
import EncoderPool`` does not depend on which module defines what.
"""

from encoderpool_operator.api.model import (
    HUB_TOKEN_ENV,
    MODEL_MOUNT_ROOT,
    RESERVED_ENV,
    EnvVar,
    HubToken,
    ModelSource,
    ModelSpec,
    PersistentVolumeClaimSource,
)
from encoderpool_operator.api.network import NetworkPeer, NetworkPolicySpec
from encoderpool_operator.api.pool import (
    API_VERSION,
    CRD_NAME,
    GROUP,
    KIND,
    MAX_NAME_LENGTH,
    METADATA_NAME_RULE,
    NAME_PATTERN,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    EncoderPool,
    format_errors,
)
from encoderpool_operator.api.quantity import (
    QUANTITY_PATTERN,
    ByteRange,
    Quantity,
    parse_quantity,
    quantity_bytes,
)
from encoderpool_operator.api.roles import (
    ProducerGroup,
    ResourceRequirements,
    RoleSpec,
    RolloutSpec,
    Toleration,
)
from encoderpool_operator.api.router import RouterAuth, RouterSpec
from encoderpool_operator.api.schema import ApiModel, LocalObjectReference, Rule, cel
from encoderpool_operator.api.spec import EncoderPoolSpec
from encoderpool_operator.api.status import (
    CHILDREN_OWNED,
    CONDITION_TYPES,
    CONSUMERS_AVAILABLE,
    MAX_GENERATION,
    PRODUCERS_AVAILABLE,
    READY,
    RECONCILING,
    ROUTER_AVAILABLE,
    STALLED,
    WIDTHS_MEASURED,
    AutoscalerStatus,
    Condition,
    ConditionUpdate,
    EncoderPoolStatus,
    ProducerGroupStatus,
    ReplicaStatus,
)
from encoderpool_operator.api.transport import (
    DEFAULT_MOUNT_PATH,
    DEFAULT_UCX_TRANSPORTS,
    ConnectorSpec,
    RdmaSpec,
    SharedVolumeSpec,
)
from encoderpool_operator.api.widths import WidthJobSpec

__all__ = [
    "API_VERSION",
    "CHILDREN_OWNED",
    "CONDITION_TYPES",
    "CONSUMERS_AVAILABLE",
    "CRD_NAME",
    "DEFAULT_MOUNT_PATH",
    "DEFAULT_UCX_TRANSPORTS",
    "GROUP",
    "HUB_TOKEN_ENV",
    "KIND",
    "MAX_GENERATION",
    "MAX_NAME_LENGTH",
    "METADATA_NAME_RULE",
    "MODEL_MOUNT_ROOT",
    "NAME_PATTERN",
    "PLURAL",
    "PRODUCERS_AVAILABLE",
    "QUANTITY_PATTERN",
    "READY",
    "RECONCILING",
    "RESERVED_ENV",
    "ROUTER_AVAILABLE",
    "SHORT_NAMES",
    "SINGULAR",
    "STALLED",
    "VERSION",
    "WIDTHS_MEASURED",
    "ApiModel",
    "AutoscalerStatus",
    "ByteRange",
    "Condition",
    "ConditionUpdate",
    "ConnectorSpec",
    "EncoderPool",
    "EncoderPoolSpec",
    "EncoderPoolStatus",
    "EnvVar",
    "HubToken",
    "LocalObjectReference",
    "ModelSource",
    "ModelSpec",
    "NetworkPeer",
    "NetworkPolicySpec",
    "PersistentVolumeClaimSource",
    "ProducerGroup",
    "ProducerGroupStatus",
    "Quantity",
    "RdmaSpec",
    "ReplicaStatus",
    "ResourceRequirements",
    "RoleSpec",
    "RolloutSpec",
    "RouterAuth",
    "RouterSpec",
    "Rule",
    "SharedVolumeSpec",
    "Toleration",
    "WidthJobSpec",
    "cel",
    "format_errors",
    "parse_quantity",
    "quantity_bytes",
]

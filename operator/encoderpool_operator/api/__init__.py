"""The ``EncoderPool`` API (encoderpool.io/v1alpha1), one module per concern.

    schema    base model, CEL rule helpers, small field types
    quantity  Kubernetes quantities: field type, exact parsing, byte ranges
    spec      EncoderPool.spec (what users write)
    status    EncoderPool.status and its conditions (what the operator writes)
    pool      the whole object: names (group, kind, plural), metadata rules, parsing

These models are the contract between users and the operator: the CRD's
openAPIV3Schema is generated from them (``encoderpool_codegen.crd``). No kopf
and no Kubernetes client here: the reconcile, tests and tools import it. This
package exports the names callers use, so ``from encoderpool_operator.api
import EncoderPool`` does not depend on which module defines what.
"""

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
from encoderpool_operator.api.schema import ApiModel, cel
from encoderpool_operator.api.spec import (
    DEFAULT_MOUNT_PATH,
    DEFAULT_UCX_TRANSPORTS,
    HUB_TOKEN_ENV,
    MODEL_MOUNT_ROOT,
    RESERVED_ENV,
    VLLM_API_KEY_ENV,
    ConnectorSpec,
    EncoderPoolSpec,
    EnvVar,
    HubToken,
    LocalObjectReference,
    ModelSource,
    ModelSpec,
    NetworkPeer,
    NetworkPolicySpec,
    PersistentVolumeClaimSource,
    RdmaSpec,
    ResourceRequirements,
    RoleSpec,
    RolloutSpec,
    RouterAuth,
    RouterSpec,
    SharedVolumeSpec,
    Toleration,
    WidthJobSpec,
)
from encoderpool_operator.api.status import (
    CHILDREN_OWNED,
    CONDITION_TYPES,
    CONSUMERS_AVAILABLE,
    MAX_GENERATION,
    PRODUCERS_AVAILABLE,
    READY,
    ROUTER_AVAILABLE,
    WIDTHS_MEASURED,
    Condition,
    ConditionUpdate,
    EncoderPoolStatus,
    ReplicaStatus,
)

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
    "RESERVED_ENV",
    "ROUTER_AVAILABLE",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "VLLM_API_KEY_ENV",
    "WIDTHS_MEASURED",
    "ApiModel",
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
    "Quantity",
    "RdmaSpec",
    "ReplicaStatus",
    "ResourceRequirements",
    "RoleSpec",
    "RolloutSpec",
    "RouterAuth",
    "RouterSpec",
    "SharedVolumeSpec",
    "Toleration",
    "WidthJobSpec",
    "cel",
    "format_errors",
    "parse_quantity",
    "quantity_bytes",
]

"""Every format encoderpool's parts share: config, width report, identity, announcement, dtypes,
and the names of the per-pool keys pods get (``keys``).

The operator renders ``ConnectorConfig`` and reads ``WidthReport``; the width
Job writes the report; the connector parses the config; producer, router and
consumer speak ``Announcement``. Imports pydantic only (never torch, vLLM or a
Kubernetes client), so the operator and the router import it freely.
"""

from encoderpool_contracts.announcement import (
    ANNOUNCE_KEY,
    EC_TRANSFER_PARAMS,
    Announcement,
    announce,
    raw_announcement,
)
from encoderpool_contracts.config import (
    ConnectorConfig,
    RdmaSettings,
    SharedVolumeSettings,
)
from encoderpool_contracts.dtypes import DTYPE_BYTES, Dtype, dtype_name, payload_bytes
from encoderpool_contracts.identity import ModelIdentity, identity_from_vllm_config
from encoderpool_contracts.keys import CHANNEL_KEY_ENV
from encoderpool_contracts.pod import ADVERTISE_HOST_ENV, API_GUARD_MIDDLEWARE, VLLM_API_KEY_ENV
from encoderpool_contracts.report import (
    COMPONENT,
    CONFIGMAP_KEY,
    CONFIGMAP_PREFIX,
    LABEL_COMPONENT,
    LABEL_FINGERPRINT,
    MAX_ENCODE_SECONDS,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    TERMINATION_MESSAGE_LIMIT,
    WIDTH_MISMATCH,
    WidthMismatch,
    WidthReport,
    configmap_name,
)

__all__ = [
    "ADVERTISE_HOST_ENV",
    "ANNOUNCE_KEY",
    "API_GUARD_MIDDLEWARE",
    "CHANNEL_KEY_ENV",
    "COMPONENT",
    "CONFIGMAP_KEY",
    "CONFIGMAP_PREFIX",
    "DTYPE_BYTES",
    "EC_TRANSFER_PARAMS",
    "LABEL_COMPONENT",
    "LABEL_FINGERPRINT",
    "MAX_ENCODE_SECONDS",
    "TERMINATION_LOG",
    "TERMINATION_LOG_ENV",
    "TERMINATION_MESSAGE_LIMIT",
    "VLLM_API_KEY_ENV",
    "WIDTH_MISMATCH",
    "Announcement",
    "ConnectorConfig",
    "Dtype",
    "ModelIdentity",
    "RdmaSettings",
    "SharedVolumeSettings",
    "WidthMismatch",
    "WidthReport",
    "announce",
    "configmap_name",
    "dtype_name",
    "identity_from_vllm_config",
    "payload_bytes",
    "raw_announcement",
]

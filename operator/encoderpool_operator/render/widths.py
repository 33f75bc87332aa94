"""The width Job and the report ConfigMap it leads to, and the key reports are shared by.

The Job measures the model's encoder output widths; the operator stores what it
reported in a ConfigMap named by ``report_key``, which every pool with the same
key shares (reconcile/widths.py decides when to measure and what to trust).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

from encoderpool_contracts import (
    CONFIGMAP_KEY,
    LABEL_FINGERPRINT,
    TERMINATION_LOG,
    ModelIdentity,
    configmap_name,
)
from encoderpool_contracts.pod import MEASURE_MODULE
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.kinds import CONFIG_MAP, JOB, POD
from encoderpool_operator.naming import (
    ANNOTATION_REPORT_DIGEST,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_REPORT_KEY,
    MANAGED_BY,
    REPORT_COMPONENT,
    WIDTH_JOB,
    child_meta,
    config_hash,
    labels,
    report_owner_reference,
    width_job_name,
)
from encoderpool_operator.render.family import Family
from encoderpool_operator.render.pod import (
    RESTRICTED_CONTAINER,
    RESTRICTED_POD,
    SHM_PATH,
    hash_seed,
    model_env,
    model_volume,
    pull_secrets,
    resources,
    scheduling,
)

MEASURE_CONTAINER = "measure"
# Where the width Job's container leaves its report; the kubelet keeps it in the pod's status.
# Env the width Job's vLLM, Hugging Face hub and transformers read (what model files are
# fetched, how they load): part of the report key. Other names (labels for logs, a team
# name) would re-measure the model for nothing.
_MEASURED_ENV = ("VLLM_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_")


def report_key(pool: EncoderPool) -> str:
    """The key width reports are stored and shared under (16 hex chars): the model
    fingerprint plus everything else that can change what the width Job measures, its
    image and arguments (extra args that reach it included), the model's files and the
    env vLLM and the hub read (``_MEASURED_ENV``).

    The fingerprint alone stays what cache entries carry: a serving pod computes it
    from vLLM's config, which knows nothing of the Job. A report is shared by every
    pool with the same key, so a pool that measures in another image or with other
    arguments never reads a report measured otherwise (nor is wedged by one).
    """
    spec = pool.spec
    identity = spec.model_identity(spec.image)
    source = spec.model.source
    return config_hash(
        {
            "fingerprint": identity.fingerprint(),
            "image": spec.width_job.image or spec.image,
            "args": measure_args(identity, spec.model.extra_args),
            "env": [[e.name, e.value] for e in spec.model.env if e.name.startswith(_MEASURED_ENV)],
            "source": source.model_dump(mode="json") if source is not None else None,
        }
    )


def report_digest(key: str, data: Mapping[str, str]) -> str:
    """What ANNOTATION_REPORT_DIGEST holds: the stored report bound to its key.

    Not a secret (anyone who may write the ConfigMap can compute it): it tells a
    report this operator stored from one made or edited by hand, which the operator
    then never uses, patches or adopts.
    """
    text = data.get(CONFIGMAP_KEY, "")
    return hashlib.sha256(f"{key}\n{text}".encode()).hexdigest()[:32]


def width_report_configmap(
    pool: EncoderPool, key: str, fingerprint: str, data: dict[str, str] | None = None
) -> dict[str, Any]:
    """The report's ConfigMap, written by the operator from what the width Job reported.

    It is not controlled by one pool: every pool that uses the report adds
    itself as an owner, and the garbage collector removes it with the last. Its
    labels and, with data, its digest are how a pass tells it from a foreign one.
    """
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(key),
            "namespace": pool.namespace,
            "labels": {
                "app.kubernetes.io/name": "encoderpool",
                LABEL_COMPONENT: REPORT_COMPONENT,
                LABEL_MANAGED_BY: MANAGED_BY,
                LABEL_FINGERPRINT: fingerprint,
                LABEL_REPORT_KEY: key,
            },
            "ownerReferences": [report_owner_reference(pool)],
        },
    }
    if data is not None:
        obj["data"] = dict(data)
        obj["metadata"]["annotations"] = {ANNOTATION_REPORT_DIGEST: report_digest(key, data)}
    return obj


def measure_args(identity: ModelIdentity, extra_args: tuple[str, ...]) -> list[str]:
    """What the width Job runs: measure this identity, leave the report as termination message."""
    args = [
        "-m", MEASURE_MODULE,
        "--identity", identity.model_dump_json(),
        "--output-file", TERMINATION_LOG,
    ]  # fmt: skip
    for flag in ("--max-model-len", "--trust-remote-code"):  # what loading the model needs
        for i, arg in enumerate(extra_args):
            if arg == flag and flag == "--trust-remote-code":
                args.append(flag)
            elif arg == flag and i + 1 < len(extra_args):
                args += [flag, extra_args[i + 1]]
            elif arg.startswith(flag + "="):
                args.append(arg)
    return args


def width_job(pool: EncoderPool, identity: ModelIdentity, key: str) -> dict[str, Any]:
    """The Job measuring ``identity``: no API credentials, its report is its termination message.

    The kubelet keeps what ``measure`` writes to ``TERMINATION_LOG`` (up to 4096
    bytes) in the pod's status, where the operator reads it; so the Job needs
    no ServiceAccount token, Role or ConfigMap of its own.
    """
    spec = pool.spec
    job = spec.width_job
    name = width_job_name(pool, key)
    container_resources = resources(job.resources) or resources(spec.producer.resources)
    model_volumes, model_mounts = model_volume(pool)
    container: dict[str, Any] = {
        "name": MEASURE_CONTAINER,
        "image": job.image or spec.image,
        "command": ["python"],
        "args": measure_args(identity, spec.model.extra_args),
        "env": [
            *model_env(pool),
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            {"name": "HOME", "value": "/home/vllm"},
            # It measures as a TP producer does (see hash_seed).
            *(
                [{"name": "PYTHONHASHSEED", "value": hash_seed(pool)}]
                if identity.tensor_parallel_size > 1
                else []
            ),
        ],
        "volumeMounts": [
            {"name": "dshm", "mountPath": SHM_PATH},
            {"name": "home", "mountPath": "/home/vllm"},
            *model_mounts,
        ],
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER),
        "terminationMessagePath": TERMINATION_LOG,
        # The message is the report: never the log tail instead (that is not a report).
        "terminationMessagePolicy": "File",
    }
    if container_resources:
        container["resources"] = container_resources
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # measuring needs no API access
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "home", "emptyDir": {}},
            *model_volumes,
        ],
        "securityContext": copy.deepcopy(RESTRICTED_POD),
        "enableServiceLinks": False,
    }
    pod_spec.update(scheduling(spec.producer))  # it runs the encoder, as producers do
    pod_spec.update(pull_secrets(pool))
    job_labels = {
        **labels(pool, WIDTH_JOB),
        LABEL_FINGERPRINT: identity.fingerprint(),
        LABEL_REPORT_KEY: key,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**child_meta(pool, name, WIDTH_JOB), "labels": job_labels},
        "spec": {
            "backoffLimit": job.backoff_limit,
            "activeDeadlineSeconds": job.active_deadline_seconds,
            "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
        },
    }


# The Job, the report it leads to, and the Job's pods (read for its termination message).
FAMILY = Family("widths", (JOB, CONFIG_MAP, POD), rendered_by="reconcile/widths.py")

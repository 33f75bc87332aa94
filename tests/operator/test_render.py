"""Rendering is pure, and what it renders parses on the other side of each contract:
vLLM's ECTransferConfig and our ConnectorConfig (the vLLM pods), the router's
flags (the router pod)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from encoderpool_contracts import ConnectorConfig
from encoderpool_contracts.pod import (
    HTTP_PORT,
    MEASURE_MODULE,
    ROUTER_METRICS_PORT,
    ROUTER_PROBE_PORT,
)
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.naming import ANNOTATION_CONFIG_HASH, PRODUCER, selector_labels
from encoderpool_operator.render.pod import hash_seed
from encoderpool_operator.render.router import ROUTER_RESOURCES, router_services
from encoderpool_operator.render.secret import internal_secret
from encoderpool_operator.render.transport import ROUTER_REUSE_SECONDS
from encoderpool_operator.render.vllm import vllm_deployment
from encoderpool_operator.render.widths import MEASURE_CONTAINER, width_job
from encoderpool_router.config import parse_settings
from tests.operator.fixtures import (
    children,
    container,
    flag,
    grouped,
    load,
)


@pytest.mark.parametrize("example", ["pool-shared-volume.yaml", "pool-rdma.yaml"])
def test_ec_transfer_config_parses_as_vllm_and_connector_config(example: str) -> None:
    from vllm.config import ECTransferConfig

    objs = children(load(example))
    configs = {}
    for role in ("producer", "consumer"):
        raw = json.loads(flag(container(objs, f"pool-{role}")["args"], "--ec-transfer-config"))
        vllm_config = ECTransferConfig(**raw)
        assert vllm_config.ec_role == f"ec_{role}"
        assert vllm_config.ec_connector_module_path is not None
        configs[role] = ConnectorConfig.from_extra_config(vllm_config.ec_connector_extra_config)
    assert configs["producer"] == configs["consumer"]  # the same config for both roles
    assert configs["producer"].encoder_output_widths == {"image": 128}


def test_the_router_accepts_the_flags_it_is_given() -> None:
    objs = children(load("pool-shared-volume.yaml"))
    c = container(objs, "pool-router")
    assert c["command"] == ["python", "-m", "encoderpool_router"]
    settings = parse_settings(c["args"])
    assert settings.producer_service == "pool-producer"
    assert settings.consumer_service == "pool-consumer"
    assert settings.namespace == "ml"
    assert settings.reuse_encoded_s == ROUTER_REUSE_SECONDS  # shared volume only
    rdma = container(children(load("pool-rdma.yaml")), "pool-router")
    assert parse_settings(rdma["args"]).reuse_encoded_s == 0


def test_the_router_gets_media_affinity_only_when_the_pool_asks() -> None:
    pool = load("pool-shared-volume.yaml")
    default = container(children(pool), "pool-router")["args"]
    assert "--consumer-policy" not in default
    assert parse_settings(default).consumer_policy == "least-busy"
    raw = pool.model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["router"]["consumerPolicy"] = "MediaAffinity"
    affine = EncoderPool.from_object({**raw, "metadata": pool.metadata})
    args = container(children(affine), "pool-router")["args"]
    assert parse_settings(args).consumer_policy == "media-affinity"


def test_request_media_kwargs_are_trusted_by_the_router_and_vllm_together() -> None:
    """The router refuses them unless told otherwise, and vLLM refuses them unless run
    with --trust-request-mm-kwargs: one setting turns both, so they never disagree."""
    pool = load("pool-shared-volume.yaml")
    objs = children(pool)
    assert not parse_settings(container(objs, "pool-router")["args"]).trust_request_mm_kwargs
    for role in ("pool-producer", "pool-consumer"):
        assert "--trust-request-mm-kwargs" not in container(objs, role)["args"]
    raw = pool.model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["router"]["trustRequestMmKwargs"] = True
    trusted = children(EncoderPool.from_object({**raw, "metadata": pool.metadata}))
    assert parse_settings(container(trusted, "pool-router")["args"]).trust_request_mm_kwargs
    for role in ("pool-producer", "pool-consumer"):
        assert "--trust-request-mm-kwargs" in container(trusted, role)["args"]


def test_rendering_is_pure_and_changes_only_with_its_inputs() -> None:
    pool = load("pool-shared-volume.yaml")
    before = children(pool)
    assert children(pool) == before
    wider = children(pool, width=256)  # a new measurement changes the pods' config
    assert container(wider, "pool-consumer")["args"] != container(before, "pool-consumer")["args"]
    raw = pool.model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["consumer"]["replicas"] = 5
    after = children(EncoderPool.from_object({**raw, "metadata": pool.metadata}))
    consumer_before, consumer_after = (
        before["Deployment/pool-consumer"]["spec"],
        after["Deployment/pool-consumer"]["spec"],
    )
    assert consumer_after["replicas"] == 5
    assert consumer_after["template"] == consumer_before["template"]  # scaling rolls nothing


def test_pods_run_restricted_and_rdma_adds_only_ipc_lock() -> None:
    for example in ("pool-shared-volume.yaml", "pool-rdma.yaml"):
        objs = children(load(example))
        for name, obj in objs.items():
            if not name.startswith("Deployment/"):
                continue
            pod = obj["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            for c in pod["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert sc["capabilities"].get("add", []) in ([], ["IPC_LOCK"])
    rdma = children(load("pool-rdma.yaml"))
    producer = container(rdma, "pool-producer")
    assert producer["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    env = {e["name"]: e for e in producer["env"]}
    assert "UCX_TLS" in env
    assert env["ENCODERPOOL_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_width_job_has_no_api_access_and_reports_through_its_termination_message() -> None:
    pool = load("pool-shared-volume.yaml")
    identity = pool.spec.model_identity(pool.spec.image)
    job = width_job(pool, identity, identity.fingerprint())
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod  # no ServiceAccount, Role or RoleBinding of its own
    (c,) = pod["containers"]
    assert c["name"] == MEASURE_CONTAINER
    assert c["terminationMessagePath"] == "/dev/termination-log"
    assert c["terminationMessagePolicy"] == "File"  # the report, never a log tail
    assert c["args"][c["args"].index("--output-file") + 1] == "/dev/termination-log"


def test_pod_template_overrides_merge_over_the_rendered_pod() -> None:
    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["producer"]["podTemplate"] = {
        "metadata": {"annotations": {"team": "vision"}},
        "spec": {"priorityClassName": "high"},
    }
    pool = EncoderPool.from_object(
        {**raw, "metadata": {"name": "pool", "namespace": "ml", "uid": "u"}}
    )
    template = children(pool)["Deployment/pool-producer"]["spec"]["template"]
    assert template["spec"]["priorityClassName"] == "high"
    assert template["metadata"]["annotations"]["team"] == "vision"
    assert ANNOTATION_CONFIG_HASH in template["metadata"]["annotations"]
    assert template["spec"]["containers"][0]["name"] == "vllm"


def test_the_width_job_command_parses_as_measure_and_keys_the_report() -> None:
    parse_args = importlib.import_module(MEASURE_MODULE).parse_args

    pool = load("pool-shared-volume.yaml")
    identity = pool.spec.model_identity(pool.spec.image)
    job = width_job(pool, identity, identity.fingerprint())
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python"]
    assert c["args"][:2] == ["-m", MEASURE_MODULE]
    args = parse_args(c["args"][2:])
    assert args.identity == identity
    assert args.identity.fingerprint() == identity.fingerprint()
    assert args.model == pool.spec.model.path()
    assert args.max_model_len == 2048  # carried over from spec.model.extraArgs
    assert args.output_file == Path("/dev/termination-log")


def test_tensor_parallel_roles_and_a_width_job_with_the_producers_parallelism() -> None:
    """Each role's Deployment runs its own --tensor-parallel-size; the width Job measures
    with the producers' (the identity the pool is keyed by) on the producers' resources."""
    parse_args = importlib.import_module(MEASURE_MODULE).parse_args

    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["producer"].update(
        tensorParallelSize=2, resources={"limits": {"nvidia.com/gpu": "2"}}
    )
    raw["spec"]["consumer"].update(tensorParallelSize=4)
    pool = EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})
    objs = children(pool)
    assert flag(container(objs, "pool-producer")["args"], "--tensor-parallel-size") == "2"
    assert flag(container(objs, "pool-consumer")["args"], "--tensor-parallel-size") == "4"
    identity = pool.spec.model_identity(pool.spec.image)
    assert identity.tensor_parallel_size == 2
    job = width_job(pool, identity, identity.fingerprint())
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert parse_args(c["args"][2:]).tensor_parallel_size == 2
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    # Tensor-parallel pods and the Job share one hash seed per pool (hash_seed);
    # single-rank pods are rendered as before.
    envs = [c["env"], *(container(objs, r)["env"] for r in ("pool-producer", "pool-consumer"))]
    seeds = {e["value"] for env in envs for e in env if e["name"] == "PYTHONHASHSEED"}
    assert seeds == {hash_seed(pool)}
    single = children(load("pool-shared-volume.yaml"))
    assert all(e["name"] != "PYTHONHASHSEED" for e in container(single, "pool-producer")["env"])
    # Both roles get the producers' identity; a consumer does not compare its own TP.
    for role in ("pool-producer", "pool-consumer"):
        ec = json.loads(flag(container(objs, role)["args"], "--ec-transfer-config"))
        extra = ConnectorConfig.from_extra_config(ec["ec_connector_extra_config"])
        assert extra.model_identity is not None
        assert extra.model_identity.tensor_parallel_size == 2


def _pods(objs: dict[str, dict[str, Any]], job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Producer, consumer and width Job pod specs, by role."""
    return {
        "producer": objs["Deployment/pool-producer"]["spec"]["template"]["spec"],
        "consumer": objs["Deployment/pool-consumer"]["spec"]["template"]["spec"],
        "job": job["spec"]["template"]["spec"],
    }


def _width_job(pool: EncoderPool) -> dict[str, Any]:
    identity = pool.spec.model_identity(pool.spec.image)
    return width_job(pool, identity, identity.fingerprint())


@pytest.mark.parametrize("example", ["pool-shared-volume.yaml", "pool-rdma.yaml"])
def test_a_model_on_a_claim_is_mounted_read_only_where_vllm_loads_it(example: str) -> None:
    pool = load(example)
    assert pool.spec.model.source is not None
    assert pool.spec.model.path() == "/models/tiny-qwen2vl-model/tiny-qwen2vl"
    job = _width_job(pool)
    for role, pod in _pods(children(pool), job).items():
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {
            "claimName": "tiny-qwen2vl-model",
            "readOnly": True,
        }, role
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount == {
            "name": "model",
            "mountPath": "/models/tiny-qwen2vl-model",
            "readOnly": True,
        }
    for role in ("producer", "consumer"):
        args = container(children(pool), f"pool-{role}")["args"]
        assert args[:2] == ["serve", "/models/tiny-qwen2vl-model/tiny-qwen2vl"]
    # The Job measures (and fingerprints) exactly what the pods load.
    c = job["spec"]["template"]["spec"]["containers"][0]
    identity = json.loads(c["args"][c["args"].index("--identity") + 1])
    assert identity["model"] == "/models/tiny-qwen2vl-model/tiny-qwen2vl"


def _with_model(example: str, **model: Any) -> EncoderPool:
    raw = load(example).model_dump(by_alias=True, exclude={"status"}, exclude_none=True)
    raw["spec"]["model"].update(model)
    return EncoderPool.from_object(raw)


def test_a_sub_path_of_the_claim_is_what_is_mounted() -> None:
    source = {"persistentVolumeClaim": {"claimName": "models", "subPath": "team-a/vision"}}
    pool = _with_model("pool-shared-volume.yaml", source=source, name="qwen2-vl")
    mount = next(
        m
        for m in container(children(pool), "pool-producer")["volumeMounts"]
        if m["name"] == "model"
    )
    assert mount == {
        "name": "model",
        "mountPath": "/models/models",
        "readOnly": True,
        "subPath": "team-a/vision",
    }
    assert pool.spec.model.path() == "/models/models/qwen2-vl"


def test_without_a_source_no_model_volume_is_rendered() -> None:
    pool = _with_model("pool-rdma.yaml", source=None, name="Qwen/Qwen2-VL-7B-Instruct")
    for pod in _pods(children(pool), _width_job(pool)).values():
        assert all(v["name"] != "model" for v in pod["volumes"])
    assert container(children(pool), "pool-consumer")["args"][1] == "Qwen/Qwen2-VL-7B-Instruct"


def test_the_hub_token_reaches_every_vllm_container_as_a_secret_reference() -> None:
    token = {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    pool = _with_model("pool-rdma.yaml", source=None, name="org/gated-model", hubToken=token)
    for role, pod in _pods(children(pool), _width_job(pool)).items():
        env = [e for e in pod["containers"][0]["env"] if e["name"] == "HF_TOKEN"]
        assert env == [
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
            }
        ], role
    router = container(children(pool), "pool-router")
    assert all(e["name"] != "HF_TOKEN" for e in router.get("env", []))  # it never loads a model


def _with_template(template: dict[str, Any], role: str = "producer") -> EncoderPool:
    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"][role]["podTemplate"] = template
    return EncoderPool.from_object(
        {**raw, "metadata": {"name": "pool", "namespace": "ml", "uid": "u"}}
    )


def test_pod_template_lists_merge_by_name_instead_of_replacing_ours() -> None:
    pool = _with_template(
        {
            "spec": {
                "containers": [
                    {
                        "name": "vllm",
                        "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
                        "volumeMounts": [{"name": "extra", "mountPath": "/extra"}],
                    },
                    {"name": "sidecar", "image": "example.invalid/sidecar:1"},
                ],
                "volumes": [{"name": "extra", "configMap": {"name": "extra"}}],
                "topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
                ],
            }
        }
    )
    spec = children(pool)["Deployment/pool-producer"]["spec"]["template"]["spec"]
    vllm, sidecar = spec["containers"]
    assert (vllm["name"], sidecar["name"]) == ("vllm", "sidecar")
    assert vllm["command"] == ["vllm"]  # ours, kept
    env = {e["name"] for e in vllm["env"]}
    assert {"VLLM_LOGGING_LEVEL", "VLLM_NO_USAGE_STATS", "HOME"} <= env
    mounts = [m["name"] for m in vllm["volumeMounts"]]
    assert mounts[:2] == ["dshm", "home"]
    assert mounts[-1] == "extra"
    assert [v["name"] for v in spec["volumes"]][-1] == "extra"
    assert "dshm" in [v["name"] for v in spec["volumes"]]
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "zone"


def test_our_restricted_fields_win_after_the_template_merges() -> None:
    """Validation refuses these; ``render.pod.restrict`` holds even for a template that got
    past it (here: built without validation), and covers containers it adds."""
    pool = _with_template({"spec": {"containers": [{"name": "sidecar", "image": "x"}]}})
    hostile = {
        "spec": {
            "nodeName": "control-plane",
            "hostPID": True,
            "automountServiceAccountToken": True,
            "securityContext": {
                "runAsNonRoot": False,
                "runAsGroup": 0,
                "seccompProfile": {"type": "Unconfined"},
                "seLinuxOptions": {"type": "spc_t"},
            },
            "containers": [
                {
                    "name": "vllm",
                    "securityContext": {
                        "privileged": True,
                        "runAsUser": 0,
                        "procMount": "Unmasked",
                        "appArmorProfile": {"type": "Unconfined"},
                        "capabilities": {"add": ["SYS_ADMIN"]},
                    },
                },
                {
                    "name": "sidecar",
                    "image": "x",
                    "securityContext": {"allowPrivilegeEscalation": True},
                },
            ],
        }
    }
    producer = pool.spec.producer.model_copy(update={"pod_template": hostile})
    pool = pool.model_copy(update={"spec": pool.spec.model_copy(update={"producer": producer})})
    config = pool.spec.connector_config("0" * 16, {"image": 128})
    deployment = vllm_deployment(pool, PRODUCER, config)
    spec = deployment["spec"]["template"]["spec"]
    for key in ("nodeName", "hostPID"):
        assert key not in spec
    assert spec["automountServiceAccountToken"] is False
    ctx = spec["securityContext"]
    assert ctx["runAsNonRoot"] is True
    assert ctx["runAsGroup"] == 1000
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "seLinuxOptions" not in ctx
    vllm, sidecar = spec["containers"]
    for c in (vllm, sidecar):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["runAsNonRoot"] is True
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        for key in ("privileged", "runAsUser", "procMount", "appArmorProfile"):
            assert key not in sc, (c["name"], key)
    assert vllm["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # no SYS_ADMIN
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_a_pool_without_a_template_renders_as_before() -> None:
    """``restrict`` runs only over a template: upgrading the operator rolls no pod."""
    pool = load("pool-shared-volume.yaml")
    spec = children(pool)["Deployment/pool-producer"]["spec"]["template"]["spec"]
    assert spec["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


@pytest.mark.parametrize(
    ("template", "field"),
    [
        ({"spec": {"serviceAccountName": "admin"}}, "podTemplate.spec.serviceAccountName"),
        ({"spec": {"automountServiceAccountToken": True}}, "spec.automountServiceAccountToken"),
        ({"spec": {"hostNetwork": True}}, "podTemplate.spec.hostNetwork"),
        ({"spec": {"hostPID": True}}, "podTemplate.spec.hostPID"),
        ({"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}}, "spec.volumes[0]"),
        (
            {"spec": {"containers": [{"name": "x", "securityContext": {"privileged": True}}]}},
            "spec.containers[0].securityContext",
        ),
        (
            {"spec": {"initContainers": [{"name": "i", "securityContext": {"runAsUser": 0}}]}},
            "spec.initContainers[0].securityContext",
        ),
        (
            {
                "spec": {
                    "containers": [
                        {"name": "v", "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}
                    ]
                }
            },
            "spec.containers[0].securityContext",
        ),
        ({"spec": {"securityContext": {"runAsNonRoot": False}}}, "spec.securityContext"),
        ({"spec": {"containers": [{"name": "vllm", "image": "evil"}]}}, "spec.containers[0].image"),
        ({"spec": {"containers": [{"name": "vllm", "command": ["sh"]}]}}, "containers[0].command"),
        (
            {"spec": {"containers": [{"image": "x"}]}},
            "spec.containers[0]: every entry needs a name",
        ),
    ],
)
def test_pod_template_fields_that_escalate_are_refused_naming_them(
    template: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match="is invalid") as info:
        _with_template(template, role="consumer")
    assert "spec.consumer.podTemplate" in str(info.value)
    assert field in str(info.value)


def test_rollouts_replace_pods_without_a_surge_by_default() -> None:
    objs = children(load("pool-shared-volume.yaml"))
    strategy = objs["Deployment/pool-consumer"]["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["producer"]["rollout"] = {"maxSurge": 1, "maxUnavailable": 0}
    pool = EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})
    rolling = children(pool)["Deployment/pool-producer"]["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 1, "maxUnavailable": 0}
    raw["spec"]["producer"]["rollout"] = {"maxSurge": 0, "maxUnavailable": 0}
    with pytest.raises(ValueError, match=r"spec\.producer\.rollout: .*cannot both be 0"):
        EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})


def test_the_router_stays_alive_while_it_has_no_consumers() -> None:
    router = container(children(load("pool-shared-volume.yaml")), "pool-router")
    assert router["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert router["startupProbe"]["httpGet"]["path"] == "/livez"
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"


def test_typed_pod_fields_reach_the_pods() -> None:
    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["consumer"].update(
        priorityClassName="lm-high",
        topologySpreadConstraints=[{"topologyKey": "topology.kubernetes.io/zone"}],
        podLabels={"team": "vision"},
        podAnnotations={"example.com/owner": "vision"},
    )
    pool = EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})
    template = children(pool)["Deployment/pool-consumer"]["spec"]["template"]
    spec = template["spec"]
    assert spec["priorityClassName"] == "lm-high"
    (spread,) = spec["topologySpreadConstraints"]
    assert spread == {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": selector_labels(pool, "consumer")},
    }
    assert template["metadata"]["labels"]["team"] == "vision"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "consumer"
    assert template["metadata"]["annotations"]["example.com/owner"] == "vision"


def _policies(pool: EncoderPool) -> dict[str, dict[str, Any]]:
    return {
        k.split("/", 1)[1]: v["spec"] for k, v in children(pool).items() if k.startswith("Network")
    }


def test_network_policies_let_in_only_who_needs_each_port() -> None:
    policies = _policies(load("pool-rdma.yaml"))
    assert set(policies) == {"pool-producer", "pool-consumer", "pool-router", "pool-width-job"}
    http = [{"protocol": "TCP", "port": HTTP_PORT}]
    router = {"podSelector": {"matchLabels": selector_labels(load("pool-rdma.yaml"), "router")}}
    consumers = {"matchLabels": selector_labels(load("pool-rdma.yaml"), "consumer")}
    assert policies["pool-consumer"]["ingress"] == [{"from": [router], "ports": http}]
    assert policies["pool-producer"]["ingress"] == [
        {"from": [router], "ports": http},
        {"from": [{"podSelector": consumers}]},  # side channel and UCX: any port
    ]
    assert policies["pool-router"]["ingress"] == [{"ports": http}]  # clients: anyone
    assert "ingress" not in policies["pool-width-job"]  # no rule: nothing reaches it
    assert all(p["policyTypes"] == ["Ingress"] for p in policies.values())


def test_network_policy_clients_metrics_and_opt_out() -> None:
    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["router"] = {"enabled": False}
    raw["spec"]["networkPolicy"] = {
        "clients": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        "metrics": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
    }
    pool = EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})
    policies = _policies(pool)
    assert "pool-router" not in policies
    http = [{"protocol": "TCP", "port": HTTP_PORT}]
    apps = {"from": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}], "ports": http}
    scrapers = {
        "from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
        "ports": http,
    }
    assert policies["pool-consumer"]["ingress"] == [apps, scrapers]
    assert policies["pool-producer"]["ingress"] == [apps, scrapers]  # no rdma: no consumer rule
    raw["spec"]["networkPolicy"] = {"enabled": False}
    off = EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})
    assert _policies(off) == {}
    raw["spec"]["networkPolicy"] = {"clients": [{}]}
    with pytest.raises(ValueError, match="at least one of podSelector"):
        EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})


def test_media_fetching_is_guarded_by_default_and_configurable() -> None:
    objs = children(load("pool-shared-volume.yaml"))
    vllm = container(objs, "pool-consumer")
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    assert "--allowed-media-domains" not in vllm["args"]
    assert "--allow-private-media" not in container(objs, "pool-router")["args"]
    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["model"]["media"] = {
        "allowedDomains": ["images.example.com", "cdn.example.com"],
        "allowRedirects": True,
        "allowPrivateAddresses": True,
    }
    meta = {"name": "pool", "namespace": "ml", "uid": "u"}
    objs = children(EncoderPool.from_object({**raw, "metadata": meta}))
    vllm = container(objs, "pool-producer")
    i = vllm["args"].index("--allowed-media-domains")
    assert vllm["args"][i + 1 : i + 3] == ["images.example.com", "cdn.example.com"]
    assert {e["name"]: e.get("value") for e in vllm["env"]}["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "1"
    settings = parse_settings(container(objs, "pool-router")["args"])
    assert settings.allowed_media_domains == ("images.example.com", "cdn.example.com")
    assert settings.allow_private_media is True


def _env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("valueFrom", e.get("value")) for e in c.get("env", [])}


def _internal(key: str) -> dict[str, Any]:
    return {"secretKeyRef": {"name": "pool-internal", "key": key}}


@pytest.mark.parametrize("example", ["pool-shared-volume.yaml", "pool-rdma.yaml"])
def test_vllm_pods_and_the_router_get_the_pool_s_internal_keys_by_reference(example: str) -> None:
    pool = load(example)
    objs = children(pool)
    for role in ("producer", "consumer"):
        env = _env(container(objs, f"pool-{role}"))
        assert env["VLLM_API_KEY"] == _internal("vllm-api-key")  # vLLM guards /v1 with it
        assert env["ENCODERPOOL_CHANNEL_KEY"] == _internal("channel-key")
    router = container(objs, "pool-router")
    # The router holds the same key toward the pods, and nothing else of the Secret (the
    # pool's uid is no secret: what its Services' controller must be); its probe port and
    # its own memory limit, which its budgets are derived from.
    assert _env(router) == {
        "ENCODERPOOL_ROUTER_BACKEND_API_KEY": _internal("vllm-api-key"),
        "ENCODERPOOL_ROUTER_POOL_UID": "u-1",
        "ENCODERPOOL_ROUTER_PROBE_PORT": str(ROUTER_PROBE_PORT),
        "ENCODERPOOL_ROUTER_MEMORY_LIMIT_BYTES": {
            "resourceFieldRef": {"containerName": "router", "resource": "limits.memory"}
        },
    }
    job_env = _env(_width_job(pool)["spec"]["template"]["spec"]["containers"][0])
    assert not {"VLLM_API_KEY", "ENCODERPOOL_CHANNEL_KEY"} & set(job_env)  # it serves nothing
    assert "pool-internal" not in json.dumps(objs["Service/pool"])
    assert internal_secret(pool)["metadata"]["name"] == "pool-internal"


def test_the_router_serves_metrics_and_probes_on_ports_of_their_own_never_on_the_service() -> None:
    objs = children(load("pool-shared-volume.yaml"))
    router = container(objs, "pool-router")
    assert router["ports"] == [
        {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
        {"name": "probes", "containerPort": ROUTER_PROBE_PORT, "protocol": "TCP"},
    ]
    # Every probe on the probe port: clients filling the API port cannot fail them.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert router[probe]["httpGet"]["port"] == "probes"
    env = {e["name"]: e["value"] for e in router["env"] if "value" in e}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        mp.setenv("ENCODERPOOL_ROUTER_MEMORY_LIMIT_BYTES", str(2 << 30))  # the default limit
        settings = parse_settings(router["args"])
    assert (settings.port, settings.metrics_port) == (HTTP_PORT, ROUTER_METRICS_PORT)
    assert settings.probe_port == ROUTER_PROBE_PORT
    assert router["resources"]["limits"]["memory"] == "2Gi"
    assert settings.auth_token_file is None  # no client auth unless asked for
    # The pool's endpoint (perhaps a LoadBalancer) never carries the metrics port.
    assert [p["name"] for p in objs["Service/pool"]["spec"]["ports"]] == ["http"]


def test_client_auth_mounts_the_token_secret_where_the_router_reads_it() -> None:
    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["router"]["auth"] = {"bearerTokenSecret": {"name": "edge-tokens", "key": "t"}}
    pool = EncoderPool.from_object(
        {**raw, "metadata": {"name": "pool", "namespace": "ml", "uid": "u"}}
    )
    pod = children(pool)["Deployment/pool-router"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    settings = parse_settings(c["args"])
    assert settings.auth_token_file is not None
    (mount,) = c["volumeMounts"]
    assert mount["readOnly"] is True
    # A whole-volume mount (no subPath): Kubernetes then updates the file on rotation.
    assert "subPath" not in mount
    assert settings.auth_token_file.parent == Path(mount["mountPath"])
    (volume,) = pod["volumes"]
    assert volume["name"] == mount["name"]
    assert volume["secret"]["secretName"] == "edge-tokens"
    assert volume["secret"]["items"] == [{"key": "t", "path": settings.auth_token_file.name}]
    for role in ("producer", "consumer"):  # the router alone sees client tokens
        assert "edge-tokens" not in json.dumps(children(pool)[f"Deployment/pool-{role}"])


def test_scrapers_reach_the_router_s_metrics_port_and_clients_only_its_api() -> None:
    raw = load("pool-shared-volume.yaml").model_dump(by_alias=True, exclude={"status"})
    raw["spec"]["networkPolicy"] = {
        "clients": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        "metrics": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}],
    }
    pool = EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})
    router = _policies(pool)["pool-router"]
    assert router["ingress"] == [
        {
            "from": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
            "ports": [{"protocol": "TCP", "port": HTTP_PORT}],
        },
        {
            "from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}],
            "ports": [{"protocol": "TCP", "port": ROUTER_METRICS_PORT}],
        },
    ]
    raw["spec"]["networkPolicy"] = {}  # no scrapers named: the metrics port stays shut
    pool = EncoderPool.from_object({**raw, "metadata": {"name": "pool", "uid": "u"}})
    ports = [p for rule in _policies(pool)["pool-router"]["ingress"] for p in rule["ports"]]
    assert ports == [{"protocol": "TCP", "port": HTTP_PORT}]


def test_the_router_trusts_only_the_pool_s_services_and_may_read_only_those(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router learns the pool's uid (an env: a router older than it ignores it) and
    may get exactly the Services it follows, to check they are the pool's and which
    EndpointSlices are theirs."""

    for pool, services in (
        (load("pool-shared-volume.yaml"), ["pool-producer", "pool-consumer"]),
        (grouped(), ["pool-producer-images", "pool-producer-video", "pool-consumer"]),
    ):
        objs = children(pool)
        assert router_services(pool) == services
        rules = objs["Role/pool-router"]["rules"]
        assert rules[1] == {
            "apiGroups": [""],
            "resources": ["services"],
            "verbs": ["get"],
            "resourceNames": services,
        }
        c = container(objs, "pool-router")
        for name, value in _env(c).items():
            if isinstance(value, str):
                monkeypatch.setenv(name, value)
        assert parse_settings(c["args"]).pool_uid == "u-1"  # flags and env, as in the pod


def test_the_router_gets_bounded_resources_unless_the_spec_gives_its_own() -> None:
    """Defaults when spec.router.resources is empty; any request or limit given replaces
    them all (a default limit below a given request would be refused)."""
    c = container(children(load("pool-shared-volume.yaml")), "pool-router")
    assert c["resources"] == ROUTER_RESOURCES
    assert c["resources"]["limits"]["memory"] == "2Gi"
    assert c["resources"]["requests"] == {"cpu": "250m", "memory": "256Mi"}
    obj = load("pool-shared-volume.yaml").model_dump(mode="json", by_alias=True, exclude={"status"})
    for given in ({"requests": {"memory": "4Gi"}}, {"limits": {"cpu": "1", "memory": "1Gi"}}):
        obj["spec"]["router"] = {**obj["spec"].get("router", {}), "resources": given}
        c = container(children(EncoderPool.from_object(obj)), "pool-router")
        assert c["resources"] == given
    assert ROUTER_RESOURCES["limits"]["memory"] == "2Gi"  # the default is not mutated

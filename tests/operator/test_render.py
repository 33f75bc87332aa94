"""Rendering is pure, and what it renders parses on the other side of each contract:
vLLM's ECTransferConfig and our ConnectorConfig (the vLLM pods), the router's
flags (the router pod)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from encoderpool_connector.contracts import ConnectorConfig
from encoderpool_operator import render
from encoderpool_operator.api import EncoderPool
from encoderpool_router.config import parse_settings
from tests.operator.fixtures import report_for

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = render.Defaults(router_image="example.invalid/encoderpool-operator:test")


def load(example: str, **meta: Any) -> EncoderPool:
    obj = yaml.safe_load((REPO / "examples" / example).read_text())
    obj["metadata"] = {"name": "pool", "namespace": "ml", "uid": "u-1", "generation": 1, **meta}
    return EncoderPool.from_object(obj)


def children(pool: EncoderPool, width: int = 128) -> dict[str, dict[str, Any]]:
    raw = pool.model_dump(by_alias=True, exclude={"status"})
    report = report_for(raw, width)
    return {
        f"{o['kind']}/{o['metadata']['name']}": o
        for o in render.workload_objects(pool, report, DEFAULTS)
    }


def container(objs: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    return dict(objs[f"Deployment/{name}"]["spec"]["template"]["spec"]["containers"][0])


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


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
    assert settings.reuse_encoded_s == render.ROUTER_REUSE_SECONDS  # shared volume only
    rdma = container(children(load("pool-rdma.yaml")), "pool-router")
    assert parse_settings(rdma["args"]).reuse_encoded_s == 0


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
    job = render.width_job(pool, identity, identity.fingerprint())
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod  # no ServiceAccount, Role or RoleBinding of its own
    (c,) = pod["containers"]
    assert c["name"] == render.MEASURE_CONTAINER
    assert c["terminationMessagePath"] == "/dev/termination-log"
    assert c["terminationMessagePolicy"] == "File"  # the report, never a log tail
    assert c["args"][c["args"].index("--output-file") + 1] == "/dev/termination-log"


def test_child_refs_name_what_the_workload_renders() -> None:
    """The reconcile reads children by these refs before it knows the report."""
    for example in ("pool-shared-volume.yaml", "pool-rdma.yaml"):
        pool = load(example)
        for router in (True, False):
            raw = pool.model_dump(by_alias=True, exclude={"status"})
            raw["spec"]["router"]["enabled"] = router
            variant = EncoderPool.from_object(raw)
            rendered = render.workload_objects(variant, report_for(raw), DEFAULTS)
            refs = [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in rendered]
            assert sorted(render.child_refs(variant)) == sorted(refs)


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
    assert render.ANNOTATION_CONFIG_HASH in template["metadata"]["annotations"]
    assert template["spec"]["containers"][0]["name"] == "vllm"


def test_the_width_job_command_parses_as_measure_and_keys_the_report() -> None:
    from encoderpool_connector.measure import parse_args

    pool = load("pool-shared-volume.yaml")
    identity = pool.spec.model_identity(pool.spec.image)
    job = render.width_job(pool, identity, identity.fingerprint())
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python"]
    assert c["args"][:2] == ["-m", "encoderpool_connector.measure"]
    args = parse_args(c["args"][2:])
    assert args.identity == identity
    assert args.identity.fingerprint() == identity.fingerprint()
    assert args.model == pool.spec.model.name
    assert args.max_model_len == 2048  # carried over from spec.model.extraArgs
    assert args.output_file == Path("/dev/termination-log")

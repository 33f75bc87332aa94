"""The pool in real containers: chart, operator image, width Job, vLLM pods, router, on kind.

One pool for the module (examples/pool-shared-volume.yaml, the model from a
PersistentVolumeClaim), driven through its life in order: measured, Ready,
answering like a monolithic vLLM pod without the consumer encoding, scaled,
re-measured and rolled on a model change, surviving ``helm upgrade`` and
``helm uninstall``. Requests reach the router only through a port-forward.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from e2e.kind.cluster import CHART, OPERATOR_NS, Images, KindCluster, host_sysctls
from e2e.kind.pool import (
    condition,
    encoded,
    logs,
    patch_spec,
    sample_pool,
    status,
    token_ids_pool_and_monolithic,
    wait_ready,
)
from e2e.media import MODEL, anthropic_messages, chat_request, image, responses_input
from encoderpool_contracts import WidthReport
from encoderpool_operator.render.pod import RESTRICTED_CONTAINER, RESTRICTED_POD
from tests.waiting import wait_until

pytestmark = pytest.mark.kind

NS = "kind-sv"
# vLLM's DEBUG line on a cache hit names the class by its module.
ARCH = "vllm.model_executor.models.qwen2_vl.Qwen2VLForConditionalGeneration"
POOL = "tiny"
ATTACKER = Path(__file__).resolve().parents[2] / "e2e" / "kind" / "attacker.py"


def pool_status(kind: KindCluster) -> dict[str, Any]:
    return status(kind, NS, POOL)


@pytest.fixture(scope="module")
def pool(
    kind: KindCluster, operator: str, images: Images, tiny_model_dir: Path
) -> Iterator[dict[str, Any]]:
    spec = sample_pool(kind, NS, POOL, tiny_model_dir, images.vllm)
    kind.apply(spec)
    yield spec
    kind.kubectl("delete", "namespace", NS, "--wait=false", check=False)  # free the node


def test_width_job_runs_in_a_pod_and_the_report_lands_in_a_configmap(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    wait_until(
        "WidthsMeasured=True",
        lambda: condition(kind, NS, POOL, "WidthsMeasured").get("status") == "True",
        timeout=900,
    )
    status = pool_status(kind)
    cm = kind.get("configmap", "-n", NS, status["widthReportName"])
    report = WidthReport.from_configmap_data(cm["data"])
    assert report.fingerprint == status["modelFingerprint"]
    assert report.encoder_output_widths["image"] == report.hidden_size
    jobs = kind.get("jobs", "-n", NS)["items"]
    assert any(j.get("status", {}).get("succeeded") == 1 for j in jobs), jobs


def test_pool_becomes_ready(kind: KindCluster, pool: dict[str, Any]) -> None:
    seconds = wait_ready(kind, NS, POOL)
    print(f"Ready {seconds:.0f} s after the report")
    status = pool_status(kind)
    assert status["producers"]["ready"] == 1
    assert status["consumers"]["ready"] == 1


def why_local(kind: KindCluster) -> str:
    """What the router and the consumer said of items the consumer encoded itself."""
    said = [
        line
        for component in ("router", "consumer")
        for line in logs(kind, NS, POOL, component).splitlines()
        if "the consumer encodes" in line or ("WARNING" in line and "encoderpool" in line)
    ]
    return "\n".join(said[-20:]) or "(neither logged why)"


def test_answer_equals_monolithic_and_consumer_did_not_encode(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    bodies = [chat_request(image(i), max_tokens=8) for i in range(3)]
    got, expected = token_ids_pool_and_monolithic(kind, NS, pool, bodies)
    assert got == expected
    assert encoded(kind, NS, POOL, "producer") >= len(bodies), "the producer never ran its encoder"
    assert encoded(kind, NS, POOL, "consumer") == 0, "the consumer encoded by itself:\n" + (
        why_local(kind)
    )


def test_the_sdks_through_the_pools_service_answer_as_monolithic(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    """The clients people use, through the pool's Service: the OpenAI SDK's chat and
    Responses and the Anthropic SDK's Messages, each with a new image, answer as the
    monolithic pod (started by the test above) answers; the producer encodes every
    image, the consumer none."""
    produced, consumed = (encoded(kind, NS, POOL, c) for c in ("producer", "consumer"))
    answers = []
    port = pool["spec"]["router"]["port"]
    for target, port_ in ((f"deployment/{POOL}-mono", 8000), (f"service/{POOL}", port)):
        with kind.port_forward(NS, target, port_) as url:
            oai = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=300)
            chat = oai.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=8, extra_body={"return_token_ids": True},
                messages=chat_request(image(930))["messages"],
            )  # fmt: skip
            responses = oai.responses.create(
                model=MODEL, input=responses_input(image(931)),  # type: ignore[arg-type]
                temperature=0, max_output_tokens=8,
            )  # fmt: skip
            claude = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=300)
            message = claude.messages.create(
                model=MODEL, max_tokens=8, extra_body={"temperature": 0},
                messages=anthropic_messages(image(932), "base64"),  # type: ignore[arg-type]
            )  # fmt: skip
        assert responses.usage is not None
        said = "".join(b.text for b in message.content if b.type == "text")
        answers.append(
            (
                chat.model_dump()["choices"][0]["token_ids"],
                (responses.output_text, responses.usage.output_tokens),
                (said, message.usage.output_tokens),
            )
        )
    assert answers[0] == answers[1]
    assert encoded(kind, NS, POOL, "producer") >= produced + 3
    assert encoded(kind, NS, POOL, "consumer") == consumed


def router_pod(kind: KindCluster) -> dict[str, Any]:
    (pod,) = kind.get(
        "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={POOL},"
        "app.kubernetes.io/component=router",
    )["items"]  # fmt: skip
    return dict(pod)


def test_one_hostile_client_leaves_the_router_ready_and_never_restarts_it(
    kind: KindCluster, pool: dict[str, Any], images: Images
) -> None:
    """A pod holding every connection it may open (half silent, half with the largest
    unfinished head) and unfinished 48 MiB bodies, for 60 s, against the router pod with
    its real limit: its probes (readiness on the probe port) stay green, it is never
    restarted, and it answers afterwards."""
    before = router_pod(kind)
    name = before["metadata"]["name"]
    restarts = before["status"]["containerStatuses"][0]["restartCount"]
    kind.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "attacker", "namespace": NS},
            "spec": {
                "restartPolicy": "Never",
                "securityContext": RESTRICTED_POD,
                "containers": [
                    {
                        "name": "attacker",
                        "image": images.operator,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["python", "-c", ATTACKER.read_text()],
                        "args": [f"{POOL}.{NS}.svc", "8000", "60", "1000"],
                        "securityContext": RESTRICTED_CONTAINER,
                    }
                ],
            },
        }
    )
    try:
        unready: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            phase = kind.get("pod", "-n", NS, "attacker")["status"].get("phase")
            now = router_pod(kind)
            (ready,) = [c for c in now["status"]["conditions"] if c["type"] == "Ready"]
            if ready["status"] != "True":
                unready.append(ready.get("message", ""))
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(2)
        answered = kind.kubectl("logs", "-n", NS, "attacker").strip().splitlines()[-1]
        print("attacker was answered:", answered)
        seen = json.loads(answered)
    finally:
        kind.kubectl("delete", "pod", "-n", NS, "attacker", "--wait=false", check=False)
    after = router_pod(kind)
    assert after["metadata"]["name"] == name, "the router pod was replaced"
    assert after["status"]["containerStatuses"][0]["restartCount"] == restarts
    assert not unready, f"the router went unready: {unready}"
    assert seen.get("503", 0) > 0, seen  # connections past its address's share, refused
    assert seen.get("429", 0) > 0, seen  # bodies past its share of body memory
    # The pool still answers.
    got, expected = token_ids_pool_and_monolithic(kind, NS, pool, [chat_request(image(9))])
    assert got == expected


def test_vllm_pods_start_from_the_images_model_class_cache(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    """The image fills vLLM's model-class cache at build
    (encoderpool_connector.programs.vllm_cache): no pod spends ~10 s of CPU inspecting the
    model in a subprocess at start-up."""
    for component in ("producer", "consumer"):
        log = logs(kind, NS, POOL, component)
        assert f"{ARCH} from cache" in log, f"{component}: no model-class cache hit in its log"
        assert "miss. Loading model instead" not in log, component


def test_model_change_measures_first_then_rolls(kind: KindCluster, pool: dict[str, Any]) -> None:
    before = pool_status(kind)["modelFingerprint"]
    consumer_before = kind.get("deployment", "-n", NS, f"{POOL}-consumer")
    patch_spec(kind, NS, POOL, {"model": {"dtype": "float32"}})
    # Until the new report exists, the Deployments keep the old configuration.
    wait_until(
        "a new fingerprint",
        lambda: pool_status(kind).get("modelFingerprint") not in (None, before),
        timeout=120,
    )
    now = kind.get("deployment", "-n", NS, f"{POOL}-consumer")
    if condition(kind, NS, POOL, "WidthsMeasured").get("status") != "True":
        assert now["spec"]["template"] == consumer_before["spec"]["template"]
    wait_until(
        "WidthsMeasured=True for float32",
        lambda: condition(kind, NS, POOL, "WidthsMeasured").get("status") == "True",
        timeout=900,
    )
    wait_until(
        "consumer rolled to float32",
        lambda: (
            "float32"
            in kind.get("deployment", "-n", NS, f"{POOL}-consumer")["spec"]["template"]["spec"][
                "containers"
            ][0]["args"]
        ),
        timeout=120,
    )
    wait_ready(kind, NS, POOL)


def test_scale_producers(kind: KindCluster, pool: dict[str, Any]) -> None:
    """After the model change, so that the change rolls one producer, not two."""
    patch_spec(kind, NS, POOL, {"producer": {"replicas": 2}})
    wait_until(
        "2 producers ready",
        lambda: (pool_status(kind).get("producers") or {}).get("ready") == 2,
        timeout=900,
    )
    wait_ready(kind, NS, POOL)


def test_helm_upgrade_keeps_the_pool(
    kind: KindCluster, pool: dict[str, Any], operator: str
) -> None:
    kind.helm(
        "upgrade",
        operator,
        str(CHART),
        "-n",
        OPERATOR_NS,
        "--reuse-values",
        "--set",
        "replicaCount=2",
        "--wait",
        "--timeout",
        "5m",
    )
    wait_ready(kind, NS, POOL)
    # The upgraded operator still reconciles: a scale-down reaches the Deployment.
    patch_spec(kind, NS, POOL, {"producer": {"replicas": 1}})
    wait_until(
        "producer Deployment scaled to 1",
        lambda: kind.get("deployment", "-n", NS, f"{POOL}-producer")["spec"]["replicas"] == 1,
        timeout=180,
    )


def test_uninstall_keeps_pools_and_crd(
    kind: KindCluster, pool: dict[str, Any], operator: str, images: Images
) -> None:
    kind.helm("uninstall", operator, "-n", OPERATOR_NS, "--wait")
    time.sleep(2)
    assert kind.get("crd", "encoderpools.encoderpool.io")["metadata"]["name"]
    assert kind.get("epool", "-n", NS, POOL)["metadata"]["name"] == POOL
    # Reinstall for the modules after this one.
    kind.install_operator(images)


def test_host_sysctls_unchanged(sysctls_before: dict[str, str], pool: dict[str, Any]) -> None:
    assert host_sysctls() == sysctls_before

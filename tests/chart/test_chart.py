"""The Helm chart, statically: generated files in sync, lint and template clean, schema strict.

Every documented values set (ci/*-values.yaml) is linted and templated; the
default render is golden-tested; wrong values must fail with a message naming them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from encoderpool_codegen import chart, crd
from encoderpool_operator import rbac
from tests.chart.fixtures import CHART, REPO, documents, helm

GOLDEN = Path(__file__).resolve().parent / "golden" / "chart-default.yaml"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


def template(*args: str, release: str = "ep", namespace: str = "encoderpool-system") -> str:
    return helm("template", release, str(CHART), "--namespace", namespace, *args).stdout


def by_kind(manifest: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in documents(manifest)}


# ------------------------------------------------------------------ in sync


def test_generated_chart_files_are_in_sync() -> None:
    """values.schema.json, files/rbac.json and the chart's CRD are what the generator writes."""
    assert chart.main(["--check", str(CHART)]) == 0, "run: make crds"


def test_the_charts_crd_is_byte_identical_to_the_generated_one() -> None:
    chart_crd = CHART / "crds" / crd.FILENAME
    assert chart_crd.read_bytes() == (REPO / "crds" / crd.FILENAME).read_bytes()


def test_values_yaml_is_the_models_defaults() -> None:
    """values.yaml is hand-written for its comments; it may not drift from the schema's model."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values == chart.ChartValues().model_dump(by_alias=True, mode="json")


def test_every_value_in_values_yaml_is_commented() -> None:
    """Each value (a top-level key, or a key of a section like image:) has a comment above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    sections = {
        field.alias or name
        for name, field in chart.ChartValues.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    }
    section, values = "", []
    for i, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent, key = len(line) - len(line.lstrip()), line.strip().split(":", 1)[0]
        if indent == 0:
            section = key if key in sections else ""
            if not section:
                values.append(i)
        elif indent == 2 and section:
            values.append(i)
    assert len(values) > 15
    assert [lines[i] for i in values if not lines[i - 1].strip().startswith("#")] == []


# ------------------------------------------------------------- lint, render


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "default")
def test_lint_is_clean(values: Path | None) -> None:
    args = ["lint", str(CHART), "--strict", "--namespace", "encoderpool-system"]
    if values:
        args += ["--values", str(values)]
    out = helm(*args).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out
    assert "[ERROR]" not in out


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "default")
def test_template_renders_labelled_restricted_objects(values: Path | None) -> None:
    docs = documents(template(*(["--values", str(values)] if values else [])))
    assert docs
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "encoderpool-operator"
        assert labels["app.kubernetes.io/instance"] == "ep"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "encoderpool-operator-0.1.0"
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # kopf runs standalone (every replica watches); the Lease elects the one that writes.
    assert "--standalone" in container["args"]
    assert not any(a.startswith("--peering") for a in container["args"])
    env = {e["name"]: e for e in container["env"]}
    lease = "encoderpool" if values and values.name == "production-values.yaml" else None
    assert env["ENCODERPOOL_LEASE_NAME"]["value"] == (lease or "ep-encoderpool-operator")
    assert env["ENCODERPOOL_LEASE_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}
    }
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_default_render_matches_golden() -> None:
    """Review changes to the rendered chart as a diff; regenerate with ENCODERPOOL_GOLDEN=1."""
    out = template()
    if os.environ.get("ENCODERPOOL_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(out)
    assert out == GOLDEN.read_text()


@pytest.mark.parametrize(
    ("scope", "role", "binding", "watch"),
    [
        ("cluster", "ClusterRole", "ClusterRoleBinding", "--all-namespaces"),
        ("namespace", "Role", "RoleBinding", "--namespace=encoderpool-system"),
    ],
)
def test_scope_picks_rbac_and_kopf_flags_together(
    scope: str, role: str, binding: str, watch: str
) -> None:
    docs = documents(template("--set", f"scope={scope}"))
    roles = [
        d for d in docs if d["kind"] == role and "leader-election" not in d["metadata"]["name"]
    ]
    election = [
        d for d in docs if d["metadata"]["name"] == "ep-encoderpool-operator-leader-election"
    ]
    assert len(roles) == 1
    assert {d["kind"] for d in election} == {"Role", "RoleBinding"}
    assert binding in {d["kind"] for d in docs}
    lease_role = next(d for d in election if d["kind"] == "Role")
    assert lease_role["metadata"]["namespace"] == "encoderpool-system"  # beside the pods
    rendered = {
        (r["apiGroups"][0], r["resources"][0], v)
        for d in (roles[0], lease_role)
        for r in d["rules"]
        for v in r["verbs"]
    }
    assert rendered == rbac.granted(scope)  # type: ignore[arg-type]
    assert not any(r["resources"] == ["leases"] for r in roles[0]["rules"])
    assert {
        (tuple(r["verbs"]), tuple(r.get("resourceNames", ()))) for r in lease_role["rules"]
    } == {(("get", "update"), ("ep-encoderpool-operator",)), (("create",), ())}
    args = by_kind(template("--set", f"scope={scope}"))["Deployment"]["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert watch in args
    if scope == "namespace":
        for doc in docs:
            assert doc["metadata"].get("namespace") == "encoderpool-system", doc["kind"]


def test_no_rbac_and_an_existing_service_account() -> None:
    kinds = by_kind(
        template("--set", "rbac.create=false,serviceAccount.create=false,serviceAccount.name=ops")
    )
    assert set(kinds) == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    assert kinds["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "replicas=2"], "additional properties 'replicas' not allowed"),
        (["--set", "scope=everywhere"], "'/scope': value must be one of 'cluster', 'namespace'"),
        (["--set", "replicaCount=0"], "'/replicaCount': minimum: got 0, want 1"),
        (["--set", "image.pullPolicy=Sometimes"], "'/image/pullPolicy': value must be one of"),
        (
            ["--set", "operator.resyncSeconds=1"],
            "'/operator/resyncSeconds': minimum: got 1, want 5",
        ),
        (
            ["--set", "leaderElection.leaseName=Not_A_Name"],
            "'/leaderElection/leaseName': 'Not_A_Name' does not match",
        ),
        (["--set", "serviceAccount.create=false"], "'/serviceAccount/name': minLength: got 0"),
        (["--set", "metrics=true"], "'/metrics': got boolean, want object"),
        (["--set", "metrics.port=80"], "'/metrics/port': minimum: got 80, want 1,024"),
        (["--set", "metrics.port=8080"], "'/metrics/port': 'not' failed"),  # kopf's health port
        (["--set", "metrics.path=/m"], "additional properties 'path' not allowed"),
        (
            ["--set", "serviceMonitor.enabled=true,metrics.enabled=false"],
            "'/metrics/enabled': value must be true",
        ),
        (["--set", "serviceMonitor.interval=30"], "'/serviceMonitor/interval': got number"),
        (
            ["--set", "serviceMonitor.scrapeTimeout=10sec"],
            "'/serviceMonitor/scrapeTimeout': '10sec' does not match",
        ),
        (
            ["--set-json", 'serviceMonitor.labels={"app.kubernetes.io/name":"x"}'],
            "invalid propertyName 'app.kubernetes.io/name'",
        ),
        (
            ["--set-json", 'serviceMonitor.labels={"release":"not a value"}'],
            "'/serviceMonitor/labels/release': 'not a value' does not match",
        ),
        (["--set", "podDisruptionBudget.minAvailable=2"], "'minAvailable' not allowed"),
        (
            ["--set-json", 'metrics.networkPolicy.scrapers=[{"podSelector":{},"ports":[1]}]'],
            "additional properties 'ports' not allowed",
        ),
    ],
)
def test_wrong_values_fail_with_a_message(args: list[str], message: str) -> None:
    for command in (["template", "ep", str(CHART)], ["lint", "--strict", str(CHART)]):
        res = helm(*command, *args, check=False)
        assert res.returncode != 0, command
        assert message in res.stdout + res.stderr, (command, res.stdout + res.stderr)


# ------------------------------------------------ metrics, monitor, budget


def _operator(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return dict(kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0])


def test_metrics_service_selects_only_the_operator_pods_on_the_named_port() -> None:
    kinds = by_kind(template("--set", "metrics.port=9100,podLabels.extra=x"))
    container, deployment = _operator(kinds), kinds["Deployment"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ENCODERPOOL_METRICS_PORT"] == "9100"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9100}
    service = kinds["Service"]
    assert service["metadata"]["name"] == "ep-encoderpool-operator-metrics"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"}
    ]
    # Exactly the Deployment's selector labels: only this release's operator pods, never a
    # pool's pods, and nothing a podLabels value or an upgrade (version label) changes.
    selector = service["spec"]["selector"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert set(selector) == {
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/component",
    }
    assert selector["app.kubernetes.io/component"] == "operator"
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_only_the_named_scrapers_reach_the_metrics_port() -> None:
    """On by default: the metrics port from the scrapers' selector only, kopf's health port
    from anyone (the kubelet), nothing else; configurable, and gone with metrics off."""
    kinds = by_kind(template())
    policy, deployment = kinds["NetworkPolicy"], kinds["Deployment"]
    assert policy["metadata"]["name"] == "ep-encoderpool-operator-metrics"
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": "health", "protocol": "TCP"}]},
        {
            "from": [
                {
                    "namespaceSelector": {},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                }
            ],
            "ports": [{"port": "metrics", "protocol": "TCP"}],
        },
    ]
    mine = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    kinds = by_kind(template("--set-json", f"metrics.networkPolicy.scrapers={json.dumps(mine)}"))
    assert kinds["NetworkPolicy"]["spec"]["ingress"][1]["from"] == mine
    kinds = by_kind(template("--set-json", "metrics.networkPolicy.scrapers=[]"))
    assert kinds["NetworkPolicy"]["spec"]["ingress"] == [
        {"ports": [{"port": "health", "protocol": "TCP"}]}
    ]  # nobody scrapes
    for off in ("metrics.networkPolicy.enabled=false", "metrics.enabled=false"):
        assert "NetworkPolicy" not in by_kind(template("--set", off))


def test_metrics_disabled_turns_the_operators_server_off() -> None:
    kinds = by_kind(template("--set", "metrics.enabled=false"))
    container = _operator(kinds)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ENCODERPOOL_METRICS_PORT"] == "0"
    assert [p["name"] for p in container["ports"]] == ["health"]
    assert "Service" not in kinds
    assert "ServiceMonitor" not in kinds


def test_service_monitor_scrapes_the_metrics_services_port() -> None:
    assert "ServiceMonitor" not in by_kind(template())  # off by default
    kinds = by_kind(
        template(
            "--set", "serviceMonitor.enabled=true,serviceMonitor.interval=1m,"
            "serviceMonitor.scrapeTimeout=20s,serviceMonitor.labels.release=kps",
        )
    )  # fmt: skip
    monitor, service = kinds["ServiceMonitor"], kinds["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["encoderpool-system"]}
    # It selects the Service by its labels, and scrapes the Service's port by name.
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": "metrics",
        "path": "/metrics",
        "scheme": "http",
        "interval": "1m",
        "scrapeTimeout": "20s",
        # The pool gauges carry the pool's own namespace label, not the operator's ...
        "honorLabels": True,
        # ... so only the operator's own series are kept (docs/autoscaling.md).
        "metricRelabelings": [
            {"sourceLabels": ["__name__"], "regex": "encoderpool_operator_.+", "action": "keep"}
        ],
    }
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # ... which forwards to the container port of that name.
    target = service["spec"]["ports"][0]["targetPort"]
    assert target in {p["name"] for p in _operator(kinds)["ports"]}


@pytest.mark.parametrize(
    ("interval", "timeout", "ok"),
    [("1m", "60s", True), ("30s", "31s", False), ("1m30s", "1m31s", False), ("500ms", "1s", False)],
)
def test_service_monitor_timeout_is_at_most_its_interval(
    interval: str, timeout: str, ok: bool
) -> None:
    """JSON Schema cannot compare two fields: the template fails (and the model refuses)."""
    args = (
        "--set",
        f"serviceMonitor.enabled=true,serviceMonitor.interval={interval},"
        f"serviceMonitor.scrapeTimeout={timeout}",
    )
    res = helm("template", "ep", str(CHART), *args, check=False)
    assert (res.returncode == 0) is ok, res.stderr
    values = {"serviceMonitor": {"enabled": True, "interval": interval, "scrapeTimeout": timeout}}
    if ok:
        chart.ChartValues.model_validate(values)
    else:
        assert f"scrapeTimeout: {timeout} is longer than serviceMonitor.interval" in res.stderr
        with pytest.raises(ValueError, match="scrapeTimeout: longer than"):
            chart.ChartValues.model_validate(values)


@pytest.mark.parametrize(
    ("replicas", "enabled", "rendered"),
    [(1, True, False), (2, True, True), (3, True, True), (2, False, False)],
)
def test_pod_disruption_budget_only_with_more_than_one_replica(
    replicas: int, enabled: bool, rendered: bool
) -> None:
    kinds = by_kind(
        template("--set", f"replicaCount={replicas},podDisruptionBudget.enabled={enabled}")
    )
    assert ("PodDisruptionBudget" in kinds) is rendered
    if rendered:
        pdb = kinds["PodDisruptionBudget"]
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"]["minAvailable"] == 1
        assert (
            pdb["spec"]["selector"]["matchLabels"]
            == kinds["Deployment"]["spec"]["selector"]["matchLabels"]
        )


def test_the_monitoring_values_set_enables_metrics_monitor_and_budget() -> None:
    kinds = by_kind(template("--values", str(CHART / "ci" / "monitoring-values.yaml")))
    assert {"Service", "ServiceMonitor", "PodDisruptionBudget"} <= set(kinds)


def test_the_model_refuses_what_the_schema_refuses() -> None:
    """The cross-field rules hold for GitOps values validated by the model, too."""
    for values, message in (
        ({"serviceMonitor": {"enabled": True}, "metrics": {"enabled": False}}, "needs metrics"),
        ({"metrics": {"port": 8080}}, "kopf's health port"),
        ({"serviceMonitor": {"labels": {"helm.sh/chart": "x"}}}, "not a label key of its own"),
        ({"metrics": {"networkPolicy": {"scrapers": [{}]}}}, "give podSelector"),
    ):
        with pytest.raises(ValueError, match=message):
            chart.ChartValues.model_validate(values)


def test_rbac_json_lists_each_reason() -> None:
    data = json.loads((CHART / "files" / "rbac.json").read_text())
    assert set(data) == {"cluster", "namespace"}
    assert all(rule["why"] for rules in data.values() for rule in rules)
    # Nothing cluster-scoped may appear in what a Role holds.
    assert not any(r["resources"][0] in {"customresourcedefinitions"}
                   for r in data["namespace"])  # fmt: skip


def test_gitops_examples_install_this_chart_with_valid_values() -> None:
    """examples/argocd-application.yaml and flux-helmrelease.yaml stay in step with the chart."""
    argo = yaml.safe_load((REPO / "examples" / "argocd-application.yaml").read_text())
    source = argo["spec"]["source"]
    assert (REPO / source["path"]) == CHART
    chart.ChartValues.model_validate(source["helm"]["valuesObject"])
    flux = {
        d["kind"]: d
        for d in yaml.safe_load_all((REPO / "examples" / "flux-helmrelease.yaml").read_text())
    }
    release = flux["HelmRelease"]["spec"]
    assert (REPO / release["chart"]["spec"]["chart"]).resolve() == CHART
    assert (
        release["chart"]["spec"]["sourceRef"]["name"] == flux["GitRepository"]["metadata"]["name"]
    )
    chart.ChartValues.model_validate(release["values"])
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert source["targetRevision"] == flux["GitRepository"]["spec"]["ref"]["tag"] == f"v{version}"

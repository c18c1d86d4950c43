"""The Helm chart (charts/gpuplane): ``helm lint --strict`` and ``helm template`` with every values
file of charts/gpuplane/ci, what each mode renders, deploy/base rendered from it without drift, the
alert rules under ``promtool check rules`` and ``promtool test rules``, and every metric name a
dashboard or an alert uses found on the /metrics of a running web process.

helm and promtool are built from the Go module pinned in hack/kube (hack/kube-bin.sh), as the
control plane's binaries are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness.chart_tools import CHART, ROOT, chart_script, run, template, template_text, tool
from harness.ports import free_port

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CLUSTER, STANDALONE, CUSTOM, OPENSHIFT = (
    CHART / "ci" / f"{n}-values.yaml" for n in ("cluster", "standalone", "custom", "openshift")
)
ALERT_TESTS = CHART / "tests" / "alerts.test.yaml"
TWO_RELEASES = CHART / "tests" / "two-releases.test.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
ALERTS = {
    "GpuplaneLostSets",
    "GpuplaneOrdersPending",
    "GpuplaneBinderPassesStalled",
    "GpuplaneVerifyMismatch",
    "GpuplaneReadModelVerifyMismatch",
    "GpuplaneWebhookSlow",
    "GpuplaneWebhookTryAgain",
    "GpuplaneReadModelNotReady",
    "GpuplaneBrokerDown",
    "GpuplaneSyncLagging",
    "GpuplaneWebhookDown",
    "GpuplaneWebhookErrors",
    "GpuplaneWebhookRefusing",
    "GpuplaneWebhookCertificateExpiry",
}


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(deployment)
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# -- the tools -------------------------------------------------------------------------------------


def test_helm_and_promtool_are_the_pinned_releases() -> None:
    assert run(tool("helm"), "version", "--short").stdout.startswith("v4.3.2")
    assert "3.16.0" in run(tool("promtool"), "--version").stdout.splitlines()[0]


# -- lint and template -----------------------------------------------------------------------------


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_helm_lint_strict(values: Path) -> None:
    done = run(tool("helm"), "lint", "--strict", str(CHART), "-f", str(values))
    assert "0 chart(s) failed" in done.stdout


def test_ci_values_files_are_the_four_the_tests_know() -> None:
    assert sorted([CLUSTER, STANDALONE, CUSTOM, OPENSHIFT]) == CI_VALUES


def test_manual_certificates_without_a_ca_bundle_are_refused_naming_the_value() -> None:
    done = run(tool("helm"), "template", "gpuplane", str(CHART), "--set", "webhook.certificates=manual", check=False)
    assert done.returncode != 0
    assert "webhook.caBundle" in done.stderr and "self-signed-job or cert-manager" in done.stderr


def test_a_bad_mode_or_a_setting_the_chart_owns_is_refused() -> None:
    for flag, named in (
        ("mode=kubernetes", "at '/mode': value must be one of 'cluster', 'standalone'"),
        ("settings.DATABASE_URL=x", "settings.DATABASE_URL"),
    ):
        done = run(tool("helm"), "template", "gpuplane", str(CHART), "-f", str(CLUSTER), "--set", flag, check=False)
        assert done.returncode != 0 and named in done.stderr, done.stderr


def test_cluster_mode_renders_every_process_the_webhook_and_monitoring() -> None:
    docs = template(CLUSTER)
    assert set(of_kind(docs, "Deployment")) == {f"gpuplane-{c}" for c in ("web", "webhook", "binder", "beat", "sync")}
    processes = {f"gpuplane-{c}" for c in ("web", "webhook", "binder", "sync")}
    hooks = {"gpuplane-certificates", "gpuplane-certificates-hook", "gpuplane-crds"}
    assert set(of_kind(docs, "ClusterRole")) == processes | hooks | {"gpuplane-tenant-edit", "gpuplane-tenant-view"}
    assert set(of_kind(docs, "ClusterRoleBinding")) == processes | hooks
    assert set(of_kind(docs, "PodDisruptionBudget")) == {"gpuplane-web", "gpuplane-webhook"}
    assert set(of_kind(docs, "Service")) == {"gpuplane-api", "gpuplane-webhook"}
    webhook = of_kind(docs, "MutatingWebhookConfiguration")["gpuplane-vmi"]["webhooks"][0]
    assert webhook["clientConfig"]["service"] == {
        "name": "gpuplane-webhook", "namespace": "gpuplane-system", "path": "/webhooks/vmi", "port": 443,
    }  # fmt: skip
    assert webhook["failurePolicy"] == "Fail" and webhook["timeoutSeconds"] == 10
    assert webhook["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "gpuplane-system"]
    assert "Namespace" not in {d["kind"] for d in docs}  # helm install --create-namespace, by default
    monitors = of_kind(docs, "ServiceMonitor")
    assert set(monitors) == {"gpuplane", "gpuplane-webhook"}
    for monitor in monitors.values():
        assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"] == {
            "name": "gpuplane-secrets", "key": "GPUPLANE_METRICS_TOKEN",
        }  # fmt: skip
    # The scrape's Host (the pod IP) is allowed next to the Services' names.
    web = containers(of_kind(docs, "Deployment")["gpuplane-web"])[-1]
    assert env_of(web)["DJANGO_ALLOWED_HOSTS"] == "$(DJANGO_ALLOWED_HOSTS),$(POD_IP)"
    assert set(of_kind(docs, "PrometheusRule")) == {"gpuplane"}
    dashboards = {n: d for n, d in of_kind(docs, "ConfigMap").items() if "dashboard" in n}
    assert set(dashboards) == {f"gpuplane-dashboard-{p.stem}" for p in DASHBOARDS}
    for name, configmap in dashboards.items():
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((key, text),) = configmap["data"].items()
        stem = name.removeprefix("gpuplane-dashboard-")
        assert key == f"gpuplane-{stem}.json"
        assert json.loads(text) == json.loads((CHART / "dashboards" / f"{stem}.json").read_text())


def test_standalone_mode_makes_no_api_calls() -> None:
    docs = template(STANDALONE)
    assert set(of_kind(docs, "Deployment")) == {"gpuplane-web", "gpuplane-binder", "gpuplane-beat"}
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration"}
    accounts = of_kind(docs, "ServiceAccount")
    assert set(accounts) == {"gpuplane-web", "gpuplane-binder", "gpuplane-beat"}
    assert all(sa["automountServiceAccountToken"] is False for sa in accounts.values())
    assert set(of_kind(docs, "NetworkPolicy")) == {
        "gpuplane-default-deny-ingress", "gpuplane-api-from-allowed-namespaces", "gpuplane-datastores-from-gpuplane",
    }  # fmt: skip
    settings = of_kind(docs, "ConfigMap")["gpuplane-settings"]["data"]
    assert settings["GPUPLANE_CLUSTER"] == "standalone"
    assert "gpuplane-webhook" not in settings["DJANGO_ALLOWED_HOSTS"]


def test_custom_values_reach_every_object() -> None:
    docs = template(CUSTOM, release="site", namespace="gpus")
    deployments = of_kind(docs, "Deployment")
    assert set(deployments) == {f"gp-{c}" for c in ("web", "webhook", "binder", "beat", "sync")}
    assert (
        of_kind(docs, "Namespace")["gpus"]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    )
    assert deployments["gp-web"]["spec"]["replicas"] == 3 and deployments["gp-binder"]["spec"]["replicas"] == 1
    for name, deployment in deployments.items():
        spec = pod_spec(deployment)
        assert spec["imagePullSecrets"] == [{"name": "registry-example"}]
        expected = {"pool": "system"} if name == "gp-binder" else {"node-role.kubernetes.io/control-plane": ""}
        assert spec["nodeSelector"] == expected, name
        assert spec["tolerations"][0]["key"] == "node-role.kubernetes.io/control-plane"
        for container in containers(deployment):
            assert container["image"] == "registry.example.com/gpuplane:0.1.1"
            assert container["imagePullPolicy"] == "Always"
            env = env_of(container)
            assert env["DATABASE_URL"] == {"secretKeyRef": {"name": "gp-db", "key": "url"}}
            assert env["CELERY_BROKER_URL"] == {"secretKeyRef": {"name": "gp-redis", "key": "url"}}
            assert env["DJANGO_SECRET_KEY"] == {"secretKeyRef": {"name": "gp-django", "key": "secret-key"}}
            assert container["envFrom"] == [{"configMapRef": {"name": "gp-settings"}}]
    webhook_pod = pod_spec(deployments["gp-webhook"])
    assert {v["name"]: v["secret"]["secretName"] for v in webhook_pod["volumes"] if "secret" in v} == {
        "tls": "gp-tls", "webhook-token": "gp-apiserver-token",
    }  # fmt: skip
    assert env_of(webhook_pod["containers"][0])["GPUPLANE_WEBHOOK_TOKEN_FILE"] == "/etc/gpuplane/webhook-token/bearer"
    configuration = of_kind(docs, "MutatingWebhookConfiguration")["gp-vmi"]
    assert configuration["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "gpus/gp-webhook"}
    assert of_kind(docs, "Certificate")["gp-webhook"]["spec"]["secretName"] == "gp-tls"
    hook = configuration["webhooks"][0]
    assert "caBundle" not in hook["clientConfig"]
    assert hook["clientConfig"]["service"]["name"] == "gp-webhook"
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "kubevirt", "gpus"]
    settings = of_kind(docs, "ConfigMap")["gp-settings"]["data"]
    assert settings["GPUPLANE_DEFAULT_BUDGET"] == "deny"
    assert settings["DJANGO_CSRF_TRUSTED_ORIGINS"] == "https://gpuplane.example.com"
    assert settings["DJANGO_ALLOWED_HOSTS"].split(",") == [
        "gp-webhook.gpus.svc", "gp-webhook.gpus.svc.cluster.local", "gp-api.gpus.svc", "gp-api.gpus.svc.cluster.local",
        "localhost", "gpuplane.example.com",
    ]  # fmt: skip
    policy = of_kind(docs, "NetworkPolicy")["gp-webhook-from-apiserver"]
    assert policy["spec"]["ingress"][0]["from"] == [
        {"ipBlock": {"cidr": "10.0.0.0/16"}}, {"ipBlock": {"cidr": "fd00:10::/64"}},
    ]  # fmt: skip
    assert "gp-datastores-from-gpuplane" not in of_kind(docs, "NetworkPolicy")
    assert not of_kind(docs, "PodDisruptionBudget")
    for configmap in (c for n, c in of_kind(docs, "ConfigMap").items() if "dashboard" in n):
        assert configmap["metadata"]["namespace"] == "monitoring"
        assert configmap["metadata"]["annotations"] == {"grafana_folder": "GPUs"}
    rules = of_kind(docs, "PrometheusRule")["gp"]["spec"]["groups"][0]["rules"]
    stalled = next(r for r in rules if r["alert"] == "GpuplaneBinderPassesStalled")
    assert "[150s]" in stalled["expr"]  # 2 x GPUPLANE_RESYNC_SECONDS (60) + a 30 s scrape
    try_again = next(r for r in rules if r["alert"] == "GpuplaneWebhookTryAgain")
    assert 'le="5.0"' in try_again["expr"]  # GPUPLANE_BIND_WAIT_SECONDS 5
    assert all(r["annotations"]["runbook_url"].startswith("https://gpuplane.example.com/docs/") for r in rules)


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_selectors_match_their_pods(values: Path) -> None:
    docs = template(values)
    pods = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in of_kind(docs, "Deployment").items()}
    for name, deployment in of_kind(docs, "Deployment").items():
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pods[name].items()
        assert pods[name]["app.kubernetes.io/part-of"] == "gpuplane"  # the datastores' NetworkPolicy
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        for name, obj in of_kind(docs, kind).items():
            selector = obj["spec"].get("selector") or obj["spec"].get("podSelector") or {}
            labels = selector.get("matchLabels", selector if kind == "Service" else {})
            if labels and "app.kubernetes.io/component" in labels:
                assert any(labels.items() <= p.items() for p in pods.values()), f"{kind} {name} selects no pod"


def test_changing_a_setting_rolls_the_pods() -> None:
    def checksums(*extra: str) -> set[str]:
        docs = yaml.safe_load_all(template_text(CLUSTER, extra=extra))
        return {
            d["spec"]["template"]["metadata"]["annotations"]["checksum/settings"]
            for d in docs
            if d and d["kind"] == "Deployment"
        }

    before, after = checksums(), checksums("--set-string", "settings.GPUPLANE_DEFAULT_BUDGET=deny")
    assert len(before) == len(after) == 1 and before != after


def test_chart_rbac_is_deploys_rbac() -> None:
    """Rule for rule what deploy/base/rbac.yaml grants (tests/project/test_deploy.py checks those against
    the code's API calls), whatever the release is named."""
    deployed = {
        d["metadata"]["name"]: d["rules"]
        for d in yaml.safe_load_all((ROOT / "deploy/base/rbac.yaml").read_text())
        if d and d["kind"] == "ClusterRole"
    }
    charted = {n.removeprefix("gp-"): r["rules"] for n, r in of_kind(template(CUSTOM), "ClusterRole").items()}
    # The processes' roles; the hooks' and the tenants' are the chart's alone (test_chart_values.py).
    processes = {n.removeprefix("gpuplane-"): rules for n, rules in deployed.items()}
    assert {n: r for n, r in charted.items() if n in processes} == processes
    assert set(charted) - set(processes) == {"crds", "tenant-edit", "tenant-view"}  # cert-manager: no Job


def test_settings_are_documented_variables() -> None:
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", (ROOT / "docs" / "settings.md").read_text(), re.M))
    for values in CI_VALUES:
        for configmap in (c for n, c in of_kind(template(values), "ConfigMap").items() if n.endswith("settings")):
            assert set(configmap["data"]) <= documented, values.name


def test_crds_are_deploys_crds() -> None:
    chart = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert chart == ["gpubudgets.yaml", "gpuclasses.yaml", "gpus.yaml"]
    for name in chart:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "deploy" / "base" / "crds" / name).read_bytes()


# -- generated files -------------------------------------------------------------------------------


def chart_py(what: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HELM": tool("helm")} if what in ("base", "all") else dict(os.environ)
    return run(sys.executable, str(ROOT / "hack" / "chart.py"), what, "--check", check=False, env=env)


@pytest.mark.parametrize("what", ["base", "dashboards", "docs"])
def test_generated_files_are_current(what: str) -> None:
    """deploy/base is the chart rendered (hack/chart.py base); the dashboards' JSON is
    hack/dashboards.py's; docs/operations.md's values table and panel list are values.yaml's and
    the dashboards'. Edit the source, then `make chart-docs`."""
    done = chart_py(what)
    assert done.returncode == 0, done.stderr


def test_every_value_is_documented() -> None:
    """Every leaf of values.yaml (a map under ``settings`` counts as its keys) has a row."""
    documented = {key for key, _, _ in chart_script().values_rows((CHART / "values.yaml").read_text())}

    def leaves(node: Any, prefix: str) -> Iterator[str]:
        if isinstance(node, dict) and node and prefix not in documented:
            for key, sub in node.items():
                yield from leaves(sub, f"{prefix}.{key}" if prefix else key)
        else:
            yield prefix

    missing = [key for key in leaves(yaml.safe_load((CHART / "values.yaml").read_text()), "") if key not in documented]
    assert not missing


# -- alerts ----------------------------------------------------------------------------------------


def rule_groups(values: Path = CLUSTER, **kwargs: Any) -> dict[str, Any]:
    (rule,) = of_kind(template(values, **kwargs), "PrometheusRule").values()
    return {"groups": rule["spec"]["groups"]}


def test_the_alerts_are_the_documented_ones() -> None:
    rules = [r for g in rule_groups()["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", OPERATIONS.read_text(), re.M)
    }  # GitHub's anchors
    for rule in rules:
        assert rule["annotations"]["runbook"] == f"docs/operations.md#{rule['alert'].lower()}"
        assert rule["alert"].lower() in headings, f"no runbook section {rule['alert']} in docs/operations.md"


@pytest.mark.parametrize("values", [CLUSTER, CUSTOM], ids=lambda p: p.name)
def test_promtool_check_rules(values: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_groups(values)))
    done = run(tool("promtool"), "check", "rules", str(rules))
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def test_promtool_test_rules(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    done = run(tool("promtool"), "test", "rules", str(tmp_path / ALERT_TESTS.name), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_two_releases_in_one_prometheus_alert_apart(tmp_path: Path) -> None:
    """Each release's rules read its own namespace and jobs: with one release stalled and one
    healthy, the stalled one fires (two-releases.test.yaml)."""
    (tmp_path / "rules-a.yaml").write_text(yaml.safe_dump(rule_groups()))
    (tmp_path / "rules-b.yaml").write_text(yaml.safe_dump(rule_groups(release="team-b", namespace="team-b")))
    shutil.copy(TWO_RELEASES, tmp_path / TWO_RELEASES.name)
    done = run(tool("promtool"), "test", "rules", str(tmp_path / TWO_RELEASES.name), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_rule_reads_its_own_release_only() -> None:
    for rule in (r for g in rule_groups(release="team-b", namespace="team-b")["groups"] for r in g["rules"]):
        assert 'namespace="team-b"' in rule["expr"], rule["alert"]
        assert 'job="team-b-gpuplane-api"' in rule["expr"] or 'job="team-b-gpuplane-webhook"' in rule["expr"]


def test_every_alert_has_a_test_that_fires_and_one_that_stays_quiet() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        checks = case["alert_rule_test"]
        for name in {c["alertname"] for c in checks}:
            mine = [c for c in checks if c["alertname"] == name]
            (fires if any(c["exp_alerts"] for c in mine) else quiet).add(name)
    assert fires == ALERTS and quiet == ALERTS


# -- metric names: what the dashboards and the alerts query is what /metrics exports -------------

PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: what is left once strings, label matchers,
    ranges, grouping clauses, function calls, numbers and keywords are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\w+", " ", expr)  # Grafana's variables ($__range, $__range_s)
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", expr):
        if not match.group(2) and match.group(1).lower() not in PROMQL_WORDS:
            names.add(match.group(1))
    return names


def test_metric_names_are_found_in_promql() -> None:
    expr = (
        'histogram_quantile(0.99, max by (kind, le) (rate(gpuplane_pass_duration_seconds_bucket{kind="full"}[5m])))'
        " / on (x) group_left (y) b_total offset 5m > bool 1"
    )
    assert metric_names(expr) == {"gpuplane_pass_duration_seconds_bucket", "b_total"}
    assert metric_names("sum(avg_over_time(x[$__range])) * $__range_s / 3600") == {"x"}


def dashboard_queries() -> list[tuple[str, str]]:
    return [
        (f"{path.stem}: {item['title']}", target["expr"])
        for path in DASHBOARDS
        for item in json.loads(path.read_text())["panels"]
        for target in item.get("targets", [])
    ]


def alert_queries() -> list[tuple[str, str]]:
    return [(r["alert"], r["expr"]) for g in rule_groups()["groups"] for r in g["rules"]]


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel's query, as a recording rule, passes promtool's parser (Grafana's variables
    replaced by what they stand for)."""
    rules = [
        {"record": f"gpuplane:panel_{i}", "expr": expr.replace("$__range_s", "86400").replace("$__range", "1d")}
        for i, (_, expr) in enumerate(dashboard_queries())
    ]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in run(tool("promtool"), "check", "rules", str(path)).stdout


def test_every_dashboard_panel_says_what_it_answers() -> None:
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), path.name
        assert board["uid"] == f"gpuplane-{path.stem}"
        for item in board["panels"]:
            if item["type"] != "row":
                assert item["description"].strip() and item["targets"], item["title"]
                assert item["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


SYNC_ROWS = """
from binder.models import SyncStatus
for kind in ("nodes", "gpus"):
    SyncStatus.objects.update_or_create(kind=kind, defaults=dict(listed=3, lag_seconds=0.01, events=5, relists=1))
"""


def _scrape(env: dict[str, str]) -> set[str]:
    """The sample names /metrics of a real web process (gunicorn, deploy/gunicorn.conf.py) serves."""
    port = free_port()
    env = {**env, "GPUPLANE_BIND": f"127.0.0.1:{port}", "GPUPLANE_WEB_WORKERS": "1"}
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "gunicorn"), "-c", "deploy/gunicorn.conf.py", "gpuplane.wsgi"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                    text = response.read().decode()
                break
            except OSError:
                assert server.poll() is None, f"gunicorn exited: {server.stderr.read() if server.stderr else ''}"
                assert time.monotonic() < deadline, "gunicorn did not answer /metrics within 60 s"
                time.sleep(0.3)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def _scrape_webhook_server(env: dict[str, str], var: Path) -> set[str]:
    """The sample names the webhook server's own metrics port (deploy/webhook_server.py) serves,
    after one call, with a serving certificate (its expiry is a series)."""
    from deploy.webhook_certificates import make_ca, make_serving
    from harness import workers

    now = datetime.now(UTC)
    ca, ca_key = make_ca("metrics-test", 2, now)
    cert, key = make_serving(ca, ca_key, ["localhost"], 2, now)
    (var / "tls.crt").write_bytes(cert)
    (var / "tls.key").write_bytes(key)
    port, metrics_port = free_port(), free_port()
    env = {
        **env, "GPUPLANE_CLUSTER": "standalone", "GPUPLANE_WEBHOOK_AUTH": "none",
        "GPUPLANE_TLS_CERT_FILE": str(var / "tls.crt"), "GPUPLANE_TLS_KEY_FILE": str(var / "tls.key"),
        "GPUPLANE_WEBHOOK_METRICS_BIND": f"127.0.0.1:{metrics_port}",
    }  # fmt: skip
    with workers.webhook_server(env, var, scheme="https", probe_http=False, port=port):
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
                    text = response.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "the webhook server's metrics port did not answer within 30 s"
                time.sleep(0.3)
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


#: Series Prometheus makes itself for every target (the webhook's "down" alert reads it).
PROMETHEUS_OWN = {"up"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name a web process exports, on the demo cluster (`manage.py demo`: placed,
    Lost and Pending sets, two weeks of usage), with sync status rows as cluster mode writes them:
    once with no broker (the queue series at 0) and once with a Redis broker that does not
    answer (``gpuplane_broker_up`` 0); and every name the webhook server's metrics port exports."""
    var = tmp_path_factory.mktemp("metrics")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUPLANE_", "CELERY_", "DATABASE_", "DJANGO_"))},
        "DATABASE_URL": f"sqlite:///{var / 'db.sqlite3'}",
        "GPUPLANE_VAR_DIR": str(var),
        "GPUPLANE_METRICS_OPEN": "true",
    }
    run(sys.executable, "manage.py", "demo", cwd=ROOT, env=env, timeout=600)
    run(sys.executable, "manage.py", "shell", "-c", SYNC_ROWS, cwd=ROOT, env=env)
    names = _scrape(env)
    names |= _scrape({**env, "CELERY_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"})
    names |= _scrape_webhook_server(env, var)
    return names


@pytest.mark.parametrize("source", ["dashboards", "alerts"])
def test_every_metric_queried_is_exported(source: str, exported: set[str]) -> None:
    queries = dashboard_queries() if source == "dashboards" else alert_queries()
    assert queries
    missing = {
        f"{where}: {name}"
        for where, expr in queries
        for name in metric_names(expr)
        if name not in exported | PROMETHEUS_OWN
    }
    assert not missing, f"not exported by /metrics: {sorted(missing)}"
    used = {name for _, expr in queries for name in metric_names(expr)} - PROMETHEUS_OWN
    assert used and all(name.startswith("gpuplane_") for name in used)

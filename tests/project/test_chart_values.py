"""The chart's values, each rendered and checked for what it changes: how the apiserver proves
itself to the webhook (``webhook.auth``), which VMIs reach the webhook (``matchConditions``),
priority classes, the apiserver's CIDRs, ``preStop``, the webhook's certificates
(``webhook.certificates``), the values schema, the per-component knobs (securityContext,
topology spread, labels, extra env and volumes, ServiceAccount annotations), the OpenShift
values, the Ingress, NOTES.txt, the CRD upgrade hook and the tenant roles.

helm is built from the Go module pinned in hack/kube (harness/chart_tools.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.chart_tools import CHART, ROOT, chart_script, run, template, tool

CI = CHART / "ci"
CLUSTER, CUSTOM, OPENSHIFT = CI / "cluster-values.yaml", CI / "custom-values.yaml", CI / "openshift-values.yaml"


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def render(*sets: str, values: tuple[Path, ...] = (), **kwargs: Any) -> list[dict[str, Any]]:
    extra: list[str] = []
    for item in sets:
        extra += ["--set", item]
    return template(*values, extra=tuple(extra), **kwargs)


def refused(*sets: str, values: tuple[Path, ...] = ()) -> str:
    """What ``helm template`` says when it refuses the values."""
    args = [tool("helm"), "template", "gpuplane", str(CHART)]
    for path in values:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    done = run(*args, check=False)
    assert done.returncode != 0, f"helm template accepted {sets}"
    return done.stderr


def webhook_container(docs: list[dict[str, Any]], prefix: str = "gpuplane") -> dict[str, Any]:
    spec = of_kind(docs, "Deployment")[f"{prefix}-webhook"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return dict(container)


def pod_spec(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return dict(of_kind(docs, "Deployment")[name]["spec"]["template"]["spec"])


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def all_containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            spec = doc["spec"]["template"]["spec"]
        elif doc["kind"] == "CronJob":
            spec = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        else:
            continue
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        found.extend((f"{doc['kind']} {doc['metadata']['name']}/{c['name']}", c) for c in containers)
    return found


# -- webhook.auth ----------------------------------------------------------------------------------


@pytest.mark.parametrize("auth", ["token", "client-cert", "none"])
def test_webhook_auth_sets_the_env_mounts_and_probes(auth: str) -> None:
    docs = render(f"webhook.auth={auth}")
    container = webhook_container(docs)
    variables = env(container)
    assert variables["GPUPLANE_WEBHOOK_AUTH"] == auth
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(docs, "gpuplane-webhook")["volumes"]}
    if auth == "token":
        assert variables["GPUPLANE_WEBHOOK_TOKEN_FILE"] == "/etc/gpuplane/webhook-token/token"
        assert "/etc/gpuplane/webhook-token" in mounts
        assert volumes["webhook-token"]["secret"]["secretName"] == "gpuplane-webhook-token"
    else:
        assert "GPUPLANE_WEBHOOK_TOKEN_FILE" not in variables and "webhook-token" not in volumes
    if auth == "client-cert":
        assert variables["GPUPLANE_WEBHOOK_CLIENT_CA"] == "/etc/gpuplane/webhook-client-ca/ca.crt"
        assert volumes["webhook-client-ca"]["secret"]["secretName"] == "gpuplane-webhook-client-ca"
        # The server demands a client certificate, which a kubelet probe has not.
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["tcpSocket"] == {"port": "https"} and "httpGet" not in container[probe]
    else:
        assert "GPUPLANE_WEBHOOK_CLIENT_CA" not in variables and "webhook-client-ca" not in volumes
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The settings ConfigMap never carries it: the container's own value would override it.
    settings = of_kind(docs, "ConfigMap")["gpuplane-settings"]["data"]
    assert "GPUPLANE_WEBHOOK_AUTH" not in settings


def test_the_auth_as_a_setting_is_refused_pointing_at_the_value() -> None:
    """What docs/webhook.md used to prescribe for managed clusters, silently overridden before."""
    message = refused("settings.GPUPLANE_WEBHOOK_AUTH=none")
    assert "settings.GPUPLANE_WEBHOOK_AUTH" in message and "webhook.auth" in message


def test_a_bad_auth_is_refused_naming_the_value() -> None:
    message = refused("webhook.auth=tokens")
    assert "/webhook/auth" in message and "'token', 'client-cert', 'none'" in message


# -- which VMIs reach the webhook ------------------------------------------------------------------


def test_only_vmis_naming_gpuplane_devices_are_sent() -> None:
    (hook,) = of_kind(render(), "MutatingWebhookConfiguration")["gpuplane-vmi"]["webhooks"]
    (condition,) = hook["matchConditions"]
    expression = condition["expression"]
    for field in ("object.spec.domain.devices.gpus", "object.spec.domain.devices.hostDevices"):
        assert f"has({field})" in expression
    assert expression.count('startsWith("gpuplane.io/")') == 2
    assert hook["failurePolicy"] == "Fail"
    # matchConditions need 1.28 (beta, on by default).
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.28.0-0"
    done = run(tool("helm"), "template", "gpuplane", str(CHART), "--kube-version", "1.27.9", check=False)
    assert done.returncode != 0 and "kubeVersion" in done.stderr


def test_the_webhook_and_the_binder_run_critical_with_a_quota_that_admits_them() -> None:
    docs = render()
    assert pod_spec(docs, "gpuplane-webhook")["priorityClassName"] == "system-cluster-critical"
    assert pod_spec(docs, "gpuplane-binder")["priorityClassName"] == "system-cluster-critical"
    for name in ("gpuplane-web", "gpuplane-beat", "gpuplane-sync"):
        assert "priorityClassName" not in pod_spec(docs, name)
    quota = of_kind(docs, "ResourceQuota")["gpuplane-critical-pods"]["spec"]
    assert quota["scopeSelector"]["matchExpressions"] == [
        {"operator": "In", "scopeName": "PriorityClass", "values": ["system-cluster-critical"]}
    ]
    plain = render("webhook.priorityClassName=", "binder.priorityClassName=")
    assert not of_kind(plain, "ResourceQuota")
    assert not of_kind(render("criticalPodsQuota=0"), "ResourceQuota")


def test_several_apiserver_cidrs_ipv4_and_ipv6() -> None:
    policy = of_kind(render(), "NetworkPolicy")["gpuplane-webhook-from-apiserver"]["spec"]
    assert policy["ingress"][0]["from"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]
    custom = of_kind(template(CUSTOM, release="site", namespace="gpus"), "NetworkPolicy")
    assert custom["gp-webhook-from-apiserver"]["spec"]["ingress"][0]["from"] == [
        {"ipBlock": {"cidr": "10.0.0.0/16"}}, {"ipBlock": {"cidr": "fd00:10::/64"}},
    ]  # fmt: skip
    # The old single value is refused by name, not dropped.
    assert "apiserverCIDR" in refused("networkPolicy.apiserverCIDR=10.0.0.0/8")
    assert "apiserverCIDRs" in refused("networkPolicy.apiserverCIDRs=null")


def test_prestop_keeps_serving_while_the_endpoints_drop_the_pod() -> None:
    docs = render("webhook.preStopSeconds=15")
    container = webhook_container(docs)
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "15"]
    assert pod_spec(docs, "gpuplane-webhook")["terminationGracePeriodSeconds"] == 45
    web = pod_spec(docs, "gpuplane-web")["containers"][0]
    assert web["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert "lifecycle" not in webhook_container(render("webhook.preStopSeconds=0"))


# -- the values schema -----------------------------------------------------------------------------


def test_a_typo_fails_lint_naming_the_key(tmp_path: Path) -> None:
    typo = tmp_path / "typo.yaml"
    typo.write_text("web_typo:\n  replica: 5\n")
    done = run(tool("helm"), "lint", "--strict", str(CHART), "-f", str(typo), check=False)
    assert done.returncode != 0
    assert "web_typo" in done.stdout + done.stderr
    nested = tmp_path / "nested.yaml"
    nested.write_text("web:\n  replica: 5\n")
    done = run(tool("helm"), "lint", "--strict", str(CHART), "-f", str(nested), check=False)
    assert done.returncode != 0 and "replica" in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("mode=kubernetes", "mode"),
        ("webhook.certificates=vault", "certificates"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("webhook.replicas=two", "replicas"),
        ("settings.lower_case=1", "lower_case"),
    ],
)
def test_the_schema_refuses_bad_values_naming_them(flag: str, named: str) -> None:
    assert named in refused(flag)


def test_values_that_were_silently_dropped_are_now_keys_of_the_chart() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    for key in ("ingress", "priorityClassName", "extraEnv", "podSecurityContext", "securityContext"):
        assert key in schema["properties"], key
    for component in ("web", "webhook", "binder", "beat", "sync"):
        properties = schema["properties"][component]["properties"]
        for key in (
            "priorityClassName", "topologySpreadConstraints", "podLabels", "extraEnv", "extraVolumes",
            "extraVolumeMounts", "podSecurityContext", "securityContext", "serviceAccount",
        ):  # fmt: skip
            assert key in properties, f"{component}.{key}"
        assert schema["properties"][component]["additionalProperties"] is False
    # The user's own maps stay open.
    assert "additionalProperties" not in schema["properties"]["web"]["properties"]["resources"]


def test_the_schema_is_generated_from_the_values_file() -> None:
    """hack/chart.py schema --check fails when values.schema.json is not values.yaml's."""
    done = run(sys.executable, str(ROOT / "hack" / "chart.py"), "schema", "--check", check=False)
    assert done.returncode == 0, done.stderr


def test_a_comment_line_beginning_with_a_flag_continues_the_description() -> None:
    """``# -- `` (with its space) starts a description; a wrapped line that begins with an option
    (``# --create-namespace ...``) is part of the text above it, not a new description."""
    text = (
        "namespace:\n"
        "  # -- Render the namespace. Leave it off with `helm install\n"
        "  # --create-namespace` (then label it yourself).\n"
        "  create: false\n"
    )
    ((key, _, summary, _),) = chart_script().values_docs(text)
    assert (key, summary) == (
        "namespace.create",
        "Render the namespace. Leave it off with `helm install --create-namespace` (then label it yourself).",
    )
    schema = json.loads((CHART / "values.schema.json").read_text())
    description = schema["properties"]["namespace"]["properties"]["create"]["description"]
    assert description.startswith("Render the release's namespace"), description


def test_the_schema_check_fails_on_a_stale_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chart = chart_script()
    values = tmp_path / "values.yaml"
    values.write_text((CHART / "values.yaml").read_text() + "# -- A new value.\nbrandNew: 3\n")
    monkeypatch.setattr(chart, "CHART", tmp_path)
    schema = json.loads(chart.values_schema())
    assert schema["properties"]["brandNew"] == {"type": "integer", "description": "A new value."}
    assert schema != json.loads((CHART / "values.schema.json").read_text())


# -- securityContext, OpenShift, per-component extras -------------------------------------------------


def test_openshift_values_unset_the_fixed_ids_and_keep_restricted() -> None:
    docs = template(OPENSHIFT)
    checked = 0
    for doc in docs:
        if doc["kind"] not in ("Deployment", "Job", "CronJob"):
            continue
        spec = (
            doc["spec"]["template"]["spec"]
            if doc["kind"] != "CronJob"
            else doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        )
        context = spec["securityContext"]
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(context), doc["metadata"]["name"]
        assert context["runAsNonRoot"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}
        checked += 1
    assert checked >= 6  # five Deployments and the certificate Job and CronJob
    for where, container in all_containers(docs):
        assert "runAsUser" not in container["securityContext"], where
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}, where
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
    # The defaults keep the image's IDs.
    default = pod_spec(render(), "gpuplane-web")["securityContext"]
    assert (default["runAsUser"], default["runAsGroup"], default["fsGroup"]) == (10001, 10001, 10001)


def test_custom_values_reach_each_component() -> None:
    docs = template(CUSTOM, release="site", namespace="gpus")
    for where, container in all_containers(docs):
        if where.startswith("Deployment"):
            variables = env(container)
            assert variables["PGSSLROOTCERT"] == "/etc/gpuplane/postgres-ca/ca.crt", where
            assert {"name": "postgres-ca", "mountPath": "/etc/gpuplane/postgres-ca", "readOnly": True} in container[
                "volumeMounts"
            ], where
    for name, deployment in of_kind(docs, "Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        assert {"name": "postgres-ca", "configMap": {"name": "postgres-ca"}} in spec["volumes"], name
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["team"] == "platform", name
        expected = {"gp-webhook": "gpuplane-critical", "gp-binder": "system-cluster-critical"}.get(
            name, "gpuplane-default"
        )
        assert spec["priorityClassName"] == expected, name
    webhook = pod_spec(docs, "gp-webhook")
    assert of_kind(docs, "Deployment")["gp-webhook"]["spec"]["template"]["metadata"]["labels"]["tier"] == "admission"
    assert env(webhook["containers"][0])["GPUPLANE_WEBHOOK_THREADS"] == "24"
    assert webhook["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert "GPUPLANE_WEBHOOK_THREADS" not in env(pod_spec(docs, "gp-web")["containers"][0])
    account = of_kind(docs, "ServiceAccount")["gp-webhook"]
    assert account["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/gpuplane-webhook"
    }
    assert "annotations" not in of_kind(docs, "ServiceAccount")["gp-web"]["metadata"]
    sync = pod_spec(docs, "gp-sync")
    assert sync["securityContext"]["runAsUser"] == 20002 and sync["securityContext"]["runAsNonRoot"] is True
    assert pod_spec(docs, "gp-web")["securityContext"]["runAsUser"] == 10001


def test_the_ingress_fronts_the_api_and_its_hosts_are_allowed() -> None:
    docs = template(CUSTOM, release="site", namespace="gpus")
    ingress = of_kind(docs, "Ingress")["gp"]
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "HTTPS"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "gpuplane.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": "gp-api", "port": {"name": "https"}}
    hosts = of_kind(docs, "ConfigMap")["gp-settings"]["data"]["DJANGO_ALLOWED_HOSTS"].split(",")
    assert hosts.count("gpuplane.example.com") == 1
    assert not of_kind(render(), "Ingress")
    assert "ingress.hosts" in refused("ingress.enabled=true")


def test_notes_say_what_to_check_next() -> None:
    done = run(tool("helm"), "install", "gpuplane", str(CHART), "--dry-run=client", "--namespace", "gpuplane-system")
    notes = done.stdout[done.stdout.index("NOTES:") :]
    assert "kubectl -n gpuplane-system get secret gpuplane-secrets" in notes
    assert "rollout status deploy/gpuplane-beat" in notes
    assert "get cronjob gpuplane-certificates" in notes
    assert "kubectl get mutatingwebhookconfiguration gpuplane-vmi" in notes
    assert "no ServiceMonitor was rendered" in notes


# -- certificates ----------------------------------------------------------------------------------


def test_cert_manager_gets_an_issuer_and_a_certificate_the_injection_names() -> None:
    docs = render("webhook.certificates=cert-manager")
    issuers, certificates = of_kind(docs, "Issuer"), of_kind(docs, "Certificate")
    certificate = certificates["gpuplane-webhook"]
    assert certificate["spec"]["secretName"] == "gpuplane-webhook-tls"
    assert "gpuplane-webhook.gpuplane-system.svc" in certificate["spec"]["dnsNames"]
    assert "isCA" not in certificate["spec"] and certificate["spec"]["privateKey"]["rotationPolicy"] == "Always"
    # Signed by a CA of the chart's (itself made by the self-signed Issuer), not self-signed: the
    # caBundle the cainjector copies (the Secret's ca.crt) is that CA, the same after a renewal.
    assert certificate["spec"]["issuerRef"] == {"kind": "Issuer", "name": "gpuplane-ca"}
    ca_secret = issuers["gpuplane-ca"]["spec"]["ca"]["secretName"]
    (ca,) = [c for c in certificates.values() if c["spec"]["secretName"] == ca_secret]
    assert ca["spec"]["isCA"] is True and ca["spec"]["duration"] == "87600h"
    assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never"  # serving pairs it signed stay valid
    assert ca["spec"]["issuerRef"] == {"kind": "Issuer", "name": "gpuplane-selfsigned"}
    assert issuers["gpuplane-selfsigned"]["spec"] == {"selfSigned": {}}
    assert set(issuers) == {"gpuplane-selfsigned", "gpuplane-ca"} and len(certificates) == 2
    configuration = of_kind(docs, "MutatingWebhookConfiguration")["gpuplane-vmi"]
    # The cainjector reads a Certificate, not a Secret.
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "gpuplane-system/gpuplane-webhook"
    }
    assert "caBundle" not in configuration["webhooks"][0]["clientConfig"]
    assert set(of_kind(docs, "Job")) == {"gpuplane-crds"} and not of_kind(docs, "CronJob")
    theirs = render("webhook.certificates=cert-manager", "webhook.certManager.issuerRef.kind=ClusterIssuer",
                    "webhook.certManager.issuerRef.name=corp-ca")  # fmt: skip
    assert not of_kind(theirs, "Issuer")
    assert set(of_kind(theirs, "Certificate")) == {"gpuplane-webhook"}
    assert of_kind(theirs, "Certificate")["gpuplane-webhook"]["spec"]["issuerRef"] == {
        "kind": "ClusterIssuer", "name": "corp-ca",
    }  # fmt: skip


def test_the_self_signed_job_runs_in_the_image_before_and_after_and_every_day() -> None:
    docs = render()
    job = of_kind(docs, "Job")["gpuplane-certificates"]
    hooks = job["metadata"]["annotations"]["helm.sh/hook"].split(",")
    assert set(hooks) == {"pre-install", "pre-upgrade", "post-install", "post-upgrade"}
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/gpuplane/gpuplane:0.1.0"
    command = container["command"]
    assert command[:2] == ["python", "deploy/webhook_certificates.py"]
    assert command[command.index("--webhook") + 1] == "gpuplane-vmi"
    assert command[command.index("--secret") + 1] == "gpuplane-webhook-tls"
    cron = of_kind(docs, "CronJob")["gpuplane-certificates"]
    assert cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["command"] == command
    assert cron["spec"]["schedule"] == "17 3 * * *"
    # The hook's account may touch the two Secrets and this release's registration only.
    role = of_kind(docs, "ClusterRole")["gpuplane-certificates-hook"]
    assert role["rules"] == [{
        "apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
        "resourceNames": ["gpuplane-vmi"], "verbs": ["get", "patch"],
    }]  # fmt: skip
    secrets = of_kind(docs, "Role")["gpuplane-certificates"]["rules"]
    names = ["gpuplane-webhook-tls", "gpuplane-webhook-ca"]
    assert {"apiGroups": [""], "resources": ["secrets"], "resourceNames": names, "verbs": ["get", "patch"]} in secrets
    assert (
        "caBundle" not in of_kind(docs, "MutatingWebhookConfiguration")["gpuplane-vmi"]["webhooks"][0]["clientConfig"]
    )
    assert "renewBeforeDays" in refused("webhook.selfSigned.renewBeforeDays=400")


def test_manual_certificates_need_the_ca_bundle() -> None:
    message = refused("webhook.certificates=manual")
    assert "webhook.caBundle" in message
    # A caBundle of an earlier install (the default was manual then) is not silently dropped.
    message = refused("webhook.caBundle=Q0E=")
    assert "webhook.caBundle is set but webhook.certificates is self-signed-job" in message
    docs = render("webhook.certificates=manual", "webhook.caBundle=Q0E=")
    assert (
        of_kind(docs, "MutatingWebhookConfiguration")["gpuplane-vmi"]["webhooks"][0]["clientConfig"]["caBundle"]
        == "Q0E="
    )
    assert set(of_kind(docs, "Job")) == {"gpuplane-crds"} and not of_kind(docs, "Certificate")


# -- upgrades --------------------------------------------------------------------------------------


def test_the_crds_are_upgraded_by_a_pre_upgrade_hook_in_the_image() -> None:
    docs = render()
    job = of_kind(docs, "Job")["gpuplane-crds"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "deploy/apply_crds.py", "/etc/gpuplane/crds"]
    carried = of_kind(docs, "ConfigMap")["gpuplane-crds"]["data"]
    assert {k: yaml.safe_load(v) for k, v in carried.items()} == {
        p.name: yaml.safe_load(p.read_text()) for p in (CHART / "crds").glob("*.yaml")
    }
    (rule,) = of_kind(docs, "ClusterRole")["gpuplane-crds"]["rules"]
    assert rule["resourceNames"] == ["gpubudgets.gpuplane.io", "gpuclasses.gpuplane.io", "gpus.gpuplane.io"]
    assert rule["verbs"] == ["get", "patch"]
    assert not of_kind(render("crds.upgrade=false"), "Job").get("gpuplane-crds")


def test_the_namespace_is_kept_on_uninstall() -> None:
    (namespace,) = of_kind(render("namespace.create=true"), "Namespace").values()
    assert namespace["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_tenants_get_gpus_and_budgets_through_the_built_in_roles() -> None:
    roles = of_kind(render(), "ClusterRole")
    edit, view = roles["gpuplane-tenant-edit"], roles["gpuplane-tenant-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["rules"] == [{"apiGroups": ["gpuplane.io"], "resources": ["gpus"], "verbs": ["create", "delete"]}]
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert view["rules"] == [
        {"apiGroups": ["gpuplane.io"], "resources": ["gpus", "gpubudgets"], "verbs": ["get", "list", "watch"]}
    ]


# -- monitoring where the Prometheus Operator is ----------------------------------------------------


def test_monitoring_renders_where_the_api_is_served() -> None:
    def kinds(*extra: str) -> set[str]:
        done = run(tool("helm"), "template", "gpuplane", str(CHART), *extra)
        return {d["kind"] for d in yaml.safe_load_all(done.stdout) if d}

    assert not kinds() & {"ServiceMonitor", "PrometheusRule"}
    served = (
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
    )
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds(*served)
    assert not kinds(
        *served, "--set", "metrics.serviceMonitor.enabled=false", "--set", "metrics.prometheusRule.enabled=false"
    ) & {
        "ServiceMonitor",
        "PrometheusRule",
    }


def test_the_webhook_server_is_scraped_on_its_own_port() -> None:
    docs = template(CLUSTER)
    monitors = of_kind(docs, "ServiceMonitor")
    (endpoint,) = monitors["gpuplane-webhook"]["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["scheme"]) == ("metrics", "/metrics", "http")
    service = of_kind(docs, "Service")["gpuplane-webhook"]
    assert {"name": "metrics", "port": 9102, "targetPort": "metrics", "protocol": "TCP"} in service["spec"]["ports"]
    container = webhook_container(docs)
    assert env(container)["GPUPLANE_WEBHOOK_METRICS_BIND"] == "0.0.0.0:9102"
    assert {"name": "metrics", "containerPort": 9102} in container["ports"]
    policy = of_kind(docs, "NetworkPolicy")["gpuplane-webhook-from-apiserver"]["spec"]["ingress"]
    assert policy[1]["ports"] == [{"protocol": "TCP", "port": 9102}]


def test_the_lint_of_every_mode_stays_clean() -> None:
    for flags in (
        ("--set", "webhook.auth=client-cert"),
        ("--set", "webhook.auth=none"),
        ("--set", "webhook.certificates=cert-manager"),
    ):
        done = run(tool("helm"), "lint", "--strict", str(CHART), *flags)
        assert "0 chart(s) failed" in done.stdout

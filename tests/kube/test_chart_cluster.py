"""The Helm chart against a real control plane (etcd, kube-apiserver, kube-controller-manager): the
rendered chart applied server-side (the CRDs for real, the rest with ``--dry-run=server``, so the
apiserver validates every object as it would store it), and ``helm install``, ``upgrade`` and
``uninstall`` leaving no object of the release behind (the CRDs stay, as Helm keeps them; so does
the Namespace a release renders with ``namespace.create``).

The control plane is the session fixture ``control_plane`` (tests/conftest.py, harness/
controlplane.py; ``.kubeconfig()`` is the admin's kubeconfig). The Prometheus
Operator's kinds (ServiceMonitor, PrometheusRule) are left out here: their CRDs are not part of
this control plane; tests/project/test_chart.py checks them with promtool and by rendering.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.chart_tools import CHART, run, template_text, tool

# The certificate and the CRD upgrade by hand here: their hook Jobs would wait for a kubelet
# (tests/kube/test_chart_install.py runs them).
CLUSTER_VALUES = (
    "--set-string", "webhook.caBundle=LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==",
    "--set", "webhook.certificates=manual", "--set", "crds.upgrade=false",
)  # fmt: skip
CRD_NAMES = ("gpuclasses.gpuplane.io", "gpus.gpuplane.io", "gpubudgets.gpuplane.io")
#: Every kind the chart renders outside monitoring.coreos.com, for the stray-object check.
KINDS = (
    "deployments,replicasets,pods,services,configmaps,serviceaccounts,networkpolicies,poddisruptionbudgets,"
    "clusterroles,clusterrolebindings,mutatingwebhookconfigurations,mutatingadmissionpolicies,"
    "mutatingadmissionpolicybindings,validatingadmissionpolicies,validatingadmissionpolicybindings,namespaces,"
    "resourcequotas,jobs,cronjobs,roles,rolebindings,ingresses"
)
#: API groups this control plane does not serve (their CRDs are the Prometheus Operator's and
#: cert-manager's): left out of the server-side dry run, checked by rendering.
NOT_SERVED = ("monitoring.coreos.com", "cert-manager.io")


@pytest.fixture(scope="module")
def kubeconfig(request: pytest.FixtureRequest) -> str:
    try:
        plane = request.getfixturevalue("control_plane")
    except pytest.FixtureLookupError:
        pytest.skip("no control_plane fixture (harness/controlplane/) in this tree")
    kubeconfig = plane.kubeconfig  # a method of the admin identity (harness/controlplane/)
    return str(kubeconfig() if callable(kubeconfig) else kubeconfig)


def kubectl(kubeconfig: str, *args: str, check: bool = True, stdin: str | None = None) -> str:
    return run(tool("kubectl"), "--kubeconfig", kubeconfig, *args, check=check, input=stdin).stdout


def helm(kubeconfig: str, home: Path, *args: str, check: bool = True) -> str:
    env = {
        **os.environ,
        "KUBECONFIG": kubeconfig,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    return run(tool("helm"), *args, check=check, env=env, timeout=600).stdout


def without_monitoring(text: str) -> str:
    docs = [d for d in yaml.safe_load_all(text) if d and d["apiVersion"].split("/")[0] not in NOT_SERVED]
    return yaml.safe_dump_all(docs)


def apply_crds(kubeconfig: str) -> None:
    kubectl(kubeconfig, "apply", "--server-side", "-f", str(CHART / "crds"))
    kubectl(kubeconfig, "wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{n}" for n in CRD_NAMES))


@pytest.mark.parametrize("mode", ["cluster", "standalone", "custom"])
def test_the_rendered_chart_applies_server_side(kubeconfig: str, mode: str) -> None:
    """The CRDs applied for real; everything else (the namespace of ci/custom-values.yaml
    included) as a server-side dry run."""
    apply_crds(kubeconfig)
    # A release of its own: deploy/'s RBAC (gpuplane-*) is installed on this control plane for real.
    namespace, release = f"chart-dry-{mode}", "dry-gpuplane"
    prefix = "gp" if mode == "custom" else release
    extra = {
        "cluster": CLUSTER_VALUES,
        "standalone": ("--set", "mode=standalone"),
        "custom": ("-f", str(CHART / "ci" / "custom-values.yaml")),
    }[mode]
    if mode != "custom":  # custom-values.yaml renders its namespace itself
        kubectl(kubeconfig, "create", "namespace", namespace, check=False)
    rendered = template_text(
        release=release, namespace=namespace, extra=(*extra, "--set", "metrics.dashboards.enabled=true")
    )
    docs = without_monitoring(rendered)
    if mode == "custom":  # the dry run of the Namespace does not create it: create it, then the rest
        kubectl(kubeconfig, "create", "namespace", "monitoring", check=False)  # the dashboards' namespace
        kubectl(kubeconfig, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(next(
            d for d in yaml.safe_load_all(docs) if d["kind"] == "Namespace"
        )))  # fmt: skip
    out = kubectl(kubeconfig, "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=docs)
    applied = {line.split(" ")[0] for line in out.splitlines() if line.strip()}
    expected_deployments = {"web", "binder", "beat"} | ({"webhook", "sync"} if mode != "standalone" else set())
    assert {f"deployment.apps/{prefix}-{c}" for c in expected_deployments} <= applied, out
    if mode != "standalone":
        assert f"mutatingwebhookconfiguration.admissionregistration.k8s.io/{prefix}-vmi" in applied, out
        assert f"clusterrole.rbac.authorization.k8s.io/{prefix}-binder" in applied, out


def leftovers(kubeconfig: str, release: str) -> list[str]:
    selector = f"app.kubernetes.io/instance={release}"
    out = kubectl(kubeconfig, "get", KINDS, "-A", "-l", selector, "-o", "name")
    return [line for line in out.splitlines() if line.strip()]


def test_helm_install_upgrade_and_uninstall_leave_no_stray_objects(kubeconfig: str, tmp_path: Path) -> None:
    release, namespace = "chart-gpuplane", "chart-helm"
    base = ("--namespace", namespace, *CLUSTER_VALUES, "--set", "metrics.dashboards.enabled=true")
    try:
        install_upgrade_uninstall(kubeconfig, tmp_path, release, namespace, base)
    finally:  # a failed test must not leave a webhook (failurePolicy Fail) refusing VMIs
        helm(kubeconfig, tmp_path, "uninstall", release, "--namespace", namespace, "--ignore-not-found", check=False)


def install_upgrade_uninstall(
    kubeconfig: str, tmp_path: Path, release: str, namespace: str, base: tuple[str, ...]
) -> None:
    helm(kubeconfig, tmp_path, "install", release, str(CHART), "--create-namespace", *base)
    status = json.loads(helm(kubeconfig, tmp_path, "status", release, "--namespace", namespace, "-o", "json"))
    assert status["info"]["status"] == "deployed"
    for name in CRD_NAMES:  # installed from crds/ (or already there)
        kubectl(kubeconfig, "get", "crd", name)
    settings: dict[str, Any] = json.loads(
        kubectl(kubeconfig, "-n", namespace, "get", "configmap", f"{release}-settings", "-o", "json")
    )
    assert settings["data"]["GPUPLANE_DEFAULT_BUDGET"] == "unlimited"
    before = json.loads(kubectl(kubeconfig, "-n", namespace, "get", "deployment", f"{release}-web", "-o", "json"))

    helm(
        kubeconfig, tmp_path, "upgrade", release, str(CHART), *base,
        "--set-string", "settings.GPUPLANE_DEFAULT_BUDGET=deny", "--set", "web.replicas=3",
        "--set", "podDisruptionBudget.enabled=false",
    )  # fmt: skip
    settings = json.loads(kubectl(kubeconfig, "-n", namespace, "get", "configmap", f"{release}-settings", "-o", "json"))
    assert settings["data"]["GPUPLANE_DEFAULT_BUDGET"] == "deny"
    after = json.loads(kubectl(kubeconfig, "-n", namespace, "get", "deployment", f"{release}-web", "-o", "json"))
    assert after["spec"]["replicas"] == 3
    checksum = "checksum/settings"
    assert (
        after["spec"]["template"]["metadata"]["annotations"][checksum]
        != before["spec"]["template"]["metadata"]["annotations"][checksum]
    )
    # Turned off in the upgrade: gone at once.
    assert "poddisruptionbudget" not in " ".join(leftovers(kubeconfig, release))

    installed = leftovers(kubeconfig, release)  # the check below sees the release's objects
    for name in ("web", "webhook", "binder", "beat", "sync"):
        assert f"deployment.apps/{release}-{name}" in installed, installed
    assert f"clusterrole.rbac.authorization.k8s.io/{release}-sync" in installed, installed
    assert f"mutatingwebhookconfiguration.admissionregistration.k8s.io/{release}-vmi" in installed, installed
    # finalizerPolicy.enabled=auto, and this apiserver serves MutatingAdmissionPolicy v1.
    policy = f"admissionregistration.k8s.io/{release}-release-finalizer"
    assert f"mutatingadmissionpolicy.{policy}" in installed, installed
    assert f"mutatingadmissionpolicybinding.{policy}" in installed, installed

    helm(kubeconfig, tmp_path, "uninstall", release, "--namespace", namespace, "--wait")
    deadline = time.monotonic() + 90  # ReplicaSets and pods go with the garbage collector
    while (left := leftovers(kubeconfig, release)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"left behind by helm uninstall: {left}"
    assert not kubectl(kubeconfig, "-n", namespace, "get", "secrets", "-l", "owner=helm", "-o", "name").strip()
    for name in CRD_NAMES:  # kept, as Helm keeps crds/: deleting them would delete every GPU
        kubectl(kubeconfig, "get", "crd", name)


def test_the_namespace_the_release_renders_is_kept_on_uninstall(kubeconfig: str, tmp_path: Path) -> None:
    """``namespace.create``: the release owns its Namespace (Helm creates it, the chart's own then
    gives it the Pod Security labels) and ``helm uninstall`` keeps it (``helm.sh/resource-policy:
    keep``), and with it the Secrets created there, while every other object of the release goes."""
    release, namespace = "chart-ns-gpuplane", "chart-ns"
    base = ("--namespace", namespace, *CLUSTER_VALUES, "--set", "namespace.create=true")
    try:
        helm(kubeconfig, tmp_path, "install", release, str(CHART), "--create-namespace", *base)
        owned = json.loads(kubectl(kubeconfig, "get", "namespace", namespace, "-o", "json"))["metadata"]
        assert owned["annotations"]["meta.helm.sh/release-name"] == release, owned
        assert owned["annotations"]["helm.sh/resource-policy"] == "keep", owned
        assert owned["labels"]["pod-security.kubernetes.io/enforce"] == "restricted", owned
        kubectl(kubeconfig, "-n", namespace, "create", "secret", "generic", "gpuplane-secrets",
                "--from-literal=DJANGO_SECRET_KEY=test-only")  # fmt: skip

        out = helm(kubeconfig, tmp_path, "uninstall", release, "--namespace", namespace, "--wait")
        assert "kept due to the resource policy" in out and f"[Namespace] {namespace}" in out, out
        deadline = time.monotonic() + 90
        while (left := leftovers(kubeconfig, release)) != [f"namespace/{namespace}"] and time.monotonic() < deadline:
            time.sleep(1)
        assert left == [f"namespace/{namespace}"], f"left behind by helm uninstall: {left}"
        kept = json.loads(kubectl(kubeconfig, "get", "namespace", namespace, "-o", "json"))
        assert kept["status"]["phase"] == "Active" and "deletionTimestamp" not in kept["metadata"], kept
        kubectl(kubeconfig, "-n", namespace, "get", "secret", "gpuplane-secrets")
    finally:
        helm(kubeconfig, tmp_path, "uninstall", release, "--namespace", namespace, "--ignore-not-found", check=False)
        kubectl(kubeconfig, "delete", "namespace", namespace, "--ignore-not-found", "--wait=false", check=False)

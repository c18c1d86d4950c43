"""docs/operations.md's "Install with Helm" against a real apiserver, then an upgrade with a changed
CRD, a rollback and an uninstall, as "Upgrade, rollback and version skew" says.

The install block is run by bash as written, with two substitutions: the release and namespace
(``gpuplane``/``gpuplane-system`` are deploy/'s on this control plane, installed by
harness/controlplane/) become ``docs``/``docs-system``, and ``/secure/`` (the operator's
secret store) a directory of the test's. No kubelet and no controllers but the namespace and
garbage-collector ones run here, so harness/chart_cluster.py's HookRunner does their part:
it runs each hook Job's command (the image's ``python``, this checkout) as the Job's
ServiceAccount and marks the Job complete, and reports the Deployments rolled out. What the
hooks do to the cluster (Secrets, the caBundle, the CRDs) is real and checked.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509 import verification

from harness.chart_cluster import helm_env, hooks_run, secret_data, tools_on_path
from harness.chart_tools import CHART, ROOT, run, tool
from harness.controlplane import ControlPlane

RELEASE, NAMESPACE = "docs", "docs-system"
PREFIX = f"{RELEASE}-gpuplane"
OPERATIONS = ROOT / "docs" / "operations.md"
GPUS_CRD = "gpus.gpuplane.io"


def install_block() -> str:
    text = OPERATIONS.read_text()
    section = text[text.index("## Install with Helm") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None
    return block.group(1)


def docs_script(secure: Path) -> str:
    script = install_block()
    assert "helm install gpuplane charts/gpuplane --namespace gpuplane-system" in script
    script = script.replace("gpuplane-system", NAMESPACE).replace("helm install gpuplane ", f"helm install {RELEASE} ")
    script = script.replace("deploy/gpuplane-", f"deploy/{PREFIX}-").replace("/secure/", f"{secure}/")
    return "set -euo pipefail\n" + script


def kubectl(kubeconfig: str, *args: str, check: bool = True) -> str:
    return run(tool("kubectl"), "--kubeconfig", kubeconfig, *args, check=check).stdout


def helm(kubeconfig: str, home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(tool("helm"), *args, check=check, env=helm_env(kubeconfig, home), timeout=600)


def changed_chart(directory: Path) -> Path:
    """The chart with one more printer column on the GPU CRD: an upgrade's changed CRD."""
    copy = directory / "gpuplane"
    shutil.copytree(CHART, copy)
    path = copy / "crds" / "gpus.yaml"
    crd = yaml.safe_load(path.read_text())
    crd["spec"]["versions"][0].setdefault("additionalPrinterColumns", []).append(
        {"name": "Upgraded", "type": "string", "jsonPath": ".metadata.uid", "priority": 1}
    )
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    return copy


def columns(plane: ControlPlane) -> list[str]:
    crd = plane.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{GPUS_CRD}")
    return [c["name"] for c in crd["spec"]["versions"][0].get("additionalPrinterColumns", [])]


def ca_bundle(plane: ControlPlane) -> bytes:
    configuration = plane.request(
        "GET", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{PREFIX}-vmi"
    )
    return base64.b64decode(configuration["webhooks"][0]["clientConfig"].get("caBundle", ""))


def check_serving(plane: ControlPlane) -> x509.Certificate:
    """The serving pair in the Secret verifies, for the Service's name, against the caBundle the
    registration holds: what the apiserver will check."""
    tls = secret_data(plane, NAMESPACE, f"{PREFIX}-webhook-tls")
    cert = x509.load_pem_x509_certificate(tls["tls.crt"])
    store = verification.Store(x509.load_pem_x509_certificates(ca_bundle(plane)))
    name = x509.DNSName(f"{PREFIX}-webhook.{NAMESPACE}.svc")
    verification.PolicyBuilder().store(store).build_server_verifier(name).verify(cert, [])
    return cert


@pytest.fixture
def cleanup(control_plane: ControlPlane, tmp_path: Path) -> Any:
    kubeconfig = str(control_plane.kubeconfig())
    yield kubeconfig
    helm(kubeconfig, tmp_path, "uninstall", RELEASE, "--namespace", NAMESPACE, "--ignore-not-found", check=False)
    # The GPU CRD as the session installed it (the upgrade changed it).
    run(
        sys.executable, str(ROOT / "deploy" / "apply_crds.py"), str(CHART / "crds"), "--field-manager", "gpuplane-crds",
        check=False, env=helm_env(kubeconfig, tmp_path),
    )  # fmt: skip
    kubectl(kubeconfig, "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)


@pytest.mark.slow
def test_install_as_documented_upgrade_rollback_uninstall(
    control_plane: ControlPlane, cleanup: str, tmp_path: Path
) -> None:
    kubeconfig = cleanup
    plane = control_plane
    secure = tmp_path / "secure"
    secure.mkdir()
    (secure / "gpuplane.env").write_text(
        "DATABASE_URL=postgres://gpuplane:x@db.example:5432/gpuplane\nCELERY_BROKER_URL=redis://redis.example:6379/0\n"
        "DJANGO_SECRET_KEY=test-only-secret\nGPUPLANE_METRICS_TOKEN=test-only-metrics\n"
    )
    (secure / "apiserver-token").write_text("t" * 40 + "\n")
    env = {**helm_env(kubeconfig, tmp_path), **tools_on_path(tmp_path / "bin")}

    # -- install: the documented block ---------------------------------------------------------
    with hooks_run(plane, NAMESPACE, RELEASE, tmp_path / "hooks", roll_out=True) as hooks:
        done = subprocess.run(
            ["bash", "-c", docs_script(secure)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
            check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NOTES:" in done.stdout and "What to check next" in done.stdout
    # The certificate Job ran before and after the install, as its own ServiceAccount.
    assert [(name, code) for name, code, _ in hooks.ran] == [(f"{PREFIX}-certificates", 0)] * 2, hooks.ran
    assert "made" in hooks.ran[0][2] and "not there yet" in hooks.ran[0][2]
    assert "caBundle set" in hooks.ran[1][2]
    first = check_serving(plane)
    # No ServiceMonitor or PrometheusRule: this cluster serves no monitoring.coreos.com.
    manifest = helm(kubeconfig, tmp_path, "get", "manifest", RELEASE, "--namespace", NAMESPACE).stdout
    assert "kind: ServiceMonitor" not in manifest and "kind: PrometheusRule" not in manifest
    assert "kind: MutatingWebhookConfiguration" in manifest

    # -- upgrade with a changed CRD ------------------------------------------------------------
    assert "Upgraded" not in columns(plane)
    chart = changed_chart(tmp_path / "next")
    with hooks_run(plane, NAMESPACE, RELEASE, tmp_path / "hooks-upgrade", roll_out=True) as hooks:
        helm(
            kubeconfig, tmp_path, "upgrade", RELEASE, str(chart), "--namespace", NAMESPACE,
            "--set-string", "settings.GPUPLANE_DEFAULT_BUDGET=deny",
        )  # fmt: skip
    ran = [(name, code) for name, code, _ in hooks.ran]
    assert ran[0] == (f"{PREFIX}-crds", 0), hooks.ran  # weight -20: before the certificates (-10)
    assert sorted(ran[1:]) == [(f"{PREFIX}-certificates", 0)] * 2, hooks.ran
    assert "Upgraded" in columns(plane)
    assert "3 CRDs Established" in hooks.ran[0][2]
    # The certificate is current: kept, and still what the registration trusts.
    assert check_serving(plane).serial_number == first.serial_number
    settings = plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/{PREFIX}-settings")
    assert settings["data"]["GPUPLANE_DEFAULT_BUDGET"] == "deny"

    # -- rollback: the previous manifests (the CRDs and the schema stay as upgraded) ------------
    helm(kubeconfig, tmp_path, "rollback", RELEASE, "1", "--namespace", NAMESPACE)
    settings = plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/{PREFIX}-settings")
    assert settings["data"]["GPUPLANE_DEFAULT_BUDGET"] == "unlimited"
    assert "Upgraded" in columns(plane)
    check_serving(plane)

    # -- uninstall: the release's objects go; the Namespace, your Secrets and the CRDs stay ------
    helm(kubeconfig, tmp_path, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
    deadline = time.monotonic() + 90
    while True:
        left = kubectl(
            kubeconfig, "get", "deployments,services,configmaps,serviceaccounts,cronjobs,jobs,roles,rolebindings,"
            "clusterroles,clusterrolebindings,mutatingwebhookconfigurations,resourcequotas,networkpolicies",
            "-A", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name",
        ).split()  # fmt: skip
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not left, left
    assert plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}")["status"]["phase"] == "Active"
    for secret in ("gpuplane-secrets", "gpuplane-webhook-token"):
        plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{secret}")
    plane.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{GPUS_CRD}")

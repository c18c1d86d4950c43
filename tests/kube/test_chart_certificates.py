"""The chart's self-signed certificates against a real apiserver: ``deploy/webhook_certificates.py``
run as the CronJob's ServiceAccount with the RBAC the chart renders for it (applied for real),
against the chart's own registration.

A first run makes the CA and the serving pair and fills the caBundle; a run while the pair is
current keeps everything; a run once fewer than ``--renew-days`` are left (here: a renewal window
longer than what is left) renews the pair with the same CA, so the caBundle does not change and
the apiserver trusts the new pair at once. The account reads and writes those two Secrets and
that registration only.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509 import verification

from harness.chart_cluster import ROOT, render, secret_data, service_account_kubeconfig
from harness.controlplane import ControlPlane

RELEASE = "certs"
PREFIX = f"{RELEASE}-gpuplane"
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")


def command(docs: list[dict[str, Any]]) -> list[str]:
    (cron,) = [d for d in docs if d["kind"] == "CronJob"]
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return list(container["command"])


def with_option(argv: list[str], option: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(option) + 1] = value
    return argv


def run_as(kubeconfig: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(kubeconfig)
    assert argv[0] == "python"
    return subprocess.run(
        [sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def bundle(plane: ControlPlane) -> bytes:
    configuration = plane.request(
        "GET", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{PREFIX}-vmi"
    )
    return base64.b64decode(configuration["webhooks"][0]["clientConfig"]["caBundle"])


def verified(plane: ControlPlane, namespace: str) -> x509.Certificate:
    """The serving pair, checked as the apiserver checks it: against the registration's caBundle,
    for the Service's name."""
    cert = x509.load_pem_x509_certificate(secret_data(plane, namespace, f"{PREFIX}-webhook-tls")["tls.crt"])
    store = verification.Store(x509.load_pem_x509_certificates(bundle(plane)))
    name = x509.DNSName(f"{PREFIX}-webhook.{namespace}.svc")
    verification.PolicyBuilder().store(store).build_server_verifier(name).verify(cert, [])
    return cert


@dataclass
class Installed:
    plane: ControlPlane
    namespace: str
    docs: list[dict[str, Any]]
    kubeconfig: Path


@pytest.fixture
def installed(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Installed]:
    """The chart's registration and the certificate account's RBAC, applied for real, in a
    namespace of the test's own (a deleted one lingers while the namespace controller empties it)."""
    plane = control_plane
    namespace = f"chart-certs-{os.urandom(3).hex()}"
    docs = render(RELEASE, namespace)
    plane.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    )
    applied = [
        d
        for d in docs
        if (d["kind"] in RBAC_KINDS and d["metadata"]["name"] == f"{PREFIX}-certificates")
        or d["kind"] == "MutatingWebhookConfiguration"
    ]
    for doc in applied:
        if doc["kind"] == "MutatingWebhookConfiguration":
            # Nothing serves it here: no VMI of another test may be sent to it.
            doc["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"no-such-namespace": "true"}}
        plane.apply(doc)
    kubeconfig = service_account_kubeconfig(plane, namespace, f"{PREFIX}-certificates", tmp_path)
    yield Installed(plane, namespace, docs, kubeconfig)
    for doc in reversed(applied):
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration"):
            plane.request("DELETE", _cluster_path(doc))
    plane.request("DELETE", f"/api/v1/namespaces/{namespace}")


def _cluster_path(doc: dict[str, Any]) -> str:
    group = {
        "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        "MutatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
    }[doc["kind"]]
    return f"{group}/{doc['metadata']['name']}"


def test_made_kept_renewed_before_expiry_with_the_same_ca(installed: Installed) -> None:
    plane, namespace = installed.plane, installed.namespace
    argv = command(installed.docs)
    assert argv[argv.index("--days") + 1] == "365" and argv[argv.index("--renew-days") + 1] == "30"

    first = run_as(installed.kubeconfig, argv)
    assert first.returncode == 0, first.stderr
    assert "made" in first.stdout and "caBundle set" in first.stdout
    cert = verified(plane, namespace)
    ca = bundle(plane)

    again = run_as(installed.kubeconfig, argv)
    assert again.returncode == 0, again.stderr
    assert "kept" in again.stdout and "caBundle already current" in again.stdout
    assert verified(plane, namespace).serial_number == cert.serial_number

    # 365 days left is inside a 366-day renewal window: renewed, by the same CA.
    due = run_as(installed.kubeconfig, with_option(with_option(argv, "--renew-days", "366"), "--days", "400"))
    assert due.returncode == 0, due.stderr
    assert verified(plane, namespace).serial_number != cert.serial_number
    assert bundle(plane) == ca  # the apiserver trusts the new pair without a new caBundle


def test_the_account_may_touch_its_secrets_and_registration_only(installed: Installed) -> None:
    plane, namespace = installed.plane, installed.namespace
    token = yaml.safe_load(installed.kubeconfig.read_text())["users"][0]["user"]["token"]
    plane.request(
        "POST", f"/api/v1/namespaces/{namespace}/secrets",
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "someone-elses"}, "data": {}},
    )  # fmt: skip
    for path in (
        f"/api/v1/namespaces/{namespace}/secrets/someone-elses",
        f"/api/v1/namespaces/{namespace}/secrets",
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
        f"/api/v1/namespaces/{namespace}/configmaps",
    ):
        call = urllib.request.Request(plane.url + path, headers={"Authorization": f"Bearer {token}"})  # noqa: S310
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(call, timeout=10, context=plane.ssl_context())  # noqa: S310
        assert refused.value.code == 403, path

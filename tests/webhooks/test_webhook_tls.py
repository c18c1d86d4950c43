"""Serving the VMI webhook over TLS in cluster mode.

``manage.py webhook_cert`` is checked the way the kube-apiserver would check its output
(the serving certificate verifies against the printed caBundle for the Service's DNS
name, with serverAuth); the webhook's manifests (the cluster overlay in deploy/, rendered
by ``kubectl kustomize``) against the admissionregistration/v1 rules in
tests/fixtures/kubernetes/NOTES.md; ``deploy/gunicorn.conf.py`` by loading it as gunicorn
does and, end to end, by a real gunicorn serving HTTPS with a certificate from the
command, called with a client that trusts only ``ca.crt``.
"""

from __future__ import annotations

import base64
import datetime
import http.client
import io
import ipaddress
import json
import os
import runpy
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import resolve

from harness.ports import free_port
from harness.shapes import new_uid, real, vmi_obj
from webhooks.management.commands.webhook_cert import service_names
from webhooks.views import VmiAdmissionView

ROOT = Path(__file__).resolve().parents[2]
GUNICORN_CONF = ROOT / "deploy" / "gunicorn.conf.py"
CLUSTER_OVERLAY = ROOT / "deploy" / "overlays" / "cluster"
SERVICE, NAMESPACE = "gpuplane-webhook", "gpuplane-system"


def make_certs(out: Path, *args: str) -> list[str]:
    """Run the command; return its stdout lines."""
    buf = io.StringIO()
    call_command("webhook_cert", "--service", SERVICE, "--namespace", NAMESPACE, "--out", str(out), *args, stdout=buf)
    return buf.getvalue().rstrip("\n").splitlines()


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def verifier(ca: x509.Certificate, name: x509.DNSName | x509.IPAddress) -> Any:
    now = datetime.datetime.now(datetime.UTC)
    return verification.PolicyBuilder().store(verification.Store([ca])).time(now).build_server_verifier(name)


# -- manage.py webhook_cert ----------------------------------------------------------------


def test_command_writes_the_three_files_with_a_private_key(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    make_certs(out)
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert (out / "tls.key").stat().st_mode & 0o777 == 0o600
    for name in ("ca.crt", "tls.crt"):
        assert (out / name).stat().st_mode & 0o077 in (0o044, 0o004, 0o040, 0)  # never group/world-writable
        assert (out / name).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert (out / "tls.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_serving_cert_verifies_against_the_ca(tmp_path: Path) -> None:
    make_certs(tmp_path, "--days", "30")
    ca, cert = load_cert(tmp_path / "ca.crt"), load_cert(tmp_path / "tls.crt")

    # The CA: self-signed, CA:TRUE, may sign certificates.
    ca.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign is True

    # The serving cert: signed by the CA, not a CA, serverAuth, the Service's names only.
    cert.verify_directly_issued_by(ca)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [
        "gpuplane-webhook",
        "gpuplane-webhook.gpuplane-system",
        "gpuplane-webhook.gpuplane-system.svc",
        "gpuplane-webhook.gpuplane-system.svc.cluster.local",
    ]
    assert san.get_values_for_type(x509.DNSName) == service_names(SERVICE, NAMESPACE)
    assert san.get_values_for_type(x509.IPAddress) == []
    public_key = cert.public_key()
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    assert public_key.curve.name == "secp256r1"

    now = datetime.datetime.now(datetime.UTC)
    assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc
    assert datetime.timedelta(days=29) < cert.not_valid_after_utc - now <= datetime.timedelta(days=30)

    # A full path validation as a TLS client does it (signature, SAN, EKU, validity).
    for name in service_names(SERVICE, NAMESPACE):
        chain = verifier(ca, x509.DNSName(name)).verify(cert, [])
        assert chain[-1] == ca
    with pytest.raises(verification.VerificationError, match="subjectAltName"):
        verifier(ca, x509.DNSName("gpuplane-webhook.other.svc")).verify(cert, [])
    with pytest.raises(verification.VerificationError):
        verifier(ca, x509.IPAddress(ipaddress.ip_address("127.0.0.1"))).verify(cert, [])


def test_local_adds_localhost_and_loopback(tmp_path: Path) -> None:
    make_certs(tmp_path, "--local")
    ca, cert = load_cert(tmp_path / "ca.crt"), load_cert(tmp_path / "tls.crt")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName)[-1] == "localhost"
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    verifier(ca, x509.IPAddress(ipaddress.ip_address("127.0.0.1"))).verify(cert, [])
    verifier(ca, x509.DNSName("localhost")).verify(cert, [])


def test_last_line_is_the_ca_bundle_and_next_steps_are_printed(tmp_path: Path) -> None:
    lines = make_certs(tmp_path)
    assert base64.b64decode(lines[-1], validate=True) == (tmp_path / "ca.crt").read_bytes()
    text = "\n".join(lines[:-1])
    assert f"kubectl -n {NAMESPACE} create secret tls {SERVICE}-tls" in text
    assert f"--cert={tmp_path / 'tls.crt'}" in text and f"--key={tmp_path / 'tls.key'}" in text
    assert "caBundle" in text and "deploy/base/webhook.yaml" in text and "kubectl kustomize" in text


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    make_certs(certs)
    before = {p.name: p.read_bytes() for p in certs.iterdir()}
    with pytest.raises(CommandError, match=r"refusing to overwrite .*ca\.crt.*--force"):
        make_certs(certs)
    assert {p.name: p.read_bytes() for p in certs.iterdir()} == before

    # One leftover file is enough to refuse (a half-written earlier run).
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "tls.key").write_text("old")
    with pytest.raises(CommandError, match=r"tls\.key"):
        make_certs(partial)
    assert (partial / "tls.key").read_text() == "old"

    lines = make_certs(certs, "--force")
    after = {p.name: p.read_bytes() for p in certs.iterdir()}
    assert after["ca.crt"] != before["ca.crt"] and after["tls.key"] != before["tls.key"]
    assert base64.b64decode(lines[-1]) == after["ca.crt"]
    assert (certs / "tls.key").stat().st_mode & 0o777 == 0o600


def test_command_exits_non_zero_from_the_command_line(tmp_path: Path) -> None:
    make_certs(tmp_path)
    env = {**os.environ, "GPUPLANE_VAR_DIR": str(tmp_path / "var")}
    done = subprocess.run(
        [sys.executable, "manage.py", "webhook_cert", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "refusing to overwrite" in done.stderr and "--force" in done.stderr


@pytest.mark.parametrize("args", [["--days", "0"], ["--service", ""]])
def test_bad_arguments_are_command_errors(tmp_path: Path, args: list[str]) -> None:
    with pytest.raises(CommandError):
        make_certs(tmp_path, *args)
    assert not any(tmp_path.iterdir())


# -- the webhook's manifests (deploy/overlays/cluster) -------------------------------------


def deploy_docs() -> dict[str, dict[str, Any]]:
    """The webhook configuration, its Service, the web Deployment and the settings ConfigMap
    as ``kubectl apply -k deploy/overlays/cluster`` sends them (tests/project/test_deploy.py checks
    the rest of the overlay)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on the PATH: deploy/overlays/cluster cannot be rendered")
    done = subprocess.run(
        [kubectl, "kustomize", str(CLUSTER_OVERLAY)], capture_output=True, text=True, timeout=120, check=False
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return {
        "MutatingWebhookConfiguration": named["MutatingWebhookConfiguration", "gpuplane-vmi"],
        "Service": named["Service", SERVICE],
        "Deployment": named["Deployment", "gpuplane-webhook"],
        "ConfigMap": config_map,
    }


def container_env(container: dict[str, Any], config_map: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The container's environment: the ConfigMap it takes with envFrom, then its own env."""
    env: dict[str, dict[str, Any]] = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == config_map["metadata"]["name"]
        env.update({name: {"name": name, "value": value} for name, value in config_map["data"].items()})
    env.update({e["name"]: e for e in container["env"]})
    return env


def test_mutating_webhook_configuration() -> None:
    config = deploy_docs()["MutatingWebhookConfiguration"]
    assert config["apiVersion"] == "admissionregistration.k8s.io/v1"
    (hook,) = config["webhooks"]
    assert hook["name"] == "vmi.gpuplane.io"
    assert "v1" in hook["admissionReviewVersions"]
    assert hook["rules"] == [
        {
            "apiGroups": ["kubevirt.io"],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["virtualmachineinstances"],
            "scope": "Namespaced",
        }
    ]
    service = hook["clientConfig"]["service"]
    assert service == {"name": SERVICE, "namespace": NAMESPACE, "path": "/webhooks/vmi", "port": 443}
    assert isinstance(hook["clientConfig"]["caBundle"], str) and hook["clientConfig"]["caBundle"]
    assert resolve(service["path"]).func.view_class is VmiAdmissionView

    # The values admissionregistration/v1 allows (NOTES.md), and the ones gpuplane needs.
    assert hook["failurePolicy"] == "Fail"
    assert isinstance(hook["timeoutSeconds"], int) and 1 <= hook["timeoutSeconds"] <= 30
    assert hook["timeoutSeconds"] == 10
    assert hook["timeoutSeconds"] > settings.GPUPLANE_BIND_WAIT_SECONDS
    assert hook["sideEffects"] in {"None", "NoneOnDryRun"}
    assert hook["sideEffects"] == "NoneOnDryRun"  # it writes bind requests, except on dryRun
    assert hook["matchPolicy"] in {"Exact", "Equivalent"}
    assert hook["reinvocationPolicy"] in {"Never", "IfNeeded"}
    (expr,) = hook["namespaceSelector"]["matchExpressions"]
    assert expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "NotIn"
    assert set(expr["values"]) == {"kube-system", "gpuplane-system"}


def test_service_and_deployment_match_the_webhook() -> None:
    docs = deploy_docs()
    service, deployment = docs["Service"], docs["Deployment"]
    assert (service["metadata"]["name"], service["metadata"]["namespace"]) == (SERVICE, NAMESPACE)
    # The webhook, and the server's own /metrics beside it (docs/webhook.md).
    port, metrics = service["spec"]["ports"]
    assert port["port"] == 443 and (metrics["name"], metrics["targetPort"]) == ("metrics", "metrics")

    template = deployment["spec"]["template"]
    assert deployment["metadata"]["namespace"] == NAMESPACE
    labels = template["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = template["spec"]["containers"]
    container_port, metrics_port = container["ports"]
    assert metrics_port == {"name": "metrics", "containerPort": metrics["port"]}
    assert port["targetPort"] in (container_port["name"], container_port["containerPort"])
    assert container_port["containerPort"] == 8443
    assert container["command"] == ["python", "deploy/webhook_server.py"]

    env = container_env(container, docs["ConfigMap"])
    assert env["GPUPLANE_CLUSTER"]["value"] == "kubernetes"
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/gpuplane/tls")
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == f"{SERVICE}-tls"
    assert env["GPUPLANE_TLS_CERT_FILE"]["value"] == "/etc/gpuplane/tls/tls.crt"
    assert env["GPUPLANE_TLS_KEY_FILE"]["value"] == "/etc/gpuplane/tls/tls.key"
    # Secrets come from a Secret, never from the file.
    for name in ("DJANGO_SECRET_KEY", "DATABASE_URL", "CELERY_BROKER_URL"):
        assert "value" not in env[name] and env[name]["valueFrom"]["secretKeyRef"]["key"] == name
    # Only the kube-apiserver may call: its bearer token, from a Secret mounted as a file.
    assert env["GPUPLANE_WEBHOOK_AUTH"]["value"] == "token"
    token_file = env["GPUPLANE_WEBHOOK_TOKEN_FILE"]["value"]
    token_mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"]))
    token_volume = next(v for v in template["spec"]["volumes"] if v["name"] == token_mount["name"])
    assert token_volume["secret"]["secretName"] == "gpuplane-webhook-token"
    hosts = env["DJANGO_ALLOWED_HOSTS"]["value"].split(",")
    assert f"{SERVICE}.{NAMESPACE}.svc" in hosts
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert (get["scheme"], get["path"]) == ("HTTPS", path)
        assert get["port"] in (container_port["name"], 8443)
        host = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}.get("Host")
        assert host in hosts  # else Django answers the probe 400 (DisallowedHost)


# -- deploy/gunicorn.conf.py ---------------------------------------------------------------


def gunicorn_conf(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, Any]:
    for name in (
        "GPUPLANE_TLS_CERT_FILE", "GPUPLANE_TLS_KEY_FILE", "GPUPLANE_BIND", "GPUPLANE_CLUSTER",
        "GPUPLANE_WEB_WORKERS", "GPUPLANE_WEB_THREADS",
    ):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(GUNICORN_CONF))


def test_gunicorn_conf_plain_and_tls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plain = gunicorn_conf(monkeypatch)
    assert plain["bind"] == ["0.0.0.0:8000"]
    assert "certfile" not in plain and "keyfile" not in plain
    assert plain["workers"] == 2
    assert plain["timeout"] > 10  # above the webhook's timeoutSeconds
    assert plain["worker_class"] == "gthread"  # a webhook call may wait 8 s for the binder
    assert plain["control_socket_disable"] is True

    make_certs(tmp_path)
    cert, key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    tls = gunicorn_conf(
        monkeypatch, GPUPLANE_CLUSTER="kubernetes", GPUPLANE_TLS_CERT_FILE=cert, GPUPLANE_TLS_KEY_FILE=key,
        GPUPLANE_WEB_WORKERS="3",
    )  # fmt: skip
    assert (tls["certfile"], tls["keyfile"]) == (cert, key)
    assert tls["bind"] == ["0.0.0.0:8443"]
    assert tls["workers"] == 3
    bound = gunicorn_conf(
        monkeypatch, GPUPLANE_TLS_CERT_FILE=cert, GPUPLANE_TLS_KEY_FILE=key, GPUPLANE_BIND="127.0.0.1:9443"
    )
    assert bound["bind"] == ["127.0.0.1:9443"]


def test_gunicorn_conf_refuses_cluster_mode_without_tls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="GPUPLANE_CLUSTER=kubernetes needs TLS"):
        gunicorn_conf(monkeypatch, GPUPLANE_CLUSTER="kubernetes")
    with pytest.raises(RuntimeError, match="both"):
        gunicorn_conf(monkeypatch, GPUPLANE_TLS_CERT_FILE=str(tmp_path / "tls.crt"))
    with pytest.raises(RuntimeError, match="no such file"):
        gunicorn_conf(
            monkeypatch, GPUPLANE_TLS_CERT_FILE=str(tmp_path / "x.crt"), GPUPLANE_TLS_KEY_FILE=str(tmp_path / "x.key")
        )
    with pytest.raises(RuntimeError, match="GPUPLANE_WEB_WORKERS"):
        gunicorn_conf(monkeypatch, GPUPLANE_WEB_WORKERS="0")


WEBHOOK_SERVER = ROOT / "deploy" / "webhook_server.py"
SERVING_VARIABLES = (
    "GPUPLANE_TLS_CERT_FILE", "GPUPLANE_TLS_KEY_FILE", "GPUPLANE_CLUSTER", "GPUPLANE_WEB_WORKERS",
    "GPUPLANE_WEBHOOK_WORKERS", "GPUPLANE_WEBHOOK_AUTH", "GPUPLANE_WEBHOOK_BIND",
)  # fmt: skip


def webhook_server_refusal(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    """What ``deploy/webhook_server.py`` refuses to start with, as the line it prints."""
    for name in SERVING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    namespace = runpy.run_path(str(WEBHOOK_SERVER), run_name="webhook_server_under_test")
    with pytest.raises((RuntimeError, SystemExit)) as refused:
        namespace["options"]()
    return str(refused.value)


def gunicorn_refusal(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    with pytest.raises(RuntimeError) as refused:
        gunicorn_conf(monkeypatch, **env)
    return str(refused.value)


@pytest.mark.parametrize(
    "case",
    ["cluster mode without TLS", "a certificate without its key", "files that are not there", "a size of 0",
     "a size that is no number"],
)  # fmt: skip
def test_both_servers_refuse_the_same_settings_with_the_same_words(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str
) -> None:
    """The API's gunicorn and the webhook server check their TLS files and sizes with one
    module (deploy/serving.py, its sizes read by gpuplane/settings_parsers.py), so an operator
    reads one message for one mistake."""
    (tmp_path / "tls.crt").write_text("x")
    env = {
        "cluster mode without TLS": {"GPUPLANE_CLUSTER": "kubernetes"},
        "a certificate without its key": {"GPUPLANE_TLS_CERT_FILE": str(tmp_path / "tls.crt")},
        "files that are not there": {
            "GPUPLANE_TLS_CERT_FILE": str(tmp_path / "x.crt"), "GPUPLANE_TLS_KEY_FILE": str(tmp_path / "x.key"),
        },
        "a size of 0": {"WORKERS": "0"},
        "a size that is no number": {"WORKERS": "two"},
    }[case]  # fmt: skip
    web = {("GPUPLANE_WEB_WORKERS" if k == "WORKERS" else k): v for k, v in env.items()}
    webhook = {("GPUPLANE_WEBHOOK_WORKERS" if k == "WORKERS" else k): v for k, v in env.items()}
    expected = gunicorn_refusal(monkeypatch, **web).replace("GPUPLANE_WEB_WORKERS", "GPUPLANE_WEBHOOK_WORKERS")
    assert webhook_server_refusal(monkeypatch, **webhook) == expected


def test_the_webhook_server_stops_with_one_line_naming_the_setting(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in SERVING_VARIABLES}
    env["GPUPLANE_WEBHOOK_WORKERS"] = "0"
    done = subprocess.run(
        [sys.executable, str(WEBHOOK_SERVER)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert done.stderr.strip() == "gpuplane: cannot start: GPUPLANE_WEBHOOK_WORKERS='0' must be at least 1"


# -- end to end: gunicorn serving HTTPS ------------------------------------------------------


def vmi_review_without_gpus(uid: str) -> dict[str, Any]:
    """The captured AdmissionReview turned into a CREATE of a VMI naming no gpuplane device."""
    vmi = vmi_obj("tenant-a", "plain-vm", [], {}, "")
    vmi["metadata"].pop("uid")
    body = real("admissionreview-v1-request-pod-create.json")
    kind = {"group": "kubevirt.io", "version": "v1", "kind": "VirtualMachineInstance"}
    resource = {"group": "kubevirt.io", "version": "v1", "resource": "virtualmachineinstances"}
    body["request"].update(
        uid=uid, kind=kind, requestKind=kind, resource=resource, requestResource=resource,
        namespace="tenant-a", object=vmi,
    )  # fmt: skip
    return body


@pytest.mark.slow
def test_gunicorn_serves_the_api_over_tls_and_leaves_the_webhook_to_its_own_server(tmp_path: Path) -> None:
    """In cluster mode the API's gunicorn serves HTTPS, and the webhook only on the webhook
    server's port (tests/webhooks/test_webhook_serving.py): here it answers 404, writing nothing."""
    certs = tmp_path / "tls"
    make_certs(certs, "--local")
    env = {
        **{k: v for k, v in os.environ.items() if k not in {"CELERY_BROKER_URL", "GPUPLANE_BIND_WAIT_SECONDS"}},
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "GPUPLANE_VAR_DIR": str(tmp_path),
        "GPUPLANE_CLUSTER": "kubernetes",
        "GPUPLANE_TLS_CERT_FILE": str(certs / "tls.crt"),
        "GPUPLANE_TLS_KEY_FILE": str(certs / "tls.key"),
        "GPUPLANE_WEB_WORKERS": "1",
        "GPUPLANE_WEB_THREADS": "2",
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--verbosity", "0"], cwd=ROOT, env=env, check=True, timeout=60
    )
    port = free_port()
    env["GPUPLANE_BIND"] = f"127.0.0.1:{port}"
    log = (tmp_path / "gunicorn.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", str(GUNICORN_CONF), "gpuplane.wsgi"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
                conn.request("GET", "/healthz")
                health = conn.getresponse()
                assert health.status == 200, health.read()
                conn.close()
                break
            except (ConnectionRefusedError, ConnectionResetError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp_path / "gunicorn.log").read_text()) from None
                time.sleep(0.1)

        uid = new_uid()
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
        conn.request(
            "POST", "/webhooks/vmi", body=json.dumps(vmi_review_without_gpus(uid)),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 404
        out = json.loads(resp.read())
        conn.close()
        assert out["error"] == "in cluster mode the VMI webhook is served by the webhook server only, on its own port"

        # Plain HTTP to the TLS port gets no HTTP answer.
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/healthz")
            plain.getresponse().read()
        plain.close()

        # A client that does not trust the development CA refuses the server.
        untrusting = ssl.create_default_context()
        stranger = http.client.HTTPSConnection("127.0.0.1", port, context=untrusting, timeout=5)
        with pytest.raises(ssl.SSLCertVerificationError):
            stranger.request("GET", "/healthz")
        stranger.close()
        assert "Control socket" not in (tmp_path / "gunicorn.log").read_text()
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()

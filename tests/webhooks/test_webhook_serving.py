"""The webhook stays up and serves only the kube-apiserver.

Real servers over real sockets: ``deploy/webhook_server.py`` (granian, the production
config) on a free loopback port, over HTTPS with certificates from ``manage.py
webhook_cert``, against a SQLite database of the test's own.

- Slow clients: 200 sockets that trickle one header line every 0.5 s while an ordinary
  client keeps sending reviews; every ordinary call is answered, ``/healthz`` stays up, and
  the server hangs up on the trickling sockets at its header deadline.
- Callers: with the token policy, no token (or a wrong one) is 401 before the body is read
  and a review naming another tenant's Pending devices reveals nothing and writes nothing;
  the apiserver's token is served. With the client-certificate policy, a client without a
  certificate signed by the configured CA cannot even complete the TLS handshake.
- The pure caller policy (``webhooks.callers.refusal``) case by case.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import io
import json
import os
import runpy
import shutil
import socket
import sqlite3
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.core.management import call_command

from gpuplane.settings_parsers import SettingError
from harness.factories import new_vmi, review
from harness.shapes import H100, class_obj, gpu_obj, node_obj
from harness.workers import ROOT, webhook_server
from webhooks.callers import CallerPolicy, refusal

WEBHOOK_SERVER = ROOT / "deploy" / "webhook_server.py"
TOKEN = "apiserver-token-for-tests-" + "x" * 16
SLOW = 200


def _certs(out: Path) -> Path:
    call_command("webhook_cert", "--local", "--out", str(out), stdout=io.StringIO())
    return out


def _server_env(database: Path) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUPLANE_", "CELERY_"))},
        "DATABASE_URL": f"sqlite:///{database}",
        "GPUPLANE_VAR_DIR": str(database.parent),
        "GPUPLANE_AUTO_PASS": "false",
        "GPUPLANE_WEBHOOK_WORKERS": "1",
        "GPUPLANE_WEBHOOK_THREADS": "4",
    }


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One migrated SQLite file for this module's servers; each test copies it (a migrate
    per test cost a Django start-up and the whole migration history each time)."""
    database = tmp_path_factory.mktemp("migrated") / "db.sqlite3"
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--verbosity", "0"],
        cwd=ROOT, env=_server_env(database), check=True, timeout=120,
    )  # fmt: skip
    return database


def _database(tmp_path: Path, objects: list[dict[str, Any]], migrated: Path) -> dict[str, str]:
    """A migrated SQLite database holding ``objects``; the environment the server reads it with."""
    database = tmp_path / "db.sqlite3"
    shutil.copyfile(migrated, database)
    env = _server_env(database)
    snapshot = tmp_path / "cluster.json"
    snapshot.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    subprocess.run(
        [sys.executable, "manage.py", "load_snapshot", str(snapshot)], cwd=ROOT, env=env, check=True, timeout=120
    )
    return env


def _bind_requests(env: dict[str, str]) -> list[str]:
    """The devices' bind requests, read from the server's database file directly."""
    path = env["DATABASE_URL"].removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as db:
        return sorted(row[0] for row in db.execute("SELECT bind_request FROM binder_gpudevice"))


def _post(url: str, body: dict[str, Any], context: ssl.SSLContext | None, headers: dict[str, str]) -> tuple[int, Any]:
    host, port = url.split("://", 1)[1].split(":")
    conn: http.client.HTTPConnection
    if context is not None:
        conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=10)
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", "/webhooks/vmi?timeout=10s", body=json.dumps(body),
                     headers={"Content-Type": "application/json", **headers})  # fmt: skip
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


OBJECTS = [
    class_obj("h100", H100),
    node_obj("n1", {H100: 8}),
    gpu_obj("victim", "v-gpu0", "h100", "train"),
    gpu_obj("victim", "v-gpu1", "h100", "train"),
]


# -- callers ------------------------------------------------------------------------------


@pytest.mark.slow
def test_token_policy_over_tls_serves_the_apiserver_and_tells_others_nothing(tmp_path: Path, migrated: Path) -> None:
    certs = _certs(tmp_path / "tls")
    env = _database(tmp_path, OBJECTS, migrated) | {
        "GPUPLANE_TLS_CERT_FILE": str(certs / "tls.crt"),
        "GPUPLANE_TLS_KEY_FILE": str(certs / "tls.key"),
        "GPUPLANE_WEBHOOK_AUTH": "token",
        "GPUPLANE_WEBHOOK_TOKEN": TOKEN,
    }
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.check_hostname = False  # the certificate names the Service, the test dials 127.0.0.1
    attack = review(new_vmi("victim", "train", ["v-gpu0", "v-gpu1"]))
    with webhook_server(env, tmp_path, scheme="https") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": "Basic x"}):
            status, body = _post(url, attack, context, headers)
            assert status == 401, (headers, body)
            assert body == {"error": "authentication required", "field": "(caller)"}
        assert _bind_requests(env) == ["", ""]  # nothing written for the unauthenticated caller

        status, body = _post(url, attack, context, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        assert body["response"]["uid"] == attack["request"]["uid"]
        assert all(_bind_requests(env))  # the apiserver's call wrote the set's bind request


def _client_ca(out: Path) -> tuple[Path, Path, Path]:
    """A CA, and a client certificate (with its key) it signed, as an apiserver's kubeconfig has."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test apiserver client CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    out.mkdir(parents=True)
    paths = out / "client-ca.crt", out / "client.crt", out / "client.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@pytest.mark.slow
def test_client_certificate_policy_refuses_the_handshake_without_the_apiservers_certificate(
    tmp_path: Path, migrated: Path
) -> None:
    certs = _certs(tmp_path / "tls")
    client_ca, client_cert, client_key = _client_ca(tmp_path / "client")
    env = _database(tmp_path, OBJECTS, migrated) | {
        "GPUPLANE_TLS_CERT_FILE": str(certs / "tls.crt"),
        "GPUPLANE_TLS_KEY_FILE": str(certs / "tls.key"),
        "GPUPLANE_WEBHOOK_AUTH": "client-cert",
        "GPUPLANE_WEBHOOK_CLIENT_CA": str(client_ca),
    }
    attack = review(new_vmi("victim", "train", ["v-gpu0", "v-gpu1"]))
    anonymous = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    anonymous.check_hostname = False
    apiserver = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    apiserver.check_hostname = False
    apiserver.load_cert_chain(str(client_cert), str(client_key))
    with webhook_server(env, tmp_path, scheme="https", probe_http=False) as url:
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)):
            _post(url, attack, anonymous, {})
        assert _bind_requests(env) == ["", ""]
        status, body = _post(url, attack, apiserver, {})
        assert status == 200 and body["response"]["uid"] == attack["request"]["uid"]


# -- slow clients ---------------------------------------------------------------------------


def _trickle(port: int, stop: threading.Event, hung_up: list[int]) -> None:
    """A slowloris: the request line, then a header line every 0.5 s, never the blank line."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /webhooks/vmi HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            n = 0
            while not stop.wait(0.5):
                n += 1
                sock.sendall(f"X-Slow-{n}: {n}\r\n".encode())
    except OSError:
        hung_up.append(1)


@pytest.mark.slow
def test_two_hundred_slow_clients_do_not_stop_reviews_or_probes(tmp_path: Path, migrated: Path) -> None:
    env = _database(tmp_path, OBJECTS, migrated) | {
        "GPUPLANE_WEBHOOK_AUTH": "none",
        "GPUPLANE_WEBHOOK_HEADER_TIMEOUT_MS": "3000",
    }
    plain = review(new_vmi("victim", "plain-vm", []))
    with webhook_server(env, tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        stop, hung_up = threading.Event(), []
        slow = [threading.Thread(target=_trickle, args=(port, stop, hung_up), daemon=True) for _ in range(SLOW)]
        for thread in slow:
            thread.start()
        time.sleep(1.0)
        answered = failed = 0
        took: list[float] = []
        deadline = time.monotonic() + 6  # past the 3 s header deadline
        try:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    status, body = _post(url, plain, None, {})
                    health = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                    health.request("GET", "/healthz")
                    healthy = health.getresponse().status == 200
                    health.close()
                except OSError:
                    failed += 1
                    continue
                took.append(time.perf_counter() - started)
                assert status == 200 and body["response"]["allowed"] is True and healthy
                answered += 1
                time.sleep(0.05)
        finally:
            stop.set()
            for thread in slow:
                thread.join(timeout=10)
        took.sort()
        print(f"\n{SLOW} slow sockets: {answered} reviews answered, {failed} failed, "
              f"p99 {took[int(len(took) * 0.99) - 1] * 1000:.0f} ms; server hung up on {len(hung_up)}")  # fmt: skip
        assert failed == 0 and answered >= 20
        assert len(hung_up) == SLOW  # every trickler was cut off at the header deadline, none held forever


# -- the caller policy, case by case -----------------------------------------------------------


def _policy(**overrides: Any) -> CallerPolicy:
    values: dict[str, Any] = {"enabled": True, "auth": "token", "token": TOKEN, "serving": "webhook"}
    values["cluster_mode"] = True
    return CallerPolicy(**(values | overrides))


@pytest.mark.parametrize(
    ("policy", "headers", "expected"),
    [
        (_policy(), {"Authorization": f"Bearer {TOKEN}"}, None),
        (_policy(), {"Authorization": f"bearer  {TOKEN} "}, None),
        (_policy(), {}, 401),
        (_policy(), {"Authorization": f"Bearer {TOKEN}x"}, 401),
        (_policy(token=""), {"Authorization": "Bearer "}, 401),
        (_policy(enabled=False), {"Authorization": f"Bearer {TOKEN}"}, 404),
        (_policy(serving="api"), {"Authorization": f"Bearer {TOKEN}"}, 404),  # cluster mode: the API port
        (_policy(serving="api", cluster_mode=False), {"Authorization": f"Bearer {TOKEN}"}, None),  # standalone
        (_policy(auth="client-cert"), {}, None),  # verified in the TLS handshake by the webhook server
        (_policy(auth="client-cert", serving="api", cluster_mode=False), {}, 401),  # nobody verified it there
        (_policy(auth="none"), {}, None),
    ],
)
def test_caller_policy(policy: CallerPolicy, headers: dict[str, str], expected: int | None) -> None:
    refused = refusal(policy, headers)
    assert (refused[0] if refused else None) == expected


def test_the_webhook_is_off_in_standalone_mode_unless_turned_on(client: Any, settings: Any) -> None:
    settings.GPUPLANE_WEBHOOK_ENABLED = False
    body = json.dumps(review(new_vmi("t1", "vm", [])))
    resp = client.post("/webhooks/vmi", data=body, content_type="application/json")
    assert resp.status_code == 404
    assert "GPUPLANE_WEBHOOK_ENABLED" in resp.json()["error"]


@pytest.mark.django_db(transaction=True)  # the answer pass runs at commit
def test_a_call_with_no_time_left_before_the_apiservers_deadline_writes_nothing(client: Any) -> None:
    from binder import models
    from binder.mirror.snapshot import load_objects

    load_objects(OBJECTS)
    body = json.dumps(review(new_vmi("victim", "train", ["v-gpu0", "v-gpu1"])))
    resp = client.post("/webhooks/vmi?timeout=1s", data=body, content_type="application/json")
    assert resp.status_code == 200
    answer = resp.json()["response"]
    assert answer["allowed"] is False and "try again" in answer["status"]["message"]
    assert set(models.GpuDevice.objects.values_list("bind_request", flat=True)) == {""}
    # With time left (the apiserver's usual 10 s) the same call binds.
    resp = client.post("/webhooks/vmi?timeout=10s", data=body, content_type="application/json")
    assert resp.json()["response"]["allowed"] is True, resp.json()["response"]


# -- the access log ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("logged", [None, "true"])
def test_the_access_log_is_off_unless_asked_for(tmp_path: Path, migrated: Path, logged: str | None) -> None:
    """Every VMI CREATE passes the webhook: by default no line per call is written; with
    ``GPUPLANE_WEBHOOK_ACCESS_LOG=true`` each request is logged, the webhook's among them."""
    env = _database(tmp_path, OBJECTS, migrated) | {"GPUPLANE_WEBHOOK_AUTH": "none"}
    if logged is not None:
        env["GPUPLANE_WEBHOOK_ACCESS_LOG"] = logged
    plain = review(new_vmi("victim", "plain-vm", []))
    path = tmp_path / "webhook-server.log"

    def lines() -> list[str]:
        return [line for line in path.read_text().splitlines() if "/webhooks/vmi" in line]

    with webhook_server(env, tmp_path) as url:
        for _ in range(3):
            status, body = _post(url, plain, None, {})
            assert status == 200 and body["response"]["allowed"] is True
        # granian writes its line after the answer is sent: give it time to appear.
        deadline = time.monotonic() + 20
        while logged is not None and len(lines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    log = path.read_text()
    if logged is None:
        assert lines() == [], log
    else:
        assert len(lines()) == 3 and all("POST" in line for line in lines()), log


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, False), ("", False), ("true", True), ("ON", True), ("1", True), ("false", False), ("no", False)],
)
def test_the_access_log_setting(monkeypatch: pytest.MonkeyPatch, raw: str | None, expected: bool) -> None:
    for name in ("GPUPLANE_TLS_CERT_FILE", "GPUPLANE_TLS_KEY_FILE", "GPUPLANE_CLUSTER", "GPUPLANE_WEBHOOK_AUTH"):
        monkeypatch.delenv(name, raising=False)
    if raw is None:
        monkeypatch.delenv("GPUPLANE_WEBHOOK_ACCESS_LOG", raising=False)
    else:
        monkeypatch.setenv("GPUPLANE_WEBHOOK_ACCESS_LOG", raw)
    options = runpy.run_path(str(WEBHOOK_SERVER), run_name="webhook_server_under_test")["options"]
    assert options()["log_access"] is expected


def test_a_bad_access_log_setting_stops_the_server_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GPUPLANE_TLS_CERT_FILE", "GPUPLANE_TLS_KEY_FILE", "GPUPLANE_CLUSTER", "GPUPLANE_WEBHOOK_AUTH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUPLANE_WEBHOOK_ACCESS_LOG", "sometimes")
    options = runpy.run_path(str(WEBHOOK_SERVER), run_name="webhook_server_under_test")["options"]
    with pytest.raises(SettingError, match=r"GPUPLANE_WEBHOOK_ACCESS_LOG='sometimes' is not a boolean"):
        options()

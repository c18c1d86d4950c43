"""The webhook server's certificate and its own /metrics, on the real server
(``deploy/webhook_server.py``: granian, two workers, TLS).

The certificate files are laid out as the kubelet mounts a Secret (``tls.crt`` -> ``..data/tls.crt``,
``..data`` -> a timestamped directory, swapped in one rename on a renewal, the old directory
removed). A renewal is served by the same server process, without a restart, and the metrics
port reports the served certificate's end, the reload, and every call by outcome.
``deploy/webhook_certificates.py``'s plan (what a run of the chart's certificate Job decides) is
checked here without a cluster; tests/kube/test_chart_certificates.py runs it against one.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from deploy.webhook_certificates import make_ca, make_serving, plan, service_names
from harness import workers
from harness.factories import new_vmi
from harness.factories import review as review_of
from harness.ports import free_port

NAMES = ["localhost", "gpuplane-webhook.gpuplane-system.svc"]
NOW = dt.datetime.now(dt.UTC)


def mount(directory: Path, version: str, cert: bytes, key: bytes) -> None:
    """Write the pair as the kubelet updates a Secret volume: a new directory, then ``..data``
    swapped to it in one rename, then the old directory removed."""
    directory.mkdir(exist_ok=True)
    target = directory / f"..{version}"
    target.mkdir()
    (target / "tls.crt").write_bytes(cert)
    (target / "tls.key").write_bytes(key)
    old = (directory / "..data").resolve() if (directory / "..data").exists() else None
    spare = directory / "..data_tmp"
    spare.symlink_to(target.name)
    spare.replace(directory / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    if old is not None and old != target:
        for child in old.iterdir():
            child.unlink()
        old.rmdir()


def served_certificate(port: int) -> x509.Certificate:
    pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=5)
    return x509.load_pem_x509_certificate(pem.encode())


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def review(port: int) -> dict[str, object]:
    """A review of a VMI naming no gpuplane device (decided without the database)."""
    body = review_of(new_vmi("t1", "plain", []))
    call = urllib.request.Request(
        f"https://127.0.0.1:{port}/webhooks/vmi", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    context = ssl._create_unverified_context()  # noqa: S323 - the test's own server
    with urllib.request.urlopen(call, timeout=10, context=context) as answer:  # noqa: S310
        return dict(json.loads(answer.read()))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[int, int, Path, workers.Served]]:
    """The webhook server with the first pair mounted, checking the files every 0.5 s: (port,
    metrics port, the mount, the served URL with its process group)."""
    ca, ca_key = make_ca("test-ca", 30, NOW)
    cert, key = make_serving(ca, ca_key, NAMES, 30, NOW)
    secret = tmp_path / "tls"
    mount(secret, "first", cert, key)
    port, metrics_port = free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUPLANE_", "DATABASE_", "PROMETHEUS_"))},
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "GPUPLANE_VAR_DIR": str(tmp_path / "var"),
        "GPUPLANE_CLUSTER": "standalone",
        "GPUPLANE_WEBHOOK_AUTH": "none",
        "GPUPLANE_READ_MODEL_AT_START": "false",
        "GPUPLANE_TLS_CERT_FILE": str(secret / "tls.crt"),
        "GPUPLANE_TLS_KEY_FILE": str(secret / "tls.key"),
        "GPUPLANE_WEBHOOK_CERT_CHECK_SECONDS": "1",
        "GPUPLANE_WEBHOOK_METRICS_BIND": f"127.0.0.1:{metrics_port}",
        "GPUPLANE_METRICS_TOKEN": "metrics-token-for-the-test",
    }
    (tmp_path / "var").mkdir()
    with workers.webhook_server(env, tmp_path, scheme="https", probe_http=False, port=port) as served:
        yield port, metrics_port, secret, served


def authorized_scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    call = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer metrics-token-for-the-test"}
    )
    with urllib.request.urlopen(call, timeout=5) as answer:  # noqa: S310
        text = answer.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.slow
def test_a_renewed_certificate_is_served_without_a_restart(
    server: tuple[int, int, Path, workers.Served], tmp_path: Path
) -> None:
    port, metrics_port, secret, served = server
    first = served_certificate(port)
    assert first.public_bytes(ssl_encoding()) == (secret / "tls.crt").read_bytes()
    metrics = authorized_scrape(metrics_port)
    assert metrics[("gpuplane_webhook_certificate_expiry_seconds", ())] == first.not_valid_after_utc.timestamp()
    assert metrics[("gpuplane_webhook_certificate_reloads_total", ())] == 0

    ca, ca_key = make_ca("test-ca-2", 60, NOW)
    cert, key = make_serving(ca, ca_key, NAMES, 60, NOW)
    mount(secret, "second", cert, key)
    deadline = time.monotonic() + 30
    failures = 0
    while True:
        try:
            now_served = served_certificate(port)
        except OSError:
            failures += 1
            now_served = first
        if now_served.serial_number != first.serial_number:
            break
        assert time.monotonic() < deadline, "the renewed certificate was not served within 30 s"
        time.sleep(0.2)
    assert now_served.public_bytes(ssl_encoding()) == cert
    assert os.getpgid(served.pgid) == served.pgid  # the same server process group, never restarted
    # Granian starts each new worker before it stops an old one: the port kept answering.
    assert failures == 0
    metrics = authorized_scrape(metrics_port)
    assert metrics[("gpuplane_webhook_certificate_expiry_seconds", ())] == now_served.not_valid_after_utc.timestamp()
    assert metrics[("gpuplane_webhook_certificate_reloads_total", ())] == 1


def test_a_half_written_pair_is_not_served(server: tuple[int, int, Path, workers.Served]) -> None:
    """A certificate without its key (a hand-made mount written file by file) leaves the last
    good pair served."""
    port, _, secret, _ = server
    first = served_certificate(port)
    ca, ca_key = make_ca("other", 30, NOW)
    cert, _ = make_serving(ca, ca_key, NAMES, 30, NOW)
    target = (secret / "..data").resolve()
    (target / "tls.crt").write_bytes(cert)  # the key is still the first pair's
    time.sleep(3)
    assert served_certificate(port).serial_number == first.serial_number
    assert review(port)["response"]["allowed"] is True  # type: ignore[index]


def test_metrics_count_every_call_by_outcome_and_need_the_token(server: tuple[int, int, Path, workers.Served]) -> None:
    port, metrics_port, _, _ = server
    with pytest.raises(urllib.error.HTTPError) as closed:
        scrape(metrics_port)
    assert closed.value.code == 401
    for _ in range(3):
        assert review(port)["response"]["allowed"] is True  # type: ignore[index]
    # A malformed review: 400, counted as such.
    context = ssl._create_unverified_context()  # noqa: S323
    bad = urllib.request.Request(
        f"https://127.0.0.1:{port}/webhooks/vmi",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as malformed:
        urllib.request.urlopen(bad, timeout=10, context=context)  # noqa: S310
    assert malformed.value.code == 400
    metrics = authorized_scrape(metrics_port)
    # Two worker processes answered, the metrics port adds them up.
    assert metrics[("gpuplane_webhook_reviews_total", (("outcome", "allowed"),))] == 3
    assert metrics[("gpuplane_webhook_reviews_total", (("outcome", "bad_request"),))] == 1
    assert metrics[("gpuplane_webhook_review_seconds_count", (("outcome", "allowed"),))] == 3
    assert metrics[("gpuplane_webhook_reviews_total", (("outcome", "denied"),))] == 0


def ssl_encoding() -> object:
    from cryptography.hazmat.primitives.serialization import Encoding

    return Encoding.PEM


# -- the certificate Job's plan ---------------------------------------------------------------------


def test_a_first_run_makes_the_ca_and_the_pair_for_the_service() -> None:
    names = service_names("gp-webhook", "gpus")
    found = plan({}, {}, names, days=365, renew_days=30, ca_days=3650, now=NOW)
    assert found.ca_renewed and found.serving_renewed
    cert = x509.load_pem_x509_certificate(found.cert)
    ca = x509.load_pem_x509_certificate(found.ca)
    cert.verify_directly_issued_by(ca)
    assert (
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        == names
    )
    assert cert.not_valid_after_utc - NOW > dt.timedelta(days=364)
    assert found.bundle == found.ca


def test_a_current_pair_is_kept_and_one_near_its_end_is_renewed_by_the_same_ca() -> None:
    names = service_names("gp-webhook", "gpus")
    first = plan({}, {}, names, days=365, renew_days=30, ca_days=3650, now=NOW)
    ca_data = {"ca.crt": first.ca, "ca.key": first.ca_key, "bundle.crt": first.bundle}
    tls = {"tls.crt": first.cert, "tls.key": first.key}
    again = plan(ca_data, tls, names, days=365, renew_days=30, ca_days=3650, now=NOW + dt.timedelta(days=300))
    assert not again.ca_renewed and not again.serving_renewed and again.cert == first.cert
    late = plan(ca_data, tls, names, days=365, renew_days=30, ca_days=3650, now=NOW + dt.timedelta(days=340))
    assert not late.ca_renewed and late.serving_renewed and late.bundle == first.bundle
    x509.load_pem_x509_certificate(late.cert).verify_directly_issued_by(x509.load_pem_x509_certificate(first.ca))
    # Another Service name (a renamed release) gets a new pair at once.
    renamed = plan(ca_data, tls, service_names("other-webhook", "gpus"), days=365, renew_days=30, ca_days=3650, now=NOW)
    assert renamed.serving_renewed


def test_a_ca_near_its_end_is_replaced_and_kept_in_the_bundle_until_it_expires() -> None:
    names = service_names("gp-webhook", "gpus")
    first = plan({}, {}, names, days=20, renew_days=5, ca_days=40, now=NOW)
    ca_data = {"ca.crt": first.ca, "ca.key": first.ca_key, "bundle.crt": first.bundle}
    later = plan(ca_data, {"tls.crt": first.cert, "tls.key": first.key}, names, days=20, renew_days=5, ca_days=40,
                 now=NOW + dt.timedelta(days=36))  # fmt: skip
    assert later.ca_renewed and later.serving_renewed
    bundle = x509.load_pem_x509_certificates(later.bundle)
    assert [c.public_bytes(ssl_encoding()) for c in bundle] == [later.ca, first.ca]  # type: ignore[arg-type]

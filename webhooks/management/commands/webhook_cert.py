"""``manage.py webhook_cert``: a self-signed CA and a serving certificate for the webhook.

The kube-apiserver calls admission webhooks over HTTPS only and checks the serving
certificate against the ``caBundle`` of the webhook configuration, for the DNS name of
the Service (``<service>.<namespace>.svc``). This command makes such a pair for
development and testing: a throwaway CA (``ca.crt``; its key is never written, so
nothing else can be signed with it) and a serving certificate signed by it
(``tls.crt``/``tls.key``, ECDSA P-256, serverAuth), then prints the base64 ``caBundle``
to put into the webhook configuration (``deploy/base/webhook.yaml``). Production should use cert-manager (a
Certificate for the Service, and its cainjector filling ``caBundle``), which also
renews the certificate before it expires; this command does not renew anything.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.core.management.base import BaseCommand, CommandError, CommandParser

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
#: Back-dating of notBefore, so a clock a little behind ours still accepts the certificate.
CLOCK_SKEW = datetime.timedelta(minutes=5)


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names the kube-apiserver (or a pod) may use for the Service."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpuplane (development)"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_certificates(service: str, namespace: str, days: int, local: bool = False) -> tuple[bytes, bytes, bytes]:
    """Return (CA cert PEM, serving cert PEM, serving key PEM)."""
    now = datetime.datetime.now(datetime.UTC)
    not_before = now - CLOCK_SKEW
    not_after = now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"gpuplane webhook CA ({service}.{namespace})")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    names = service_names(service, namespace)
    alt: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    if local:
        alt += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[2]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return (
        ca_cert.public_bytes(serialization.Encoding.PEM),
        cert.public_bytes(serialization.Encoding.PEM),
        key_pem,
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` with ``mode`` from the start (the key is never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # O_CREAT's mode is filtered by the umask, and ignored for an existing file


class Command(BaseCommand):
    help = (
        "Create a self-signed CA and a serving certificate for the VMI webhook's Service "
        "(development and testing; use cert-manager in production). Writes ca.crt, tls.crt "
        "and tls.key into --out and prints the caBundle on the last line."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--service", default="gpuplane-webhook", help="the webhook's Service name")
        parser.add_argument("--namespace", default="gpuplane-system", help="the Service's namespace")
        parser.add_argument("--out", type=Path, required=True, help="directory to write the files into")
        parser.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
        parser.add_argument("--force", action="store_true", help="overwrite existing files")
        parser.add_argument(
            "--local", action="store_true", help="also valid for localhost and 127.0.0.1 (serving outside a cluster)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        service: str = options["service"]
        namespace: str = options["namespace"]
        out: Path = options["out"]
        days: int = options["days"]
        if not service or not namespace:
            raise CommandError("--service and --namespace must not be empty")
        if days < 1:
            raise CommandError(f"--days must be at least 1, not {days}")
        if out.exists() and not out.is_dir():
            raise CommandError(f"--out {out} exists and is not a directory")
        paths = {name: out / name for name in (CA_FILE, CERT_FILE, KEY_FILE)}
        existing = [str(p) for p in paths.values() if p.exists()]
        if existing and not options["force"]:
            raise CommandError(f"refusing to overwrite {', '.join(existing)} (pass --force to replace them)")
        out.mkdir(parents=True, exist_ok=True)

        ca_pem, cert_pem, key_pem = make_certificates(service, namespace, days, local=options["local"])
        _write(paths[CA_FILE], ca_pem, 0o644)
        _write(paths[CERT_FILE], cert_pem, 0o644)
        _write(paths[KEY_FILE], key_pem, 0o600)
        ca_bundle = base64.b64encode(ca_pem).decode("ascii")

        dns = f"{service}.{namespace}.svc"
        self.stdout.write(
            f"wrote {paths[CA_FILE]}, {paths[CERT_FILE]} and {paths[KEY_FILE]} (0600), valid {days} days for {dns}\n"
            "\n"
            "Next steps (development; production uses cert-manager and its cainjector):\n"
            f"  kubectl -n {namespace} create secret tls {service}-tls "
            f"--cert={paths[CERT_FILE]} --key={paths[KEY_FILE]}\n"
            "  The Deployment mounts that secret at /etc/gpuplane/tls and gunicorn serves it on 8443\n"
            "  (GPUPLANE_TLS_CERT_FILE=/etc/gpuplane/tls/tls.crt, GPUPLANE_TLS_KEY_FILE=/etc/gpuplane/tls/tls.key).\n"
            "  Then install with the caBundle below: with Helm,\n"
            "  CA_BUNDLE=<the last line>; helm install gpuplane charts/gpuplane --namespace "
            f"{namespace} --set webhook.caBundle=$CA_BUNDLE\n"
            "  or with Kustomize, in place of the placeholder in deploy/base/webhook.yaml:\n"
            "  CA_BUNDLE=<the last line>; kubectl kustomize deploy/overlays/cluster \\\n"
            '    | sed "s|FILL_ME_FROM_manage.py_webhook_cert|$CA_BUNDLE|" | kubectl apply -f -\n'
            "\n"
            "caBundle:"
        )
        self.stdout.write(ca_bundle)

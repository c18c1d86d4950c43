"""The webhook's certificates without cert-manager: a CA and a serving pair kept in Secrets, the CA
in the webhook registration's caBundle, the pair renewed before it expires.

The chart's ``webhook.certificates: self-signed-job`` runs this in the gpuplane image (a hook Job
before and after every install and upgrade, and a daily CronJob); nothing is needed on the
operator's machine. Each run is idempotent and says what it did:

1. The CA (Secret ``--ca-secret``: ``ca.crt``, ``ca.key``): made when missing, unreadable or
   within ``--renew-days`` of its end (``--ca-days`` long, ten years by default). A replaced CA
   that is still valid stays in the bundle (``bundle.crt``) beside the new one, so the apiserver
   trusts the old serving certificate until the new one is served.
2. The serving pair (Secret ``--secret``, type ``kubernetes.io/tls``: ``tls.crt``, ``tls.key``,
   ``ca.crt``): made when missing, not signed by the CA, not naming the Service
   (``<service>.<namespace>.svc`` and its shorter and longer forms), or within ``--renew-days``
   of its end (``--days`` long). The webhook server reloads it once the kubelet has updated the
   mounted Secret (``deploy/webhook_server.py``), without a restart.
3. The caBundle of each webhook of ``--webhook`` (a MutatingWebhookConfiguration) whose Service
   is ``--service``: set to the bundle when it differs. A configuration that does not exist yet
   (the hook before install) is left for the run after install.

Credentials: the pod's ServiceAccount in a cluster, else ``KUBECONFIG`` (the tests). Standard
library, cryptography and the kubernetes client only: no Django, no database.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Back-dating of notBefore, so a clock a little behind ours still accepts the certificate.
CLOCK_SKEW = dt.timedelta(minutes=5)


class CertificateError(RuntimeError):
    """What stops a run: its message says what to fix."""


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names the kube-apiserver (or a pod) may use for the Service."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(common_name: str, days: int, now: dt.datetime) -> tuple[bytes, bytes]:
    """A self-signed CA (ECDSA P-256): (certificate PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return _pem(cert), _key_pem(key)


def make_serving(
    ca_pem: bytes, ca_key_pem: bytes, names: Sequence[str], days: int, now: dt.datetime
) -> tuple[bytes, bytes]:
    """A serving certificate for ``names`` signed by the CA: (certificate PEM, key PEM)."""
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertificateError("the CA key is not an ECDSA key")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[2] if len(names) > 2 else names[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _pem(cert), _key_pem(key)


def _load(pem: bytes | None) -> x509.Certificate | None:
    if not pem:
        return None
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None


def _fresh(cert: x509.Certificate | None, renew: dt.timedelta, now: dt.datetime) -> bool:
    return cert is not None and cert.not_valid_after_utc - now > renew and cert.not_valid_before_utc <= now + CLOCK_SKEW


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception):  # noqa: BLE001 - any failure means "not by this CA"
        return False
    return True


def _names_of(cert: x509.Certificate) -> set[str]:
    try:
        return set(
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        )
    except x509.ExtensionNotFound:
        return set()


@dataclass
class Plan:
    """What a run found and decided, pure (the tests check it without a cluster)."""

    ca: bytes
    ca_key: bytes
    bundle: bytes
    cert: bytes
    key: bytes
    ca_renewed: bool
    serving_renewed: bool


def plan(
    ca_data: dict[str, bytes], tls_data: dict[str, bytes], names: Sequence[str], *, days: int, renew_days: int,
    ca_days: int, now: dt.datetime | None = None,
) -> Plan:  # fmt: skip
    """The CA, the bundle and the serving pair the Secrets should hold, given what they hold."""
    now = now or dt.datetime.now(dt.UTC)
    renew = dt.timedelta(days=renew_days)
    ca = _load(ca_data.get("ca.crt"))
    ca_renewed = not (_fresh(ca, renew, now) and ca_data.get("ca.key"))
    if ca_renewed:
        ca_pem, ca_key_pem = make_ca(f"{names[0]}-ca", ca_days, now)
        bundle = ca_pem + (_pem(ca) if ca is not None and ca.not_valid_after_utc > now else b"")
    else:
        ca_pem, ca_key_pem = ca_data["ca.crt"], ca_data["ca.key"]
        bundle = ca_data.get("bundle.crt") or ca_pem
        # A previous CA in the bundle is dropped once it has expired.
        kept = [c for c in x509.load_pem_x509_certificates(bundle) if c.not_valid_after_utc > now]
        bundle = b"".join(_pem(c) for c in kept) or ca_pem
    current_ca = x509.load_pem_x509_certificate(ca_pem)
    cert = _load(tls_data.get("tls.crt"))
    serving_renewed = not (
        cert is not None
        and tls_data.get("tls.key")
        and _fresh(cert, renew, now)
        and _signed_by(cert, current_ca)
        and set(names) <= _names_of(cert)
    )
    if serving_renewed:
        cert_pem, key_pem = make_serving(ca_pem, ca_key_pem, names, days, now)
    else:
        cert_pem, key_pem = tls_data["tls.crt"], tls_data["tls.key"]
    return Plan(ca_pem, ca_key_pem, bundle, cert_pem, key_pem, ca_renewed, serving_renewed)


# -- the cluster ----------------------------------------------------------------------------------


def _api() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client


def _secret_data(core: Any, namespace: str, name: str) -> tuple[dict[str, bytes], bool]:
    from kubernetes.client.exceptions import ApiException

    try:
        secret = core.read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return {}, False
        raise
    return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}, True


def _write_secret(core: Any, namespace: str, name: str, data: dict[str, bytes], exists: bool, kind: str) -> None:
    encoded = {k: base64.b64encode(v).decode() for k, v in data.items()}
    if exists:
        core.patch_namespaced_secret(name, namespace, {"data": encoded})
    else:
        body = {"apiVersion": "v1", "kind": "Secret", "type": kind, "metadata": {"name": name, "namespace": namespace}}
        core.create_namespaced_secret(namespace, {**body, "data": encoded})


def run(args: argparse.Namespace) -> list[str]:
    """One run against the cluster; the lines it reports."""
    from kubernetes.client.exceptions import ApiException

    client = _api()
    core = client.CoreV1Api()
    names = service_names(args.service, args.namespace)
    ca_data, ca_exists = _secret_data(core, args.namespace, args.ca_secret)
    tls_data, tls_exists = _secret_data(core, args.namespace, args.secret)
    found = plan(ca_data, tls_data, names, days=args.days, renew_days=args.renew_days, ca_days=args.ca_days)
    said = []
    if found.ca_renewed or found.bundle != ca_data.get("bundle.crt"):
        data = {"ca.crt": found.ca, "ca.key": found.ca_key, "bundle.crt": found.bundle}
        _write_secret(core, args.namespace, args.ca_secret, data, ca_exists, "Opaque")
    ca_end = x509.load_pem_x509_certificate(found.ca).not_valid_after_utc
    said.append(
        f"CA {args.namespace}/{args.ca_secret}: {'made' if found.ca_renewed else 'kept'}, valid until {ca_end:%Y-%m-%d}"
    )
    if found.serving_renewed:
        data = {"tls.crt": found.cert, "tls.key": found.key, "ca.crt": found.ca}
        _write_secret(core, args.namespace, args.secret, data, tls_exists, "kubernetes.io/tls")
    end = x509.load_pem_x509_certificate(found.cert).not_valid_after_utc
    said.append(
        f"serving certificate {args.namespace}/{args.secret} for {names[2]}: "
        f"{'made' if found.serving_renewed else 'kept'}, valid until {end:%Y-%m-%d}"
    )
    admission = client.AdmissionregistrationV1Api()
    try:
        configuration = admission.read_mutating_webhook_configuration(args.webhook)
    except ApiException as exc:
        if exc.status != 404:
            raise
        said.append(
            f"MutatingWebhookConfiguration {args.webhook}: not there yet (the run after install fills its caBundle)"
        )
        return said
    bundle = base64.b64encode(found.bundle).decode()
    ours = [
        index
        for index, hook in enumerate(configuration.webhooks or [])
        if hook.client_config.service is not None
        and (hook.client_config.service.name, hook.client_config.service.namespace) == (args.service, args.namespace)
    ]
    if not ours:
        raise CertificateError(
            f"MutatingWebhookConfiguration {args.webhook} has no webhook calling the Service {args.service}"
        )
    patch = [
        {"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": bundle}
        for index in ours
        if configuration.webhooks[index].client_config.ca_bundle != bundle
    ]
    if patch:
        admission.patch_mutating_webhook_configuration(args.webhook, patch)
    said.append(f"MutatingWebhookConfiguration {args.webhook}: caBundle {'set' if patch else 'already current'}")
    return said


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", required=True, help="the release's namespace (the Secrets and the Service)")
    parser.add_argument("--service", required=True, help="the webhook's Service")
    parser.add_argument("--secret", required=True, help="the kubernetes.io/tls Secret of the serving pair")
    parser.add_argument("--ca-secret", required=True, help="the Secret of the CA")
    parser.add_argument("--webhook", required=True, help="the MutatingWebhookConfiguration whose caBundle is set")
    parser.add_argument("--days", type=int, default=365, help="lifetime of a serving certificate (days)")
    parser.add_argument("--renew-days", type=int, default=30, help="renew when fewer days than this are left")
    parser.add_argument("--ca-days", type=int, default=3650, help="lifetime of a CA (days)")
    args = parser.parse_args(argv)
    if not 0 < args.renew_days < args.days <= args.ca_days:
        parser.error(f"need 0 < --renew-days ({args.renew_days}) < --days ({args.days}) <= --ca-days ({args.ca_days})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        for line in run(args):
            print(line, flush=True)
    except CertificateError as exc:
        print(f"webhook certificates: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

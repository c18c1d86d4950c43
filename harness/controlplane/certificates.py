"""The control plane's certificates, as envtest's tiny CA makes them: a CA of the session's own,
a serving certificate for 127.0.0.1/localhost per name, client certificates made on first use,
and the ServiceAccount signing key pair the apiserver requires."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    """A CA of the session's own and the files signed by it."""

    dir: Path

    @property
    def ca_file(self) -> Path:
        return self.dir / "ca.crt"

    def serving(self, name: str) -> tuple[Path, Path]:
        return self.dir / f"{name}.crt", self.dir / f"{name}.key"

    def client(self, name: str) -> tuple[Path, Path]:
        """A client certificate (CN ``name``) signed by the CA, made on first use."""
        crt, key_file = self.dir / f"client-{name}.crt", self.dir / f"client-{name}.key"
        if not crt.exists():
            ca_key = serialization.load_pem_private_key((self.dir / "ca.key").read_bytes(), password=None)
            ca = x509.load_pem_x509_certificate(self.ca_file.read_bytes())
            key = ec.generate_private_key(ec.SECP256R1())
            now = dt.datetime.now(dt.UTC)
            cert = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca.subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=2))
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .add_extension(
                    x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()),  # type: ignore[arg-type]
                    critical=False,
                )
                .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
            )
            crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            key_file.write_bytes(_key_pem(key))
        return crt, key_file


def _key_pem(key: Any) -> bytes:
    return bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def make_pki(directory: Path, serving_names: tuple[str, ...]) -> Pki:
    """A CA, a serving certificate for 127.0.0.1/localhost per name, and the
    ServiceAccount signing key pair the apiserver requires."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuplane-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "ca.key").write_bytes(_key_pem(ca_key))
    for name in serving_names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            # Python's strict X.509 checks (3.13) want both key identifiers.
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        crt, key_file = Pki(directory).serving(name)
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(_key_pem(key))
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (directory / "sa.key").write_bytes(_key_pem(sa_key))
    (directory / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return Pki(directory)

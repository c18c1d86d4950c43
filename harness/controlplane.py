"""A real Kubernetes control plane for the cluster-mode tests: etcd, kube-apiserver and
kube-controller-manager, the upstream binaries built from pinned Go modules
(``hack/kube-bin.sh``), as controller-runtime's envtest runs them.

One control plane per pytest-xdist worker, started on first use and stopped with the
session. Between tests :meth:`ControlPlane.reset` deletes every object a test could have
made (nodes, pods, namespaces, gpuplane's and KubeVirt's custom resources, admission
configurations) straight from etcd, which the apiserver's watch cache follows as
deletions; the CRDs, the RBAC from ``deploy/`` and the fault webhook's registration stay.
Restarting the apiserver per test would cost seconds each; a reset costs milliseconds.

What runs:

- **etcd** with its data in ``/dev/shm`` and ``--unsafe-no-fsync`` (nothing here must
  survive a crash), on two free loopback ports.
- **kube-apiserver** with RBAC on, its own CA and serving certificate, a token file
  with one token per identity (the test's admin in ``system:masters``, each
  ServiceAccount ``deploy/`` gives gpuplane's processes, and ``gpuplane-test``: the union of
  those roles, for tests that run every process in this one), the ``ServiceAccount``
  admission plugin off (as envtest does: no token controller runs), and an audit log of
  every resource request (what a test asks "which calls did gpuplane make" of).
- **kube-controller-manager** with only the namespace and garbage-collector controllers,
  so deleting a namespace really goes through the namespace controller (it waits for
  gpuplane's finalizers) and owner references really are acted on.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import functools
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

ROOT = Path(__file__).resolve().parents[1]
KUBE_BIN = ROOT / "hack" / "kube-bin.sh"
CRDS = ROOT / "deploy" / "base" / "crds"
RBAC = ROOT / "deploy" / "base" / "rbac.yaml"
FINALIZER_POLICY = ROOT / "deploy" / "base" / "finalizer-policy.yaml"
NAMESPACE = ROOT / "deploy" / "base" / "namespace.yaml"
#: KubeVirt's CRDs every control plane serves: the VMI's. Not the VirtualMachine's, an optional kind
#: to the sync: with it served, the garbage collector would delete the tests' VMIs, whose captured
#: shape names a VirtualMachine owner that does not exist (the VM cluster serves them all).
KUBEVIRT_READ = frozenset({"virtualmachineinstances.kubevirt.io"})
#: KubeVirt's CRDs, virt-controller and its RBAC, and the KubeVirt object (hack/kubevirt-bin.sh).
KUBEVIRT_BIN = ROOT / "hack" / "kubevirt-bin.sh"
#: kwok and the stages it runs with (hack/kwok-bin.sh).
KWOK_BIN = ROOT / "hack" / "kwok-bin.sh"
# Kinds whose CRD has no status subresource: KubeVirt's virt-controller writes a VMI's status
# with the object itself, and KubeVirt's own CRD (installed here) serves no ``/status``.
NO_STATUS_SUBRESOURCE = frozenset({"VirtualMachineInstance"})

#: gpuplane's namespace in deploy/ and the ServiceAccounts it gives each process.
SYSTEM_NAMESPACE = "gpuplane-system"
IDENTITIES = ("gpuplane-sync", "gpuplane-binder", "gpuplane-web", "gpuplane-webhook")
#: One user for the tests that run every gpuplane process in the test process: bound to
#: each of deploy/'s ClusterRoles, so it may do exactly what their union grants.
UNION_USER = "gpuplane-test"
ADMIN_USER = "test-admin"
#: Namespaces that exist in every cluster (made by the apiserver) or that the session set up.
KEPT_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease", SYSTEM_NAMESPACE})
#: Everything under these etcd prefixes is a test's own and goes at each reset.
RESET_PREFIXES = (
    "/registry/gpuplane.io/",
    "/registry/kubevirt.io/",
    "/registry/minions/",
    "/registry/pods/",
    "/registry/events/",
    "/registry/configmaps/",
    "/registry/leases/",
    "/registry/validatingadmissionpolicies/",
    "/registry/validatingadmissionpolicybindings/",
    "/registry/mutatingwebhookconfigurations/",
)
START_TIMEOUT = 60.0
#: Metadata the apiserver sets on create, whatever the client sends.
SERVER_SET = frozenset({"uid", "resourceVersion", "creationTimestamp", "selfLink", "generation", "managedFields"})
HOW_TO_GET_BINARIES = (
    "the cluster tests need etcd, kube-apiserver and kube-controller-manager: install Go >= 1.26 "
    "and run `make kube-bin`, or point KUBEBUILDER_ASSETS at a directory holding them"
)


class ControlPlaneError(RuntimeError):
    """The control plane could not be had: one line saying why and what to do."""


class ApiError(Exception):
    """A non-2xx answer of the apiserver to a test's own request."""

    def __init__(self, code: int, status: dict[str, Any]) -> None:
        self.code = code
        self.status = status
        self.reason = str(status.get("reason", ""))
        self.message = str(status.get("message", ""))
        super().__init__(f"{code} {self.reason}: {self.message}")


def built(script: Path, what: str, timeout: float = 3600) -> Path:
    """The directory a ``hack/*-bin.sh`` script built (or found) its outputs in: the script
    prints it last; a clear error naming ``what`` and how to get it otherwise."""
    try:
        done = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ControlPlaneError(f"{what} ({exc})") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ControlPlaneError(f"{what} (hack/{script.name}: {detail})")
    return Path(lines[-1])


@functools.cache
def binaries_dir() -> Path:
    """Where etcd, kube-apiserver, kube-controller-manager and kube-scheduler are."""
    return built(KUBE_BIN, HOW_TO_GET_BINARIES)


@functools.cache
def kubevirt_dir() -> Path:
    """KubeVirt's manifests as virt-operator installs them and virt-controller, built from the
    pinned kubevirt.io/kubevirt module (``hack/kubevirt-bin.sh``)."""
    return built(KUBEVIRT_BIN, "KubeVirt's CRDs and virt-controller: install Go >= 1.26 and run `make kube-bin`")


@functools.cache
def kwok_dir() -> Path:
    """kwok and its stages, built from the pinned sigs.k8s.io/kwok module (``hack/kwok-bin.sh``)."""
    return built(KWOK_BIN, "kwok: install Go >= 1.26 and run `make kube-bin`")


def tool(name: str) -> Path:
    """One binary: ``KUBEBUILDER_ASSETS`` first (envtest's convention), else the cache."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and (Path(assets) / name).is_file():
        return Path(assets) / name
    return binaries_dir() / name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- certificates ---------------------------------------------------------------------------------


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


# -- the processes ------------------------------------------------------------------------------


class Process:
    """One binary of the control plane, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        #: Variables set for this binary beside the test process's own (each start, restarts too).
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        handle = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **self.env} if self.env else None,
        )  # fmt: skip
        handle.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "users": ["system:kube-controller-manager", "system:apiserver"]},
        {"level": "None", "nonResourceURLs": ["/*"]},
        {"level": "Metadata"},
    ],
}


@dataclass(frozen=True)
class Call:
    """One resource request as the audit log saw it."""

    user: str
    group: str
    resource: str  # "gpus" or "gpus/status"
    verb: str
    namespace: str
    name: str
    code: int

    @property
    def rbac(self) -> tuple[str, str, str]:
        """What RBAC authorized: (API group, resource[/subresource], verb)."""
        return (self.group, self.resource, self.verb)


@dataclass(frozen=True)
class Profile:
    """What a control plane runs beyond etcd and kube-apiserver, and what its reset keeps.

    :data:`BASE` is the cluster most cluster tests need: only the namespace and garbage-collector
    controllers, KubeVirt's VMI CRD, and nothing that would act on the nodes and pods a test
    writes itself. The VM cluster (``harness.vm_cluster``) adds the node lifecycle and
    taint-eviction controllers, every KubeVirt CRD and the KubeVirt object, and the reset keeps
    what KubeVirt's controller needs (its namespace, its lease).
    """

    controllers: tuple[str, ...] = ("namespace-controller", "garbage-collector-controller")
    #: Every KubeVirt CRD, virt-controller's RBAC and the KubeVirt object, or the VMI CRD only.
    kubevirt: bool = False
    apiserver_flags: tuple[str, ...] = ()
    controller_manager_flags: tuple[str, ...] = ()
    #: Users beyond the admin and gpuplane's identities: (user name, groups).
    users: tuple[tuple[str, tuple[str, ...]], ...] = ()
    reset_prefixes: tuple[str, ...] = RESET_PREFIXES
    kept_namespaces: frozenset[str] = KEPT_NAMESPACES


BASE = Profile()


class ControlPlane:
    """etcd, kube-apiserver and kube-controller-manager on loopback ports."""

    def __init__(self, workdir: Path | None = None, profile: Profile = BASE) -> None:
        self.profile = profile
        # etcd's data in memory: nothing here must survive a crash.
        shm = Path("/dev/shm")  # noqa: S108 - a private mkdtemp directory under it
        base = shm if shm.is_dir() else Path(tempfile.gettempdir())
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="gpuplane-kube-", dir=base))
        self.etcd_port, self.peer_port, self.port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        #: The port a test serves a webhook on to be called with the apiserver's client certificate.
        self.webhook_cert_port = free_port()
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self.tokens: dict[str, str] = {}
        self.processes: dict[str, Process] = {}
        self.started_seconds = 0.0
        self._audit_offset = 0
        self._ssl: ssl.SSLContext | None = None
        #: The fault webhook (harness.faults.FaultWebhook), once registered.
        self.faults: Any = None

    # -- set-up ------------------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        started = time.monotonic()
        etcd, apiserver, kcm = tool("etcd"), tool("kube-apiserver"), tool("kube-controller-manager")
        self.pki = make_pki(self.dir / "pki", ("apiserver", "webhook"))
        self._write_tokens()
        (self.dir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        self._write_admission_config()
        self.audit_log = self.dir / "audit.log"
        self.processes["etcd"] = Process(
            "etcd",
            [
                str(etcd), "--name=gpuplane-test", f"--data-dir={self.dir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{self.peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{self.peer_port}",
                f"--initial-cluster=gpuplane-test=http://127.0.0.1:{self.peer_port}",
                "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648",
            ],
            self.dir / "etcd.log",
        )  # fmt: skip
        crt, key = self.pki.serving("apiserver")
        self.processes["kube-apiserver"] = Process(
            "kube-apiserver",
            [
                str(apiserver), f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1", f"--secure-port={self.port}", "--advertise-address=127.0.0.1",
                f"--tls-cert-file={crt}", f"--tls-private-key-file={key}", f"--client-ca-file={self.pki.ca_file}",
                f"--token-auth-file={self.dir / 'tokens.csv'}", "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={self.pki.dir / 'sa.pub'}",
                f"--service-account-signing-key-file={self.pki.dir / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
                # No endpoints for the kubernetes Service: 127.0.0.1 is not an address a pod could reach.
                "--endpoint-reconciler-type=none",
                "--disable-admission-plugins=ServiceAccount",
                f"--audit-policy-file={self.dir / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
                "--audit-log-mode=blocking", "--audit-log-maxsize=0",
                f"--admission-control-config-file={self.dir / 'admission.yaml'}",
                *self.profile.apiserver_flags,
            ],
            self.dir / "kube-apiserver.log",
        )  # fmt: skip
        self.processes["kube-controller-manager"] = Process(
            "kube-controller-manager",
            [
                str(kcm), f"--kubeconfig={self.kubeconfig('kube-controller-manager')}",
                f"--controllers={','.join(self.profile.controllers)}",
                "--leader-elect=false", "--secure-port=0", "--concurrent-namespace-syncs=4",
                *self.profile.controller_manager_flags,
            ],
            self.dir / "kube-controller-manager.log",
        )  # fmt: skip
        self.processes["etcd"].start()
        self._wait("etcd", lambda: self._etcd_healthy())
        self.processes["kube-apiserver"].start()
        self._wait("kube-apiserver", self._apiserver_ready)
        self._install()
        # After the CRDs serve: the namespace controller's discovery must know gpuplane's kinds
        # from its first namespace on, or it would finalize a namespace around objects it never saw.
        self.processes["kube-controller-manager"].start()
        self.started_seconds = time.monotonic() - started
        return self

    def _write_tokens(self) -> None:
        rows = []

        def add(user: str, uid: str, groups: list[str]) -> None:
            token = base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")
            self.tokens[user] = token
            rows.append(f'{token},{user},{uid},"{",".join(groups)}"')

        add(ADMIN_USER, "admin", ["system:masters"])
        # The namespace and garbage-collector controllers act on every kind; envtest runs them as admin too.
        add("kube-controller-manager", "kcm", ["system:masters"])
        # An admin the fault webhook does not spare: it probes that the webhook is registered.
        add("fault-probe", "fault-probe", ["system:masters"])
        for identity in IDENTITIES:
            add(
                f"system:serviceaccount:{SYSTEM_NAMESPACE}:{identity}",
                identity,
                ["system:serviceaccounts", f"system:serviceaccounts:{SYSTEM_NAMESPACE}"],
            )
        add(UNION_USER, UNION_USER, [])
        for user, groups in self.profile.users:
            add(user, user, list(groups))
        (self.dir / "tokens.csv").write_text("\n".join(rows) + "\n")
        # What the apiserver presents when it calls an admission webhook (docs/webhook.md, "Who
        # may call"): a client certificate for one port on localhost, this bearer token elsewhere.
        self.webhook_token = base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")
        (self.dir / "webhook-token").write_text(self.webhook_token + "\n")
        (self.dir / "tokens.csv").chmod(0o600)

    def _write_admission_config(self) -> None:
        """The AdmissionConfiguration docs/webhook.md tells operators to give the apiserver:
        a kubeconfig saying how it authenticates to webhooks, by the webhook's host."""
        crt, key = self.pki.client("apiserver-webhook-client")
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            # Users are matched by the webhook's host:port, then "*": the client certificate
            # for a webhook on localhost:<webhook_cert_port>, the token for every other.
            "users": [
                {"name": "*", "user": {"token": self.webhook_token}},
                {
                    "name": f"localhost:{self.webhook_cert_port}",
                    "user": {"client-certificate": str(crt), "client-key": str(key)},
                },
            ],
        }
        (self.dir / "webhook-kubeconfig.yaml").write_text(yaml.safe_dump(kubeconfig))
        plugin = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "WebhookAdmissionConfiguration",
            "kubeConfigFile": str(self.dir / "webhook-kubeconfig.yaml"),
        }
        admission = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "AdmissionConfiguration",
            "plugins": [
                {"name": "MutatingAdmissionWebhook", "configuration": plugin},
                {"name": "ValidatingAdmissionWebhook", "configuration": plugin},
            ],
        }
        (self.dir / "admission.yaml").write_text(yaml.safe_dump(admission))

    def user(self, identity: str) -> str:
        """The user name a deploy/ identity (``gpuplane-sync``...) authenticates as."""
        return f"system:serviceaccount:{SYSTEM_NAMESPACE}:{identity}" if identity in IDENTITIES else identity

    def token(self, identity: str) -> str:
        return self.tokens[self.user(identity)]

    def kube_api(self, identity: str, url: str | None = None) -> Any:
        """gpuplane's client (``binder.kube.client.KubeApi``) authenticating as ``identity``,
        as a kubeconfig would give it; ``url``: another endpoint (a plain-HTTP proxy)."""
        from kubernetes import client

        from binder.kube.client import KubeApi

        token = self.token(identity)
        configuration = client.Configuration()
        configuration.host = url or self.url
        configuration.api_key = {"authorization": token, "BearerToken": token}
        configuration.api_key_prefix = {"authorization": "Bearer", "BearerToken": "Bearer"}
        configuration.ssl_ca_cert = str(self.pki.ca_file)
        return KubeApi(client.ApiClient(configuration), request_timeout=10)

    def kubeconfig(self, identity: str = ADMIN_USER) -> Path:
        """A kubeconfig file for one identity (the token, the CA), as a process would mount it."""
        path = self.dir / f"kubeconfig-{identity.replace(':', '-')}"
        if not path.exists():
            config = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "test", "cluster": {"server": self.url, "certificate-authority": str(self.pki.ca_file)}}
                ],
                "users": [{"name": identity, "user": {"token": self.token(identity)}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": identity}}],
                "current-context": "test",
            }
            path.write_text(yaml.safe_dump(config))
            path.chmod(0o600)
        return path

    def _wait(self, name: str, ready: Any, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        process = self.processes.get(name)
        while time.monotonic() < deadline:
            if process is not None and not process.running():
                raise ControlPlaneError(f"{name} exited while starting; its log ends:\n{process.tail()}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.1)
        tail = process.tail() if process else ""
        raise ControlPlaneError(f"{name} was not ready within {timeout:.0f} s; its log ends:\n{tail}")

    def _etcd_healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as answer:  # noqa: S310 - loopback
            return bool(json.loads(answer.read()).get("health") == "true")

    def _apiserver_ready(self) -> bool:
        return bool(self.raw("GET", "/readyz") == "ok")

    def _install(self) -> None:
        """The CRDs (deploy/'s and KubeVirt's), deploy/'s namespace and RBAC, and the
        union identity's bindings; then wait until the CRDs serve."""
        docs: list[dict[str, Any]] = []
        for path in sorted(CRDS.glob("*.yaml")):
            if path.name != "kustomization.yaml":
                docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
        # KubeVirt's CRDs: all of them where virt-controller runs, else the VMI's (KUBEVIRT_READ).
        kubevirt = [d for d in yaml.safe_load_all((kubevirt_dir() / "crds.yaml").read_text()) if d]
        docs += [d for d in kubevirt if self.profile.kubevirt or d["metadata"]["name"] in KUBEVIRT_READ]
        docs += [d for d in yaml.safe_load_all(NAMESPACE.read_text()) if d]
        docs += [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
        for role in [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"]:
            docs.append({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{UNION_USER}-{role}"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": UNION_USER}],
            })  # fmt: skip
        for doc in docs:
            self.apply(doc)
        for doc in docs:
            if doc["kind"] == "CustomResourceDefinition":
                name = doc["metadata"]["name"]
                self._wait(
                    "kube-apiserver",
                    lambda n=name: any(
                        c["type"] == "Established" and c["status"] == "True"
                        for c in self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{n}")
                        .get("status", {})
                        .get("conditions", [])
                    ),
                )
        self._wait("kube-apiserver", lambda: self.request("GET", "/apis/gpuplane.io/v1alpha1/gpus") is not None)
        self._wait(
            "kube-apiserver", lambda: self.request("GET", "/apis/kubevirt.io/v1/virtualmachineinstances") is not None
        )

    # -- requests ----------------------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=str(self.pki.ca_file))
        return self._ssl

    def raw(
        self, method: str, path: str, body: bytes | None = None, *, content_type: str = "application/json",
        identity: str = ADMIN_USER, timeout: float = 15.0,
    ) -> str:  # fmt: skip
        headers = {"Authorization": f"Bearer {self.token(identity)}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        call = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(call, timeout=timeout, context=self.ssl_context()) as answer:  # noqa: S310
                return str(answer.read().decode())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                status = json.loads(text)
            except ValueError:
                status = {"message": text}
            raise ApiError(exc.code, status) from None

    def request(
        self, method: str, path: str, body: Any = None, *, content_type: str | None = None,
        identity: str = ADMIN_USER,
    ) -> Any:  # fmt: skip
        """One call as the test's admin (or ``identity``), JSON in and out; a refusal
        raises :class:`ApiError`. PATCH bodies are merge patches unless told otherwise."""
        data = json.dumps(body).encode() if body is not None else None
        kind = content_type or ("application/merge-patch+json" if method == "PATCH" else "application/json")
        text = self.raw(method, path, data, content_type=kind, identity=identity)
        return json.loads(text) if text else None

    def webhook_seconds(self, webhook: str) -> tuple[float, float]:
        """(calls, seconds) the apiserver has spent calling admission ``webhook`` since it
        started, from its own ``/metrics``: the webhook's share of a create as the caller sees it."""
        from prometheus_client.parser import text_string_to_metric_families

        calls = seconds = 0.0
        for family in text_string_to_metric_families(self.raw("GET", "/metrics")):
            if family.name != "apiserver_admission_webhook_admission_duration_seconds":
                continue
            for sample in family.samples:
                if sample.labels.get("name") != webhook:
                    continue
                if sample.name.endswith("_count"):
                    calls += sample.value
                elif sample.name.endswith("_sum"):
                    seconds += sample.value
        return calls, seconds

    def apply(self, obj: dict[str, Any], *, field_manager: str = "gpuplane-tests", dry_run: bool = False) -> Any:
        """Server-side apply of one object, as ``kubectl apply --server-side`` sends it."""
        from binder.kube.client import RESOURCES

        kind = obj["kind"]
        meta = obj["metadata"]
        path = RESOURCES[kind].path(meta.get("namespace"), meta["name"]) if kind in RESOURCES else _builtin_path(obj)
        query = {"fieldManager": field_manager, "force": "true"}
        if dry_run:
            query["dryRun"] = "All"
        return self.request(
            "PATCH", f"{path}?{urllib.parse.urlencode(query)}", obj, content_type="application/apply-patch+yaml"
        )

    def seed(self, *objects: dict[str, Any]) -> list[dict[str, Any]]:
        """Create each object, then write its status (through ``/status`` where the kind has
        one), the way real objects get theirs (kubelet, KubeVirt, gpuplane); returns them as
        stored.

        What the server decides for itself is realised rather than sent: it refuses a
        ``resourceVersion`` on create and replaces ``uid`` and ``creationTimestamp``. So a
        uid the test gave is swapped for the server's wherever later objects name it (owner
        references, KubeVirt's labels, a VMI's ``activePods``: statuses are written after
        every object exists), and GPUs the test dated later are created in a later second
        (the server's timestamps have second resolution), so "oldest order first" sees the
        order the test meant.
        """
        from binder.kube.client import RESOURCES

        uids: dict[str, str] = {}
        created_objects: list[tuple[dict[str, Any], dict[str, Any]]] = []
        last_given = ""
        last_second = 0
        for obj in objects:
            resource = RESOURCES[obj["kind"]]
            namespace = obj["metadata"].get("namespace")
            given = str(obj["metadata"].get("creationTimestamp") or "")
            if obj["kind"] == "GPU" and last_given and given > last_given:
                while int(time.time()) <= last_second:
                    time.sleep(0.02)
            body = {k: v for k, v in obj.items() if k != "status"}
            body["metadata"] = {k: v for k, v in obj["metadata"].items() if k not in SERVER_SET}
            created = self.request("POST", resource.path(namespace), _swap(body, uids))
            if obj["kind"] == "GPU":
                last_given, last_second = given, int(time.time())
            if obj["metadata"].get("uid"):
                uids[str(obj["metadata"]["uid"])] = created["metadata"]["uid"]
            created_objects.append((obj, created))
        stored = []
        for obj, created in created_objects:
            status = dict(obj.get("status") or {})
            if obj["kind"] == "Pod":
                status.pop("qosClass", None)  # computed by the server from the containers, immutable
            if status:
                resource = RESOURCES[obj["kind"]]
                sub = None if obj["kind"] in NO_STATUS_SUBRESOURCE else "status"
                path = resource.path(obj["metadata"].get("namespace"), created["metadata"]["name"], sub)
                created = self.request("PATCH", path, {"status": _swap(status, uids)})
            stored.append(created)
        return stored

    @contextlib.contextmanager
    def older_crd(self, plural: str, probe: dict[str, Any]) -> Iterator[None]:
        """While the block runs, ``<plural>.gpuplane.io`` is served with its value rules
        (patterns, CEL rules, lengths, item counts, required fields) stripped, as an older CRD served it:
        objects created then are what "slipped past" the rules means. ``probe`` is an object
        the current CRD refuses; the switch waits until the server takes it (dry run), and
        back until it refuses it again."""
        path = CRDS / f"{plural}.yaml"
        current = next(d for d in yaml.safe_load_all(path.read_text()) if d)
        lax = _strip_rules(json.loads(json.dumps(current)))
        resource = f"/apis/gpuplane.io/v1alpha1/namespaces/{probe['metadata'].get('namespace', '')}/{plural}"
        if not probe["metadata"].get("namespace"):
            resource = f"/apis/gpuplane.io/v1alpha1/{plural}"

        def accepted() -> bool:
            try:
                self.request("POST", resource + "?dryRun=All", probe)
            except ApiError:
                return False
            return True

        self.apply(lax)
        self._wait("kube-apiserver", accepted, timeout=30)
        try:
            yield
        finally:
            self.apply(current)
            self._wait("kube-apiserver", lambda: not accepted(), timeout=30)

    @contextlib.contextmanager
    def finalizer_policy(self, probe_namespace: str) -> Iterator[None]:
        """While the block runs, deploy/'s finalizer policy (a MutatingAdmissionPolicy and its
        binding) is installed, as deployed: the apiserver puts gpuplane's finalizer on every GPU
        and GPUClass it creates. The switch waits until a dry-run GPU create in
        ``probe_namespace`` (which must exist) comes back with the finalizer, and back until it
        comes back without (the apiserver loads policies from a watch, not at once)."""
        from binder.kube.client import FINALIZER

        docs = [d for d in yaml.safe_load_all(FINALIZER_POLICY.read_text()) if d]
        probe = {
            "apiVersion": "gpuplane.io/v1alpha1", "kind": "GPU",
            "metadata": {"name": "finalizer-policy-probe", "namespace": probe_namespace},
            "spec": {"className": "probe", "vmName": "probe"},
        }  # fmt: skip
        resource = f"/apis/gpuplane.io/v1alpha1/namespaces/{probe_namespace}/gpus?dryRun=All"

        def applied() -> bool:
            stored = self.request("POST", resource, probe)
            return FINALIZER in (stored["metadata"].get("finalizers") or ())

        for doc in docs:
            self.apply(doc)
        self._wait("kube-apiserver", applied, timeout=30)
        try:
            yield
        finally:
            for doc in reversed(docs):
                self.request("DELETE", _builtin_path(doc))
            self._wait("kube-apiserver", lambda: not applied(), timeout=30)

    # -- the audit log -------------------------------------------------------------------------------

    def mark_calls(self) -> None:
        """Forget the calls so far: :meth:`calls` returns only those made after this."""
        self._audit_offset = self.audit_log.stat().st_size if self.audit_log.exists() else 0

    def calls(self, user: str | None = None) -> list[Call]:
        """Resource requests since :meth:`mark_calls` (one per request: a watch counts once,
        when its response started), optionally of one user (an identity's or a user name)."""
        wanted = self.user(user) if user else None
        seen: set[str] = set()
        found: list[Call] = []
        if not self.audit_log.exists():
            return found
        with self.audit_log.open() as handle:
            handle.seek(self._audit_offset)
            for line in handle:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line being written
                ref = event.get("objectRef")
                if not ref or event.get("auditID") in seen:
                    continue
                seen.add(event["auditID"])
                username = event.get("user", {}).get("username", "")
                if wanted and username != wanted:
                    continue
                resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
                found.append(
                    Call(
                        username, ref.get("apiGroup", ""), resource, event.get("verb", ""),
                        ref.get("namespace", ""), ref.get("name", ""),
                        int(event.get("responseStatus", {}).get("code", 0)),
                    )
                )  # fmt: skip
        return found

    # -- resets and faults ----------------------------------------------------------------------------

    def etcd(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call to etcd's JSON gateway (``/v3/kv/...``)."""
        call = urllib.request.Request(  # noqa: S310 - loopback
            f"{self.etcd_url}/v3/{method}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(call, timeout=10) as answer:  # noqa: S310
            return dict(json.loads(answer.read()))

    def reset(self) -> None:
        """Delete every object a test could have made, straight from etcd; wait until the
        apiserver's caches no longer serve them."""
        kept = self.profile.kept_namespaces
        for prefix in self.profile.reset_prefixes:
            self.etcd("kv/deleterange", _prefix_range(prefix))
        listed = self.etcd("kv/range", {**_prefix_range("/registry/namespaces/"), "keys_only": True})
        for item in listed.get("kvs", []):
            key = base64.b64decode(item["key"]).decode()
            if key.rsplit("/", 1)[-1] not in kept:
                self.etcd("kv/deleterange", {"key": item["key"]})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = [
                len(self.request("GET", path)["items"])
                for path in ("/api/v1/nodes", "/api/v1/pods", "/apis/gpuplane.io/v1alpha1/gpus")
            ]
            namespaces = {n["metadata"]["name"] for n in self.request("GET", "/api/v1/namespaces")["items"]}
            if not any(left) and namespaces <= kept:
                break
            time.sleep(0.05)
        self.mark_calls()

    def kubelet_stops_pods(self, namespace: str, timeout: float = 30.0) -> int:
        """What the kubelets would do for a namespace being deleted: once the namespace
        controller marked its pods for deletion, confirm each one stopped (a delete with
        grace period 0). No kubelet runs here, and since Kubernetes 1.33 the namespace
        controller deletes a namespace's other objects only once its pods are gone."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = self.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
            if pods and all(p["metadata"].get("deletionTimestamp") for p in pods):
                for pod in pods:
                    name = pod["metadata"]["name"]
                    with contextlib.suppress(ApiError):
                        self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0")
                return len(pods)
            if not pods:
                return 0
            time.sleep(0.1)
        raise AssertionError(f"the namespace controller never deleted the pods of {namespace}")

    def revision(self) -> int:
        """etcd's current revision (a resourceVersion newer than every object's)."""
        return int(self.etcd("kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])

    def compact(self) -> int:
        """Compact etcd at its current revision, physically: a watch from any older
        resourceVersion is answered 410 Gone (the apiserver itself compacts every 5 min)."""
        revision = self.revision()
        self.etcd("kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def restart_apiserver(self, down_seconds: float = 0.0) -> None:
        """Stop kube-apiserver (every connection breaks, every watch ends), wait, start it
        again on the same port and wait until it is ready: an outage of the API."""
        process = self.processes["kube-apiserver"]
        process.stop()
        time.sleep(down_seconds)
        process.start()
        self._wait("kube-apiserver", self._apiserver_ready)

    def stop(self) -> None:
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            if name in self.processes:
                self.processes[name].stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _swap(value: Any, uids: dict[str, str]) -> Any:
    """``value`` with every uid the test gave replaced by the one the server assigned."""
    if not uids:
        return value
    text = json.dumps(value)
    for given, assigned in uids.items():
        text = text.replace(given, assigned)
    return json.loads(text)


RULE_KEYS = ("pattern", "x-kubernetes-validations", "maxLength", "maxItems", "minLength", "minItems", "required")


def _strip_rules(node: Any) -> Any:
    """A schema without its value rules (types and structure kept: it stays structural)."""
    if isinstance(node, dict):
        for key in (
            "pattern",
            "x-kubernetes-validations",
            "maxLength",
            "maxItems",
            "minLength",
            "minItems",
            "required",
        ):
            node.pop(key, None)
        if node.get("x-kubernetes-list-type") == "set":
            node["x-kubernetes-list-type"] = "atomic"
        for value in node.values():
            _strip_rules(value)
    elif isinstance(node, list):
        for value in node:
            _strip_rules(value)
    return node


def _prefix_range(prefix: str) -> dict[str, str]:
    """etcd's [key, range_end) for every key with ``prefix``."""
    raw = prefix.encode()
    end = raw[:-1] + bytes([raw[-1] + 1])
    return {"key": base64.b64encode(raw).decode(), "range_end": base64.b64encode(end).decode()}


#: Built-in kinds the tests apply, by kind: (API path prefix, plural, namespaced).
_BUILTIN = {
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "Service": ("/api/v1", "services", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "MutatingWebhookConfiguration": ("/apis/admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations", False),
    "ValidatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", False,
    ),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    "MutatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "mutatingadmissionpolicies", False),
    "MutatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1", "mutatingadmissionpolicybindings", False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicybindings", False,
    ),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
}  # fmt: skip


def _builtin_path(obj: dict[str, Any]) -> str:
    try:
        prefix, plural, namespaced = _BUILTIN[obj["kind"]]
    except KeyError:
        raise ValueError(f"harness/controlplane.py does not know where {obj['kind']} lives") from None
    meta = obj["metadata"]
    namespace = f"/namespaces/{meta.get('namespace', 'default')}" if namespaced else ""
    return f"{prefix}{namespace}/{plural}/{meta['name']}"

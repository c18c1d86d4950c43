"""kube-apiserver for the control plane: its flags, the identities it authenticates, the
AdmissionConfiguration saying how it authenticates to webhooks, and the requests a test makes.

RBAC is on; a token file holds one token per identity (the test's admin in ``system:masters``,
each ServiceAccount ``deploy/`` gives gpuplane's processes, and ``gpuplane-test``: the union of
those roles, for tests that run every process in this one); the ``ServiceAccount`` admission
plugin is off (as envtest does: no token controller runs).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from harness.controlplane.audit import AuditLog
from harness.controlplane.certificates import Pki
from harness.controlplane.processes import START_TIMEOUT, Process, wait_ready
from harness.ports import free_port
from harness.prometheus import histogram_totals

#: gpuplane's namespace in deploy/ and the ServiceAccounts it gives each process.
SYSTEM_NAMESPACE = "gpuplane-system"
IDENTITIES = ("gpuplane-sync", "gpuplane-binder", "gpuplane-web", "gpuplane-webhook")
#: One user for the tests that run every gpuplane process in the test process: bound to
#: each of deploy/'s ClusterRoles, so it may do exactly what their union grants.
UNION_USER = "gpuplane-test"
ADMIN_USER = "test-admin"


class ApiError(Exception):
    """A non-2xx answer of the apiserver to a test's own request."""

    def __init__(self, code: int, status: dict[str, Any]) -> None:
        self.code = code
        self.status = status
        self.reason = str(status.get("reason", ""))
        self.message = str(status.get("message", ""))
        super().__init__(f"{code} {self.reason}: {self.message}")


class ApiServer:
    """One kube-apiserver on a free loopback port, its files under ``directory``; ``users``:
    identities beyond the admin and gpuplane's, as (user name, groups)."""

    def __init__(self, directory: Path, users: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> None:
        self.dir = directory
        self.users = users
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        #: The port a test serves a webhook on to be called with the apiserver's client certificate.
        self.webhook_cert_port = free_port()
        self.tokens: dict[str, str] = {}
        self.webhook_token = ""
        self.process: Process | None = None
        self._ssl: ssl.SSLContext | None = None

    def configure(self, binary: Path, pki: Pki, etcd_url: str, audit: AuditLog, flags: tuple[str, ...]) -> Process:
        """Write the token file and the admission configuration; the process, not started."""
        self.pki = pki
        self._write_tokens()
        self._write_admission_config()
        crt, key = pki.serving("apiserver")
        self.process = Process(
            "kube-apiserver",
            [
                str(binary), f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1", f"--secure-port={self.port}", "--advertise-address=127.0.0.1",
                f"--tls-cert-file={crt}", f"--tls-private-key-file={key}", f"--client-ca-file={pki.ca_file}",
                f"--token-auth-file={self.dir / 'tokens.csv'}", "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki.dir / 'sa.pub'}",
                f"--service-account-signing-key-file={pki.dir / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
                # No endpoints for the kubernetes Service: 127.0.0.1 is not an address a pod could reach.
                "--endpoint-reconciler-type=none",
                "--disable-admission-plugins=ServiceAccount",
                f"--audit-policy-file={audit.policy}", f"--audit-log-path={audit.path}",
                "--audit-log-mode=blocking", "--audit-log-maxsize=0",
                f"--admission-control-config-file={self.dir / 'admission.yaml'}",
                *flags,
            ],
            self.dir / "kube-apiserver.log",
        )  # fmt: skip
        return self.process

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
        for user, groups in self.users:
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

    def ready(self) -> bool:
        return bool(self.raw("GET", "/readyz") == "ok")

    def wait(self, ready: Callable[[], Any], timeout: float = START_TIMEOUT) -> None:
        """Until ``ready()`` is true; an error with the end of the apiserver's log if it exits first."""
        wait_ready("kube-apiserver", self.process, ready, timeout)

    # -- identities ------------------------------------------------------------------------------

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
        metric = "apiserver_admission_webhook_admission_duration_seconds"
        return histogram_totals(self.raw("GET", "/metrics"), metric, name=webhook)

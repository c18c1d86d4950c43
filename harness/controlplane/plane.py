"""The control plane as the tests and the benches use it: etcd, kube-apiserver and
kube-controller-manager started together, reset between tests, and the faults a test causes
(etcd compaction, an apiserver outage).

One control plane per pytest-xdist worker, started on first use and stopped with the
session. Between tests :meth:`ControlPlane.reset` deletes every object a test could have
made (nodes, pods, namespaces, gpuplane's and KubeVirt's custom resources, admission
configurations) straight from etcd, which the apiserver's watch cache follows as
deletions; the CRDs, the RBAC from ``deploy/`` and the fault webhook's registration stay.
Restarting the apiserver per test would cost seconds each; a reset costs milliseconds.

kube-controller-manager runs only the namespace and garbage-collector controllers (a
:class:`Profile` adds others), so deleting a namespace really goes through the namespace
controller (it waits for gpuplane's finalizers) and owner references really are acted on.
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.controlplane import objects
from harness.controlplane.apiserver import ADMIN_USER, SYSTEM_NAMESPACE, ApiError, ApiServer
from harness.controlplane.audit import AuditLog, Call
from harness.controlplane.certificates import Pki, make_pki
from harness.controlplane.etcd import Etcd, prefix_range
from harness.controlplane.processes import START_TIMEOUT, Process, tool, wait_ready

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
    """etcd, kube-apiserver and kube-controller-manager on loopback ports.

    Its parts: ``etcd_server`` (:class:`~harness.controlplane.etcd.Etcd`), ``api_server``
    (:class:`~harness.controlplane.apiserver.ApiServer`: identities and requests) and ``audit``
    (:class:`~harness.controlplane.audit.AuditLog`); what a test asks of them is asked here.
    """

    def __init__(self, workdir: Path | None = None, profile: Profile = BASE) -> None:
        self.profile = profile
        # etcd's data in memory: nothing here must survive a crash.
        shm = Path("/dev/shm")  # noqa: S108 - a private mkdtemp directory under it
        base = shm if shm.is_dir() else Path(tempfile.gettempdir())
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="gpuplane-kube-", dir=base))
        self.etcd_server = Etcd(self.dir)
        self.api_server = ApiServer(self.dir, profile.users)
        self.audit = AuditLog(self.dir)
        self.processes: dict[str, Process] = {}
        self.started_seconds = 0.0
        #: The fault webhook (harness.faults.FaultWebhook), once registered.
        self.faults: Any = None

    # -- set-up ------------------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        started = time.monotonic()
        etcd, apiserver, kcm = tool("etcd"), tool("kube-apiserver"), tool("kube-controller-manager")
        pki = make_pki(self.dir / "pki", ("apiserver", "webhook"))
        self.audit.write_policy()
        self.processes["etcd"] = self.etcd_server.process(etcd)
        self.processes["kube-apiserver"] = self.api_server.configure(
            apiserver, pki, self.etcd_url, self.audit, self.profile.apiserver_flags
        )
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
        self._wait("etcd", self.etcd_server.healthy)
        self.processes["kube-apiserver"].start()
        self._wait("kube-apiserver", self.api_server.ready)
        objects.install(self.api_server, self.profile.kubevirt)
        # After the CRDs serve: the namespace controller's discovery must know gpuplane's kinds
        # from its first namespace on, or it would finalize a namespace around objects it never saw.
        self.processes["kube-controller-manager"].start()
        self.started_seconds = time.monotonic() - started
        return self

    def _wait(self, name: str, ready: Callable[[], Any], timeout: float = START_TIMEOUT) -> None:
        """Until ``ready()`` is true; an error with the end of the process ``name``'s log if it exits first."""
        wait_ready(name, self.processes.get(name), ready, timeout)

    # -- the parts' addresses and files ------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.api_server.url

    @property
    def port(self) -> int:
        return self.api_server.port

    @property
    def pki(self) -> Pki:
        return self.api_server.pki

    @property
    def tokens(self) -> dict[str, str]:
        return self.api_server.tokens

    @property
    def webhook_token(self) -> str:
        """The bearer token the apiserver presents to admission webhooks (not on localhost:``webhook_cert_port``)."""
        return self.api_server.webhook_token

    @property
    def webhook_cert_port(self) -> int:
        """The port a test serves a webhook on to be called with the apiserver's client certificate."""
        return self.api_server.webhook_cert_port

    @property
    def etcd_url(self) -> str:
        return self.etcd_server.url

    @property
    def audit_log(self) -> Path:
        return self.audit.path

    # -- identities and requests (harness.controlplane.apiserver) ------------------------------------

    def user(self, identity: str) -> str:
        """The user name a deploy/ identity (``gpuplane-sync``...) authenticates as."""
        return self.api_server.user(identity)

    def token(self, identity: str) -> str:
        return self.api_server.token(identity)

    def kube_api(self, identity: str, url: str | None = None) -> Any:
        """gpuplane's client (``binder.kube.client.KubeApi``) authenticating as ``identity``;
        ``url``: another endpoint (a plain-HTTP proxy)."""
        return self.api_server.kube_api(identity, url)

    def kubeconfig(self, identity: str = ADMIN_USER) -> Path:
        """A kubeconfig file for one identity (the token, the CA), as a process would mount it."""
        return self.api_server.kubeconfig(identity)

    def ssl_context(self) -> ssl.SSLContext:
        return self.api_server.ssl_context()

    def raw(
        self, method: str, path: str, body: bytes | None = None, *, content_type: str = "application/json",
        identity: str = ADMIN_USER, timeout: float = 15.0,
    ) -> str:  # fmt: skip
        return self.api_server.raw(method, path, body, content_type=content_type, identity=identity, timeout=timeout)

    def request(
        self, method: str, path: str, body: Any = None, *, content_type: str | None = None,
        identity: str = ADMIN_USER,
    ) -> Any:  # fmt: skip
        """One call as the test's admin (or ``identity``), JSON in and out; a refusal
        raises :class:`ApiError`. PATCH bodies are merge patches unless told otherwise."""
        return self.api_server.request(method, path, body, content_type=content_type, identity=identity)

    def webhook_seconds(self, webhook: str) -> tuple[float, float]:
        """(calls, seconds) the apiserver has spent calling admission ``webhook`` since it started."""
        return self.api_server.webhook_seconds(webhook)

    # -- objects (harness.controlplane.objects) ----------------------------------------------------

    def apply(self, obj: dict[str, Any], *, field_manager: str = "gpuplane-tests", dry_run: bool = False) -> Any:
        """Server-side apply of one object, as ``kubectl apply --server-side`` sends it."""
        return objects.apply(self.api_server, obj, field_manager=field_manager, dry_run=dry_run)

    def seed(self, *created: dict[str, Any]) -> list[dict[str, Any]]:
        """Create each object, then write its status as its writer would; returns them as stored
        (:func:`harness.controlplane.objects.seed`)."""
        return objects.seed(self.api_server, *created)

    def older_crd(self, plural: str, probe: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
        """While the block runs, ``<plural>.gpuplane.io`` is served without its value rules
        (:func:`harness.controlplane.objects.older_crd`)."""
        return objects.older_crd(self.api_server, plural, probe)

    def finalizer_policy(self, probe_namespace: str) -> contextlib.AbstractContextManager[None]:
        """While the block runs, deploy/'s finalizer policy is installed
        (:func:`harness.controlplane.objects.finalizer_policy`)."""
        return objects.finalizer_policy(self.api_server, probe_namespace)

    # -- the audit log (harness.controlplane.audit) ------------------------------------------------

    def mark_calls(self) -> None:
        """Forget the calls so far: :meth:`calls` returns only those made after this."""
        self.audit.mark()

    def calls(self, user: str | None = None) -> list[Call]:
        """Resource requests since :meth:`mark_calls` (one per request: a watch counts once,
        when its response started), optionally of one user (an identity's or a user name)."""
        return self.audit.calls(self.user(user) if user else None)

    # -- resets and faults ----------------------------------------------------------------------------

    def etcd(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call to etcd's JSON gateway (``/v3/kv/...``)."""
        return self.etcd_server.call(method, body)

    def reset(self) -> None:
        """Delete every object a test could have made, straight from etcd; wait until the
        apiserver's caches no longer serve them."""
        kept = self.profile.kept_namespaces
        for prefix in self.profile.reset_prefixes:
            self.etcd("kv/deleterange", prefix_range(prefix))
        listed = self.etcd("kv/range", {**prefix_range("/registry/namespaces/"), "keys_only": True})
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
        return self.etcd_server.revision()

    def compact(self) -> int:
        """Compact etcd at its current revision, physically: a watch from any older
        resourceVersion is answered 410 Gone (the apiserver itself compacts every 5 min)."""
        return self.etcd_server.compact()

    def restart_apiserver(self, down_seconds: float = 0.0) -> None:
        """Stop kube-apiserver (every connection breaks, every watch ends), wait, start it
        again on the same port and wait until it is ready: an outage of the API."""
        process = self.processes["kube-apiserver"]
        process.stop()
        time.sleep(down_seconds)
        process.start()
        self._wait("kube-apiserver", self.api_server.ready)

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

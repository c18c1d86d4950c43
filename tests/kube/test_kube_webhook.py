"""The VMI webhook called by the real kube-apiserver, registered as deploy/ registers it.

The MutatingWebhookConfiguration comes from deploy/'s cluster overlay with the two values an
operator sets (docs/webhook.md): where the webhook is (here a URL on loopback instead of the
Service) and the caBundle of the CA that signed its serving certificate. The webhook is
deploy/webhook_server.py over TLS, authenticating the apiserver as docs/webhook.md tells
operators to: by a bearer token or by a client certificate, both given to the apiserver by
its AdmissionConfiguration (harness/controlplane/apiserver.py). VMIs are created through the
API as a user creates them; what the apiserver stores, or the error the user sees, is what
is checked. The webhook server is another process reading the test's database. On PostgreSQL
it is deployed as in production: the binder is a `celery worker` and each process has its own
identity. On SQLite it is the embedded topology: no broker, so the answer pass runs inside the
webhook server, under one identity holding deploy/'s grants together.

KubeVirt's own VirtualMachineInstance CRD is installed (harness/controlplane/objects.py), so
every stored VMI, patched by the webhook, passed KubeVirt's schema.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from binder import sync
from binder.kube.kinds import BY_KIND
from binder.models import GpuDevice, SyncStatus
from binder.runtime.passes import run_pass
from harness import workers
from harness.controlplane import UNION_USER, ApiError, ControlPlane
from harness.factories import new_vmi
from harness.manifests import register_webhook as register
from harness.ports import free_port
from harness.shapes import H100, budget_obj, class_obj, gpu_obj, namespace_obj, node_obj

pytestmark = [pytest.mark.django_db(transaction=True)]
VMIS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
OWN_TOLERATION = {"key": "dedicated", "operator": "Equal", "value": "vms", "effect": "NoSchedule"}


def embedded() -> bool:
    """SQLite: the embedded topology (tasks in the webhook server's process)."""
    return connection.vendor == "sqlite"


@pytest.fixture(params=["token", "client-cert"])
def webhook(request: Any, apiserver: ControlPlane, tmp_path: Path) -> Iterator[workers.Served]:
    """The webhook server as deployed (TLS, the caller checked), registered with the apiserver."""
    crt, key = apiserver.pki.serving("webhook")
    env = {
        **os.environ,
        "DATABASE_URL": workers.database_url(),
        "GPUPLANE_VAR_DIR": str(tmp_path),
        "GPUPLANE_AUTO_PASS": "false",
        "GPUPLANE_CLUSTER": "kubernetes",
        "KUBECONFIG": str(apiserver.kubeconfig(UNION_USER if embedded() else "gpuplane-webhook")),
        "GPUPLANE_TLS_CERT_FILE": str(crt),
        "GPUPLANE_TLS_KEY_FILE": str(key),
        "GPUPLANE_WEBHOOK_AUTH": request.param,
        "GPUPLANE_BIND_WAIT_SECONDS": "2",
    }
    env.pop("GPUPLANE_KUBE_HOST", None)
    env.pop("CELERY_BROKER_URL", None)
    if not embedded():
        env.update(CELERY_BROKER_URL=workers.REDIS_URL, GPUPLANE_BROKER_KEY_PREFIX=workers.PREFIX)
    if request.param == "token":
        env["GPUPLANE_WEBHOOK_TOKEN_FILE"] = str(apiserver.dir / "webhook-token")
        with workers.webhook_server(env, tmp_path, scheme="https", probe_http=False) as url:
            yield url
    else:
        # The apiserver presents its client certificate to this one host:port.
        env["GPUPLANE_WEBHOOK_CLIENT_CA"] = str(apiserver.pki.ca_file)
        port = apiserver.webhook_cert_port
        with workers.webhook_server(env, tmp_path, scheme="https", probe_http=False, port=port) as served:
            yield workers.Served(f"https://localhost:{port}", served.pgid)


def bound_cluster(plane: ControlPlane) -> None:
    """t1's vm1: two H100 Bound on n1 (hostname label hgx-01, tainted for GPU workloads, which
    the class tolerates); t2 has a device of its own."""
    node = node_obj("n1", {H100: 8})
    node["metadata"]["labels"]["kubernetes.io/hostname"] = "hgx-01"
    node["spec"]["taints"] = [GPU_TAINT]
    h100 = class_obj("h100", H100)
    h100["spec"]["tolerations"] = [GPU_TOLERATION]
    plane.seed(
        namespace_obj("t1"),
        namespace_obj("t2"),
        node,
        h100,
        gpu_obj("t1", "vm1-gpu0", "h100", "vm1"),
        gpu_obj("t1", "vm1-gpu1", "h100", "vm1"),
        gpu_obj("t2", "other-gpu0", "h100", "other"),
    )
    sync.sync_once()
    run_pass("full")


def create_vmi(plane: ControlPlane, vmi: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    body = {k: v for k, v in vmi.items() if k != "status"}
    body["metadata"] = {k: v for k, v in vmi["metadata"].items() if v is not None}
    query = "?dryRun=All" if dry_run else ""
    return dict(plane.request("POST", VMIS.format(ns=vmi["metadata"]["namespace"]) + query, body))


def wait_until_called(plane: ControlPlane, vmi: dict[str, Any]) -> dict[str, Any]:
    """The apiserver picks a new webhook configuration up within a second or so: dry-run
    creates (the webhook writes nothing for them) until one comes back patched."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stored = create_vmi(plane, vmi, dry_run=True)
        if stored["spec"].get("nodeSelector", {}).get("kubernetes.io/hostname"):
            return stored
        time.sleep(0.2)
    raise AssertionError("the apiserver never called the webhook")


def test_a_vmi_naming_a_bound_set_is_stored_pinned(apiserver: ControlPlane, webhook: str) -> None:
    bound_cluster(apiserver)
    register(apiserver, webhook)
    vmi = new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"])
    vmi["spec"]["tolerations"] = [OWN_TOLERATION]
    wait_until_called(apiserver, vmi)
    stored = create_vmi(apiserver, vmi)
    # Pinned by the node's own hostname label, not its name.
    assert stored["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "hgx-01"
    names = [g["deviceName"] for g in stored["spec"]["domain"]["devices"]["gpus"]]
    assert names == [H100, H100]
    # The class's toleration merged after the VMI's own, which is kept.
    assert stored["spec"]["tolerations"] == [OWN_TOLERATION, GPU_TOLERATION]
    assert apiserver.request("GET", VMIS.format(ns="t1") + "/vm1")["metadata"]["uid"] == stored["metadata"]["uid"]


def test_a_dry_run_leaves_nothing_behind(apiserver: ControlPlane, webhook: str) -> None:
    bound_cluster(apiserver)
    register(apiserver, webhook)
    wait_until_called(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
    assert apiserver.request("GET", VMIS.format(ns="t1"))["items"] == []
    annotations = apiserver.request("GET", "/apis/gpuplane.io/v1alpha1/namespaces/t1/gpus/vm1-gpu0")["metadata"]
    assert "gpuplane.io/bind-request" not in (annotations.get("annotations") or {})


def test_another_tenants_device_is_refused_with_the_webhooks_words(apiserver: ControlPlane, webhook: str) -> None:
    bound_cluster(apiserver)
    register(apiserver, webhook)
    wait_until_called(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
    with pytest.raises(ApiError) as refused:
        create_vmi(apiserver, new_vmi("t1", "thief", ["other-gpu0"]))
    assert refused.value.code in (400, 403)
    assert 'admission webhook "vmi.gpuplane.io" denied the request' in refused.value.message
    assert "other-gpu0" in refused.value.message
    assert apiserver.request("GET", VMIS.format(ns="t1"))["items"] == []


def test_with_the_webhook_down_failure_policy_fail_refuses_the_create(apiserver: ControlPlane, tmp_path: Path) -> None:
    """No server behind the registered URL: the apiserver's own error, nothing stored."""
    bound_cluster(apiserver)
    register(apiserver, f"https://127.0.0.1:{free_port()}")
    deadline = time.monotonic() + 30
    while True:
        try:
            create_vmi(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]), dry_run=True)
        except ApiError as exc:
            assert exc.code == 500
            assert 'failed calling webhook "vmi.gpuplane.io"' in exc.message
            break
        assert time.monotonic() < deadline, "the configuration was never picked up"
        time.sleep(0.2)
    assert apiserver.request("GET", VMIS.format(ns="t1"))["items"] == []


@pytest.mark.slow
def test_a_vmi_naming_a_pending_set_is_admitted_through_the_real_chain(
    apiserver: ControlPlane, webhook: str, start_worker: Any, tmp_path: Path
) -> None:
    """Every process as deployed, each as its own identity: the sync (``manage.py
    sync_cluster``), the binder (a `celery worker`; on SQLite the webhook server's own
    in-process task) and the webhook server. The webhook writes the bind request, the answer
    pass binds the set and writes the answer through ``/status``, and the apiserver stores the
    VMI pinned, within the webhook's 10 s timeout."""
    bound_cluster(apiserver)
    apiserver.seed(gpu_obj("t1", "vm2-gpu0", "h100", "vm2"))
    sync_env = {
        **os.environ,
        "DATABASE_URL": workers.database_url(),
        "GPUPLANE_VAR_DIR": str(tmp_path),
        "GPUPLANE_CLUSTER": "kubernetes",
        # Events queue no full pass here: the order must still be Pending when its VMI starts.
        "GPUPLANE_AUTO_PASS": "false",
        # Watches far longer than the test: stopping must not wait for them to end.
        "GPUPLANE_WATCH_SECONDS": "600",
        "KUBECONFIG": str(apiserver.kubeconfig("gpuplane-sync")),
    }
    sync_env.pop("GPUPLANE_KUBE_HOST", None)
    sync_env.pop("CELERY_BROKER_URL", None)
    if not embedded():
        sync_env.update(CELERY_BROKER_URL=workers.REDIS_URL, GPUPLANE_BROKER_KEY_PREFIX=workers.PREFIX)
    listed_before = dict(SyncStatus.objects.values_list("kind", "relists"))  # the test's own list
    log = (tmp_path / "sync.log").open("w")
    syncing = subprocess.Popen(
        [sys.executable, "manage.py", "sync_cluster", "--no-progress"],
        cwd=workers.ROOT, env=sync_env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        if not embedded():
            binder = apiserver.kubeconfig("gpuplane-binder")
            start_worker("binder", GPUPLANE_CLUSTER="kubernetes", KUBECONFIG=str(binder))
        register(apiserver, webhook)
        wait_until_called(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
        # The sync process has mirrored the new order (it starts, lists, then watches).
        deadline = time.monotonic() + 30
        while not GpuDevice.objects.filter(namespace__name="t1", name="vm2-gpu0").exists():
            assert time.monotonic() < deadline, (tmp_path / "sync.log").read_text()
            time.sleep(0.1)
        started = time.monotonic()
        stored = create_vmi(apiserver, new_vmi("t1", "vm2", ["vm2-gpu0"]))
        seconds = time.monotonic() - started
        assert stored["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "hgx-01"
        assert seconds < 10, seconds
        gpu = apiserver.request("GET", "/apis/gpuplane.io/v1alpha1/namespaces/t1/gpus/vm2-gpu0")
        request_id = gpu["metadata"]["annotations"]["gpuplane.io/bind-request"]
        assert gpu["status"]["answeredRequest"] == request_id and gpu["status"]["phase"] == "Bound"
        refused = [c for c in apiserver.calls() if c.code == 403]
        assert not refused, refused
        # Each kind was listed once: its watch went on from the first list's version (a
        # second list at start cost a minute of CPU at 100k GPUs).
        # (An optional kind this control plane does not serve, KubeVirt's VirtualMachine, is
        # listed again later to see whether it is served by then.)
        relists = {s.kind: s.relists - listed_before.get(s.kind, 0) for s in SyncStatus.objects.all()}
        served = [kind for kind in sync.SYNC_ORDER if not BY_KIND[kind].optional]
        assert {kind: relists[kind] for kind in served} == dict.fromkeys(served, 1)
        # SIGTERM (a rollout, a node drain) stops the sync with its watches open: each
        # kind's thread sees the stop between its stream's events, not at the watch's end.
        syncing.terminate()
        assert syncing.wait(60) == 0
        assert (tmp_path / "sync.log").read_text().rstrip().endswith("stopped")
    finally:
        syncing.terminate()
        try:
            syncing.wait(10)
        except subprocess.TimeoutExpired:
            syncing.kill()
            syncing.wait(10)
        log.close()


def test_an_order_over_budget_is_refused_naming_the_key(apiserver: ControlPlane, webhook: str) -> None:
    bound_cluster(apiserver)
    apiserver.seed(budget_obj("t1", {"h100": 2}), gpu_obj("t1", "vm2-gpu0", "h100", "vm2"))
    sync.sync_once()
    register(apiserver, webhook)
    wait_until_called(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
    with pytest.raises(ApiError) as refused:
        create_vmi(apiserver, new_vmi("t1", "vm2", ["vm2-gpu0"]))
    assert 'admission webhook "vmi.gpuplane.io" denied the request' in refused.value.message
    assert "h100" in refused.value.message and "budget" in refused.value.message
    assert apiserver.request("GET", VMIS.format(ns="t1"))["items"] == []


def test_a_shorter_timeout_is_kept_with_a_clear_try_again(apiserver: ControlPlane, webhook: str) -> None:
    """A Pending set with no binder to answer, and a registration whose timeoutSeconds (1 s)
    leaves no time for a wait (the webhook answers 1.5 s before the apiserver's deadline): the
    webhook reads that deadline (the ``timeout`` of the call) and answers at once, writing
    nothing, with a clear "try again" naming timeoutSeconds, instead of the user meeting the
    apiserver's bare timeout error. Nothing is stored."""
    bound_cluster(apiserver)
    apiserver.seed(gpu_obj("t1", "vm2-gpu0", "h100", "vm2"))
    sync.sync_once()
    config = register(apiserver, webhook)
    config["webhooks"][0]["timeoutSeconds"] = 1
    apiserver.apply({k: v for k, v in config.items() if k not in ("status",)} | {"metadata": {"name": "gpuplane-vmi"}})
    wait_until_called(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
    started = time.monotonic()
    with pytest.raises(ApiError) as refused:
        create_vmi(apiserver, new_vmi("t1", "vm2", ["vm2-gpu0"]))
    assert time.monotonic() - started < 5
    assert 'admission webhook "vmi.gpuplane.io" denied the request' in refused.value.message
    assert "no time is left in this call" in refused.value.message and "timeoutSeconds" in refused.value.message
    assert "try again" in refused.value.message
    gpu = apiserver.request("GET", "/apis/gpuplane.io/v1alpha1/namespaces/t1/gpus/vm2-gpu0")
    assert "gpuplane.io/bind-request" not in (gpu["metadata"].get("annotations") or {})
    assert apiserver.request("GET", VMIS.format(ns="t1"))["items"] == []


@pytest.mark.parametrize(
    ("name", "devices", "words"),
    [
        ("vm1", ["vm1-gpu0", "vm1-gpu1", "nope-gpu0"], "device gpuplane.io/nope-gpu0 does not exist in namespace t1"),
        ("vm1", ["vm1-gpu0"], "names only part of its set of 2 devices"),
        ("vm7", ["vm1-gpu0", "vm1-gpu1"], "belongs to VM vm1, not to vm7"),
    ],
    ids=["unknown-device", "part-of-its-set", "another-vms-device"],
)
def test_a_wrong_device_is_refused_with_the_webhooks_words(
    apiserver: ControlPlane, webhook: str, name: str, devices: list[str], words: str
) -> None:
    bound_cluster(apiserver)
    register(apiserver, webhook)
    wait_until_called(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
    with pytest.raises(ApiError) as refused:
        create_vmi(apiserver, new_vmi("t1", name, devices))
    assert 'admission webhook "vmi.gpuplane.io" denied the request' in refused.value.message
    assert words in refused.value.message, refused.value.message
    assert apiserver.request("GET", VMIS.format(ns="t1"))["items"] == []


def test_a_vmi_with_only_a_generate_name_is_refused(apiserver: ControlPlane, webhook: str) -> None:
    """The devices name their VM (vmName); a VMI whose name the server generates cannot be
    that VM, whatever name it gets."""
    bound_cluster(apiserver)
    register(apiserver, webhook)
    wait_until_called(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
    vmi = new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"])
    del vmi["metadata"]["name"]
    vmi["metadata"]["generateName"] = "vm1-"
    with pytest.raises(ApiError) as refused:
        create_vmi(apiserver, vmi)
    assert 'admission webhook "vmi.gpuplane.io" denied the request' in refused.value.message
    assert "no metadata.name to match the devices' vmName" in refused.value.message, refused.value.message
    assert apiserver.request("GET", VMIS.format(ns="t1"))["items"] == []
    # A VMI naming no gpuplane device may use generateName freely.
    plain = new_vmi("t1", "vm1", [])
    del plain["metadata"]["name"]
    plain["metadata"]["generateName"] = "plain-"
    assert create_vmi(apiserver, plain)["metadata"]["name"].startswith("plain-")


def test_a_webhook_slower_than_timeout_seconds_fails_the_create(
    apiserver: ControlPlane, webhook: workers.Served
) -> None:
    """The webhook server hangs (its processes stopped: connections are accepted by the
    kernel and never answered). With failurePolicy Fail the apiserver gives up after the
    registration's timeoutSeconds and refuses the create with its own error; nothing is
    stored, and the webhook answers again once it resumes."""
    bound_cluster(apiserver)
    config = register(apiserver, webhook)
    config["webhooks"][0]["timeoutSeconds"] = 2
    apiserver.apply({k: v for k, v in config.items() if k not in ("status",)} | {"metadata": {"name": "gpuplane-vmi"}})
    vmi = new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"])
    wait_until_called(apiserver, vmi)
    webhook.hang()
    try:
        started = time.monotonic()
        with pytest.raises(ApiError) as refused:
            create_vmi(apiserver, vmi)
        waited = time.monotonic() - started
    finally:
        webhook.resume()
    assert refused.value.code == 500
    assert 'failed calling webhook "vmi.gpuplane.io"' in refused.value.message
    assert "deadline" in refused.value.message or "timeout" in refused.value.message, refused.value.message
    assert waited >= 2  # the apiserver waited for the registration's timeout, not its default 10 s
    assert apiserver.request("GET", VMIS.format(ns="t1"))["items"] == []
    assert create_vmi(apiserver, vmi)["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "hgx-01"

"""The chart's webhook against a real kube-apiserver: its Deployment's environment and mounts, per
``webhook.auth``, and its registration, ``matchConditions`` included.

For each auth mode the webhook server (``deploy/webhook_server.py``) runs with the environment
the rendered container gets (its paths under the Secret mounts pointed at local copies of those
Secrets), and the rendered MutatingWebhookConfiguration is registered pointing at it; the
apiserver presents a bearer token, or its client certificate on the one port it has one for
(harness/controlplane/apiserver.py), as its AdmissionConfiguration says. A VMI naming a Bound set
is stored pinned in every mode. Then, with nothing serving the webhook, a VMI naming no
gpuplane device is still created and one naming gpuplane devices is refused.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from binder import sync
from binder.runtime.passes import run_pass
from harness import workers
from harness.chart_cluster import VMIS, container_env, create_vmi, one, register, render, secret_volumes
from harness.controlplane import UNION_USER, ApiError, ControlPlane
from harness.factories import new_vmi
from harness.ports import free_port
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj

pytestmark = [pytest.mark.django_db(transaction=True)]
RELEASE, NAMESPACE = "gpuplane", "gpuplane-system"


def bound_cluster(plane: ControlPlane) -> None:
    """t1's vm1: two H100 Bound on n1 (hostname label hgx-01)."""
    node = node_obj("n1", {H100: 8})
    node["metadata"]["labels"]["kubernetes.io/hostname"] = "hgx-01"
    plane.seed(
        namespace_obj("t1"),
        node,
        class_obj("h100", H100),
        gpu_obj("t1", "vm1-gpu0", "h100", "vm1"),
        gpu_obj("t1", "vm1-gpu1", "h100", "vm1"),
    )
    sync.sync_once()
    run_pass("full")


def chart(auth: str) -> list[dict[str, Any]]:
    return render(RELEASE, NAMESPACE, f"webhook.auth={auth}", "webhook.certificates=manual", "webhook.caBundle=Q0E=")


@pytest.fixture(params=["token", "client-cert", "none"])
def served(request: Any, apiserver: ControlPlane, tmp_path: Path) -> Iterator[tuple[str, str, list[dict[str, Any]]]]:
    """The webhook server as the chart runs it for one ``webhook.auth``: (mode, URL, rendered chart)."""
    auth = request.param
    docs = chart(auth)
    deployment = one(docs, "Deployment", f"{RELEASE}-webhook")
    # What each Secret the Deployment mounts holds, from the test's PKI.
    crt, key = apiserver.pki.serving("webhook")
    contents = {
        "gpuplane-webhook-tls": {"tls.crt": crt, "tls.key": key},
        "gpuplane-webhook-token": {"token": apiserver.dir / "webhook-token"},
        "gpuplane-webhook-client-ca": {"ca.crt": apiserver.pki.ca_file},
    }
    mounts = {}
    for volume, secret in secret_volumes(deployment).items():
        local = tmp_path / "secrets" / volume
        local.mkdir(parents=True)
        for name, source in contents[secret].items():
            shutil.copy(source, local / name)
        mounts[volume] = local
    embedded = connection.vendor == "sqlite"
    base = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUPLANE_", "CELERY_"))},
        "DATABASE_URL": workers.database_url(),
        "GPUPLANE_VAR_DIR": str(tmp_path),
        "GPUPLANE_AUTO_PASS": "false",
        "GPUPLANE_CLUSTER": "kubernetes",
        "KUBECONFIG": str(apiserver.kubeconfig(UNION_USER if embedded else "gpuplane-webhook")),
        "GPUPLANE_BIND_WAIT_SECONDS": "2",
        "GPUPLANE_METRICS_OPEN": "true",
    }
    if not embedded:
        base.update(CELERY_BROKER_URL=workers.REDIS_URL, GPUPLANE_BROKER_KEY_PREFIX=workers.PREFIX)
    env = container_env(deployment, mounts, base)
    assert env["GPUPLANE_WEBHOOK_AUTH"] == auth
    env.pop("GPUPLANE_WEBHOOK_METRICS_BIND")  # the chart's port, 0.0.0.0:9102, is not the test's
    # The apiserver presents its client certificate to one host:port only.
    port = apiserver.webhook_cert_port if auth == "client-cert" else free_port()
    with workers.webhook_server(env, tmp_path, scheme="https", probe_http=False, port=port):
        yield auth, f"https://localhost:{port}", docs


def wait_until_pinned(plane: ControlPlane, vmi: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            stored = create_vmi(plane, vmi, dry_run=True)
        except ApiError as exc:
            last = exc
        else:
            if stored["spec"].get("nodeSelector", {}).get("kubernetes.io/hostname"):
                return stored
        time.sleep(0.2)
    raise AssertionError(f"the apiserver never got the webhook's patch (last: {last})")


def test_each_auth_mode_serves_the_apiserver(
    apiserver: ControlPlane, served: tuple[str, str, list[dict[str, Any]]]
) -> None:
    auth, url, docs = served
    bound_cluster(apiserver)
    register(apiserver, one(docs, "MutatingWebhookConfiguration", f"{RELEASE}-vmi"), url)
    wait_until_pinned(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
    stored = create_vmi(apiserver, new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"]))
    assert stored["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "hgx-01", auth
    assert [g["deviceName"] for g in stored["spec"]["domain"]["devices"]["gpus"]] == [H100, H100]


def plain_vmi(name: str) -> dict[str, Any]:
    vmi = new_vmi("t1", name, [])
    vmi["spec"]["domain"]["devices"]["gpus"] = []
    vmi["spec"]["domain"]["devices"]["hostDevices"] = [{"name": "nic", "deviceName": "intel.com/sriov"}]
    return vmi


def test_with_the_webhook_down_only_vmis_naming_gpuplane_devices_are_refused(apiserver: ControlPlane) -> None:
    bound_cluster(apiserver)
    configuration = one(chart("token"), "MutatingWebhookConfiguration", f"{RELEASE}-vmi")
    register(apiserver, configuration, f"https://127.0.0.1:{free_port()}")  # nothing listens there
    gpus = new_vmi("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"])
    host_devices = new_vmi("t1", "vm2", [])
    host_devices["spec"]["domain"]["devices"]["gpus"] = []
    host_devices["spec"]["domain"]["devices"]["hostDevices"] = [{"name": "g", "deviceName": "gpuplane.io/vm1-gpu0"}]
    deadline = time.monotonic() + 30
    while True:  # the apiserver picks the registration up within a second or so
        try:
            create_vmi(apiserver, gpus, dry_run=True)
        except ApiError as exc:
            assert exc.code == 500 and 'failed calling webhook "vmi.gpuplane.io"' in exc.message, exc
            break
        assert time.monotonic() < deadline, "the registration was never picked up"
        time.sleep(0.2)
    for vmi in (gpus, host_devices):
        with pytest.raises(ApiError) as refused:
            create_vmi(apiserver, vmi)
        assert 'failed calling webhook "vmi.gpuplane.io"' in refused.value.message
    # VMIs naming no gpuplane device never reach the webhook: created while it is down.
    stored = create_vmi(apiserver, plain_vmi("plain"))
    assert stored["metadata"]["name"] == "plain"
    no_gpus_at_all = new_vmi("t1", "bare", [])
    del no_gpus_at_all["spec"]["domain"]["devices"]["gpus"]
    assert create_vmi(apiserver, no_gpus_at_all)["metadata"]["name"] == "bare"
    names = {v["metadata"]["name"] for v in apiserver.request("GET", VMIS.format(ns="t1"))["items"]}
    assert names == {"plain", "bare"}

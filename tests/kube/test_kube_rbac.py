"""Least privilege, shown on the real kube-apiserver: each gpuplane process's identity may do
exactly what docs/operations.md's RBAC table says, and the code run as that identity uses
every grant and needs nothing more.

The control plane authenticates each ServiceAccount of deploy/ by a token
(``system:serviceaccount:gpuplane-system:<name>``) and authorizes it with deploy/'s own
ClusterRoles and bindings. The test asks the apiserver what each identity may do
(SelfSubjectRulesReview, as that identity), drives every cluster code path of a process as
that process's identity, and reads from the apiserver's audit log what each identity called
and whether anything was refused.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from binder import apiserver as kube_connection
from binder import models, sync
from binder import queue as binder_queue
from binder.actions import change_node
from binder.engine.preview import NodeAction
from binder.runtime.passes import run_pass
from harness.cluster_mode import GPUS, seed_cluster
from harness.controlplane import IDENTITIES, ControlPlane, kubevirt_dir
from harness.factories import new_vmi, review
from harness.shapes import gpu_obj, real
from harness.webhook_calls import allowed_patch, denied, post

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
#: What RBAC lets every authenticated user do (the bootstrap roles system:basic-user,
#: system:discovery, system:public-info-viewer): not deploy/'s doing, left out of the table.
EVERYONE = {
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
    ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
    ("authentication.k8s.io", "selfsubjectreviews", "create"),
    # Every ServiceAccount may read ClusterTrustBundles (for projected trust anchors; the
    # bootstrap ClusterRole system:cluster-trust-bundle-discovery, bound to all of them).
    ("certificates.k8s.io", "clustertrustbundles", "get"),
    ("certificates.k8s.io", "clustertrustbundles", "list"),
    ("certificates.k8s.io", "clustertrustbundles", "watch"),
}

Grants = dict[str, set[tuple[str, str, str]]]


def documented() -> Grants:
    """docs/operations.md's RBAC table: identity → {(API group, resource, verb)}."""
    text = OPERATIONS.read_text()
    start = text.index("<!-- rbac-table -->")
    end = text.index("<!-- /rbac-table -->")
    table: Grants = {}
    for line in text[start:end].splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("identity", "") or set(cells[0]) <= {"-", " "}:
            continue
        identity, group, resources, verbs = cells[:4]
        group = "" if group in ("core", '""') else group
        for resource in re.split(r",\s*", resources):
            for verb in re.split(r",\s*", verbs):
                table.setdefault(identity, set()).add((group, resource, verb))
    return table


def granted(plane: ControlPlane, identity: str) -> set[tuple[str, str, str]]:
    """What the apiserver says ``identity`` may do (SelfSubjectRulesReview, asked as it)."""
    review_ = plane.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview", "spec": {"namespace": "t1"}},
        identity=identity,
    )
    assert not review_["status"].get("incomplete"), review_["status"]
    rules = set()
    for rule in review_["status"]["resourceRules"]:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), rule
                    rules.add((group, resource, verb))
    return rules - EVERYONE


def serve_virtual_machines(plane: ControlPlane) -> None:
    """KubeVirt's VirtualMachine CRD (from the pinned KubeVirt's CRDs) served, with one stopped
    VM in t1: the sync lists and watches VirtualMachines (a cluster without the CRD mirrors
    none, and the watch would never run)."""
    crds = yaml.safe_load_all((kubevirt_dir() / "crds.yaml").read_text())
    crd = next(d for d in crds if d and d["metadata"]["name"] == "virtualmachines.kubevirt.io")
    plane.apply(crd)
    deadline = time.monotonic() + 30
    while True:
        try:
            if plane.request("GET", "/apis/kubevirt.io/v1/virtualmachines") is not None:
                break
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)
    vm = real("virtualmachine.yaml")
    vm["metadata"] = {"name": "vm1-stopped", "namespace": "t1"}
    vm.pop("status", None)
    plane.request("POST", "/apis/kubevirt.io/v1/namespaces/t1/virtualmachines", vm)


def as_identity(plane: ControlPlane, identity: str) -> None:
    """gpuplane's connection from now on authenticates as ``identity``, as that process would."""
    kube_connection.use(plane.kube_api(identity))


def test_each_identity_may_do_exactly_what_the_docs_table_says(apiserver: ControlPlane) -> None:
    table = documented()
    assert set(table) == set(IDENTITIES), "docs/operations.md's RBAC table names other identities"
    for identity in IDENTITIES:
        assert granted(apiserver, identity) == table[identity], identity
    # celery beat only publishes to the broker: deploy/ gives its ServiceAccount no binding.
    assert "gpuplane-beat" not in table


@pytest.mark.django_db(transaction=True)
def test_every_call_each_process_makes_is_granted_and_every_grant_is_used(
    apiserver: ControlPlane, client: Any, monkeypatch: Any, settings: Any
) -> None:
    """Each code path runs as the identity of the process that runs it in production; the
    audit log then says, per identity, what was called: nothing refused, nothing granted
    that no code uses."""
    from binder.runtime import usage_records as records
    from usage import queries

    seed_cluster(apiserver)
    serve_virtual_machines(apiserver)
    apiserver.mark_calls()

    # The sync (Deployment gpuplane-sync): list every kind, add finalizers, watch each kind.
    as_identity(apiserver, "gpuplane-sync")
    sync.sync_once()
    stop = threading.Event()
    for kind in sync.SYNC_ORDER:
        runner = sync.KindSync(kind, stop, relist_seconds=300, watch_seconds=1)
        runner.relist()
        runner.watch_until(time.monotonic() + 1)

    # The binder (the Celery worker): the first status write of each kind meets a 409, so
    # that object is read again; usage records read VMIs fresh, one by one and (past the
    # threshold) by one LIST; a class deleted, its finalizer released.
    as_identity(apiserver, "gpuplane-binder")
    conflicted: set[str] = set()

    def first_status_write_conflicts(verb: str, kind: Any, ns: str, target: str) -> int | None:
        if target.endswith("/status") and kind.plural not in conflicted:
            conflicted.add(kind.plural)
            return 409
        return None

    apiserver.faults.decide = first_status_write_conflicts
    monkeypatch.setattr(records, "_LIST_VMIS_FROM", 0)  # the launcher pods' VMIs by one LIST
    run_pass("full")
    monkeypatch.setattr(records, "_LIST_VMIS_FROM", 200)
    apiserver.faults.decide = None
    assert conflicted == {"gpus", "gpuclasses", "gpubudgets"}
    # The VMI changes (its owner relabels it): its pods are the next pass's subjects, their VMI
    # read by a GET.
    apiserver.request(
        "PATCH",
        "/apis/kubevirt.io/v1/namespaces/t1/virtualmachineinstances/vm1",
        {"metadata": {"labels": {"team": "vision"}}},
    )
    as_identity(apiserver, "gpuplane-sync")
    sync.sync_once()
    as_identity(apiserver, "gpuplane-binder")
    run_pass("full")

    # The webhook server (Deployment gpuplane-webhook): a new order's VMI starts, the webhook
    # writes the bind request annotation; the binder (not the webhook) answers it.
    apiserver.seed(gpu_obj("t2", "vm8-gpu0", "a10", "vm8"))
    as_identity(apiserver, "gpuplane-sync")
    sync.sync_once()
    as_identity(apiserver, "gpuplane-webhook")
    # Here every process is this one: the answer pass the webhook queues would run in-process,
    # as the webhook's identity. In a deployment it runs in the binder worker: so it does here,
    # below, after the webhook gave up waiting.
    queued: list[str] = []
    monkeypatch.setattr(binder_queue, "queue_answer_pass", lambda: queued.append("answer"))
    # Long enough that a loaded machine still reaches the write before the wait is spent.
    settings.GPUPLANE_BIND_WAIT_SECONDS = 2
    body = review(new_vmi("t2", "vm8", ["vm8-gpu0"]))
    assert "try again" in denied(post(client, body), body)
    assert queued
    as_identity(apiserver, "gpuplane-binder")
    run_pass("answer")
    annotations = apiserver.request("GET", f"{GPUS}/namespaces/t2/gpus/vm8-gpu0")["metadata"]["annotations"]
    assert "gpuplane.io/bind-request" in annotations
    # KubeVirt retries: the set is Bound now, so the webhook stamps its first member admitted
    # and pins. The stamp goes to the mirror's row, where a pass moving the set meets it
    # (binder/runtime/admissions.py): the webhook writes nothing to the API for a Bound set.
    as_identity(apiserver, "gpuplane-webhook")
    before = len(apiserver.calls("gpuplane-webhook"))
    pinned = allowed_patch(post(client, body), body)
    assert pinned["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    assert apiserver.calls("gpuplane-webhook")[before:] == []
    assert models.GpuDevice.objects.get(namespace__name="t2", name="vm8-gpu0").admitted is not None

    # An operator deletes a class, a tenant a GPU; the sync notes both, the binder releases
    # their finalizers.
    apiserver.request("DELETE", f"{GPUS}/gpuclasses/a10")
    apiserver.request("DELETE", f"{GPUS}/namespaces/t1/gpus/vm1-gpu1")
    as_identity(apiserver, "gpuplane-sync")
    sync.sync_once()
    as_identity(apiserver, "gpuplane-binder")
    run_pass("full")

    # The web (Deployment gpuplane-web): a staff node action, the tenant usage API's fresh
    # VMI reads, one by one and by one LIST.
    as_identity(apiserver, "gpuplane-web")
    change_node("n3", NodeAction.CORDON)
    queries.current_usage("t1")
    monkeypatch.setattr(records, "_LIST_VMIS_FROM", 0)
    queries.current_usage("t1")

    table = documented()
    for identity in IDENTITIES:
        calls = apiserver.calls(identity)
        refused = [c for c in calls if c.code == 403]
        assert not refused, f"{identity} was refused: {refused}"
        used = {c.rbac for c in calls}
        assert used - table[identity] == set(), f"{identity} called without a grant"
        assert table[identity] - used == set(), f"{identity} is granted what no code path calls"

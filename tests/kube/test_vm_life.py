"""A VM's life on the VM cluster, with the real writer of every field gpuplane reads.

kube-scheduler binds pods, KubeVirt's virt-controller makes VMIs from VirtualMachines, makes
their launcher pods and writes ``status.activePods``, kwok runs pods and keeps nodes Ready, and
kube-controller-manager taints and evicts (harness/vm_cluster.py). gpuplane runs as
deployed: the sync, the binder and the webhook server registered from deploy/, with deploy/'s
launcher policy. Each test acts through the API as a tenant or an operator does; no test writes
a status, a node name or ``activePods``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

import pytest
from django.test import Client

from binder import models, sync
from binder.reports.state import cluster_state
from binder.runtime.passes import run_pass
from binder.usage_record import UsageRecord
from harness.accounts import account
from harness.controlplane import UNION_USER, ApiError
from harness.shapes import H100, budget_obj, class_obj
from harness.vm_cluster import (
    NOT_READY_LABEL,
    TENANT_USER,
    VMS,
    Gpuplane,
    VmCluster,
    forged_launcher,
    pod_path,
    raw_pod,
    virtual_machine,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def two_nodes(cluster: VmCluster) -> None:
    """n1 and n2 with 8 H100 each (n1's hostname label differs from its name, as on EKS), the
    class, and tenant t1's namespace."""
    cluster.add_node("n1", {H100: 8}, hostname="hgx-01")
    cluster.add_node("n2", {H100: 8})
    cluster.request("POST", "/apis/gpuplane.io/v1alpha1/gpuclasses", class_obj("h100", H100))
    cluster.tenant_namespace("t1")
    cluster.wait_nodes_ready("n1", "n2")


def json_of(value: Any) -> str:
    return json.dumps(value)


def state() -> dict[str, Any]:
    """gpuplane's view (``manage.py dump_state --json``), from the mirror the sync keeps."""
    return cluster_state()


def booked(node: str) -> int:
    for row in state()["nodes"]:
        if row["name"] == node:
            return int(row["resources"].get(H100, {}).get("booked", 0))
    return 0


def usage(namespace: str, key: str) -> int:
    for row in state()["tenants"]:
        if row["namespace"] == namespace:
            return int(row["usage"].get(key, 0))
    return 0


def mirrored(condition: Any, what: str, cluster: VmCluster, gpuplane: Gpuplane, timeout: float = 30) -> None:
    """Until ``condition()`` holds, with the periodic resync a deployment runs (``Gpuplane.resync``)."""
    gpuplane.until(condition, what, timeout, detail=lambda: cluster.describe("t1") + "\n--- sync log ---\n"
                   + gpuplane.log("sync")[-3000:])  # fmt: skip


def test_a_vm_starts_pinned_and_its_launcher_is_counted_once(vm_cluster: VmCluster, gpuplane: Gpuplane) -> None:
    """VirtualMachine created → virt-controller creates its VMI → the webhook binds the order and
    pins the VMI → virt-controller makes the launcher asking the raw device names → kube-scheduler
    places it on the pinned node → kwok runs it → virt-controller lists it in activePods →
    gpuplane counts its units once: node booking, tenant usage and usage records."""
    two_nodes(vm_cluster)
    devices = vm_cluster.order("t1", "vm1", 2)
    vm_cluster.vm("t1", "vm1", devices)
    launcher = vm_cluster.running_launcher("t1", "vm1")

    vmi = vm_cluster.vmi("t1", "vm1")
    assert vmi is not None
    ((phase, node),) = vm_cluster.placement("t1", devices)
    assert phase == "Bound"
    # The webhook pinned the VMI by the node's own hostname label; KubeVirt carried the pin to the pod.
    expected_hostname = "hgx-01" if node == "n1" else node
    assert vmi["spec"]["nodeSelector"]["kubernetes.io/hostname"] == expected_hostname, vm_cluster.describe("t1")
    assert vmi["metadata"]["annotations"]["gpuplane.io/pinned"] == node
    assert launcher["spec"]["nodeSelector"]["kubernetes.io/hostname"] == expected_hostname
    assert launcher["spec"]["nodeName"] == node
    # virt-controller asked the raw device names of kube-scheduler, one unit per GPU.
    compute = next(c for c in launcher["spec"]["containers"] if c["name"] == "compute")
    assert compute["resources"]["requests"][H100] == "2"
    assert vmi["status"].get("activePods") == {launcher["metadata"]["uid"]: node}  # written by virt-controller

    # Counted once: the set's 2 units, not 2 more for the launcher asking the same devices.
    mirrored(lambda: models.Pod.objects.filter(uid=launcher["metadata"]["uid"], phase="Running").exists()
             and booked(node) == 2, "the mirror to count the launcher once", vm_cluster, gpuplane)  # fmt: skip
    assert usage("t1", H100) == 2 and usage("t1", "h100") == 2
    mirrored(lambda: UsageRecord.objects.filter(namespace="t1", end=None, phase="Bound").count() == 2,
             "two open device records", vm_cluster, gpuplane)  # fmt: skip
    # virt-controller lists the launcher in activePods only on the sync after it created the pod: until
    # then the rule counts the pod's GPUs as raw usage, so a raw record may open for that moment. It
    # is closed once the pod is listed, and nothing stays open.
    mirrored(lambda: not UsageRecord.objects.filter(namespace="t1", subject_kind="Pod", end=None).exists(),
             "no open raw record for the launcher", vm_cluster, gpuplane)  # fmt: skip
    for record in UsageRecord.objects.filter(namespace="t1", subject_kind="Pod"):
        assert record.subject == launcher["metadata"]["name"]
        assert record.end is not None and (record.end - record.start).total_seconds() < 5


def test_the_pin_survives_kubevirts_live_update_of_the_vmi(vm_cluster: VmCluster, gpuplane: Gpuplane) -> None:
    """KubeVirt's VM controller (LiveUpdate rollouts, its default) copies a running VM's template
    nodeSelector and tolerations onto its VMI whenever they differ: it would remove the webhook's pin
    and the class's tolerations moments after the create. deploy/'s pin policy puts them back in the
    apiserver, so the VMI stays pinned whatever the VM controller's later syncs send."""
    two_nodes(vm_cluster)
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    vm_cluster.request("PATCH", "/apis/gpuplane.io/v1alpha1/gpuclasses/h100", {"spec": {"tolerations": [toleration]}})
    devices = vm_cluster.order("t1", "vm1", 1)
    vm_cluster.vm("t1", "vm1", devices)
    vm_cluster.running_launcher("t1", "vm1")
    # A change to the VM that the VM controller syncs onto the running VMI (its labels trigger a sync).
    vm_cluster.request("PATCH", "/apis/kubevirt.io/v1/namespaces/t1/virtualmachines/vm1",
                       {"metadata": {"labels": {"touched": "1"}}}, identity=TENANT_USER)  # fmt: skip
    ((_, node),) = vm_cluster.placement("t1", devices)
    hostname = "hgx-01" if node == "n1" else node
    for _ in range(20):
        vmi = vm_cluster.vmi("t1", "vm1")
        assert vmi is not None
        assert vmi["spec"].get("nodeSelector", {}).get("kubernetes.io/hostname") == hostname, vm_cluster.describe("t1")
        assert toleration in vmi["spec"].get("tolerations", []), vmi["spec"].get("tolerations")
        time.sleep(0.1)


def test_a_stopped_vm_keeps_its_devices_and_restarts_on_the_same_node(
    vm_cluster: VmCluster, gpuplane: Gpuplane
) -> None:
    """Stop: virt-controller deletes the VMI and its launcher; the set stays Bound (the devices are
    kept across a stop) and the usage records stay open; the restart lands on the same node."""
    two_nodes(vm_cluster)
    devices = vm_cluster.order("t1", "vm1", 2)
    vm_cluster.vm("t1", "vm1", devices)
    first = vm_cluster.running_launcher("t1", "vm1")
    node = first["spec"]["nodeName"]

    vm_cluster.set_running("t1", "vm1", False)
    wait_for(lambda: vm_cluster.vmi("t1", "vm1") is None and not vm_cluster.launchers("t1", "vm1"), 60,
             "the VMI and its launcher gone", detail=lambda: vm_cluster.describe("t1"))  # fmt: skip
    mirrored(lambda: not models.VirtualMachineInstance.objects.filter(name="vm1").exists()
             and not models.Pod.objects.filter(uid=first["metadata"]["uid"]).exists(),
             "the mirror to drop the VMI and its launcher", vm_cluster, gpuplane)  # fmt: skip
    assert vm_cluster.placement("t1", devices) == {("Bound", node)}
    # The set's 2 units stay booked; the mirror may still hold a pod the API has just deleted.
    mirrored(lambda: booked(node) == 2, "the node booking the set's units alone", vm_cluster, gpuplane)
    # Records are written by full passes: an answer pass may have bound the second GPU after the
    # last one, so wait for the next. The stop closes none of them.
    mirrored(lambda: UsageRecord.objects.filter(namespace="t1", end=None, phase="Bound").count() == 2,
             "two open device records", vm_cluster, gpuplane)  # fmt: skip
    assert not UsageRecord.objects.filter(namespace="t1", subject_kind="GPU").exclude(end=None).exists()

    vm_cluster.set_running("t1", "vm1", True)
    second = vm_cluster.running_launcher("t1", "vm1")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    assert second["spec"]["nodeName"] == node
    assert vm_cluster.placement("t1", devices) == {("Bound", node)}


def test_usage_records_read_the_launchers_vmi_fresh_not_from_a_lagging_mirror(vm_cluster: VmCluster) -> None:
    """Each kind has its own watch, so the mirror may hold a launcher pod before the VMI that
    lists it. The usage step reads that VMI from the API server at the pass (one GET), not from
    the mirror: the launcher is recognised, and no raw record opens for GPUs its set already
    holds. gpuplane runs in this process here, so the test decides which kind the sync follows."""
    two_nodes(vm_cluster)
    devices = vm_cluster.order("t1", "vm1", 2)
    sync.sync_once()
    run_pass("full")
    ((phase, node),) = vm_cluster.placement("t1", devices)
    assert phase == "Bound"
    # The VM as the webhook leaves it (no webhook in this test): pinned, its devices by raw name.
    hostname = "hgx-01" if node == "n1" else node
    vm = virtual_machine("t1", "vm1", devices, node_selector={"kubernetes.io/hostname": hostname})
    for device in vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"]:
        device["deviceName"] = H100
    vm_cluster.request("POST", VMS.format(ns="t1"), vm, identity=TENANT_USER)
    launcher = vm_cluster.running_launcher("t1", "vm1")
    uid = launcher["metadata"]["uid"]
    wait_for(lambda: uid in ((vm_cluster.vmi("t1", "vm1") or {}).get("status") or {}).get("activePods", {}), 30,
             "virt-controller listing the launcher")  # fmt: skip

    # The Pod watch has delivered, the VMI watch not yet.
    sync.KindSync("Pod", threading.Event(), relist_seconds=0, watch_seconds=1).relist()
    assert models.Pod.objects.filter(uid=uid).exists()
    assert not models.VirtualMachineInstance.objects.filter(name="vm1").exists()
    vm_cluster.plane.mark_calls()
    run_pass("full")
    assert ("kubevirt.io", "virtualmachineinstances", "get") in [c.rbac for c in vm_cluster.plane.calls(UNION_USER)]
    assert not UsageRecord.objects.filter(namespace="t1", subject_kind="Pod").exists()
    assert UsageRecord.objects.filter(namespace="t1", subject_kind="GPU", end=None).count() == 2

    # Once the VMI is mirrored too, the mirror says what the API said: activePods as virt-controller wrote it.
    sync.KindSync("VirtualMachineInstance", threading.Event(), relist_seconds=0, watch_seconds=1).relist()
    assert models.VirtualMachineInstance.objects.get(name="vm1").active_pods == {uid: node}
    run_pass("full")
    assert not UsageRecord.objects.filter(namespace="t1", subject_kind="Pod").exists()


def test_a_tenants_forged_launcher_is_refused_by_the_launcher_policy(vm_cluster: VmCluster, gpuplane: Gpuplane) -> None:
    """Without deploy/'s launcher policy, KubeVirt's own virt-controller lists a tenant's pod that
    carries the kubevirt.io label and a controller reference to the VMI in that VMI's activePods,
    beside the real launcher: the pod would hide its GPUs behind the VM. With the policy the
    tenant's create is refused with a message saying why, and KubeVirt's launchers still start."""
    two_nodes(vm_cluster)
    devices = vm_cluster.order("t1", "vm1", 2)
    vm_cluster.vm("t1", "vm1", devices)
    launcher = vm_cluster.running_launcher("t1", "vm1")
    node = launcher["spec"]["nodeName"]
    vmi = vm_cluster.vmi("t1", "vm1")
    assert vmi is not None
    forged = forged_launcher("t1", "forged", "vm1", vmi["metadata"]["uid"], {H100: 2})
    forged["spec"]["nodeSelector"] = {
        "kubernetes.io/hostname": launcher["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    }

    # With the policy (as deployed): refused, naming why, nothing stored.
    with pytest.raises(ApiError) as refused:
        vm_cluster.request("POST", pod_path("t1"), forged, identity=TENANT_USER)
    assert refused.value.code == 403
    assert "names a VirtualMachineInstance as its controller owner" in refused.value.message
    assert "system:serviceaccount:kubevirt:kubevirt-controller" in refused.value.message
    names = [p["metadata"]["name"] for p in vm_cluster.request("GET", pod_path("t1"))["items"]]
    assert names == [launcher["metadata"]["name"]]
    # An UPDATE adding such an owner to a plain pod is refused too.
    plain = vm_cluster.request("POST", pod_path("t1"), raw_pod("t1", "plain", {}), identity=TENANT_USER)
    with pytest.raises(ApiError) as refused_update:
        vm_cluster.request("PATCH", pod_path("t1", "plain"),
                           {"metadata": {"ownerReferences": forged["metadata"]["ownerReferences"]}},
                           identity=TENANT_USER)  # fmt: skip
    assert refused_update.value.code == 403
    assert plain["metadata"]["name"] == "plain"

    # Without the policy: what the real virt-controller does with the same pod.
    vm_cluster.remove_launcher_policy()
    stored = vm_cluster.request("POST", pod_path("t1"), forged, identity=TENANT_USER)
    wait_for(
        lambda: (
            stored["metadata"]["uid"] in (vm_cluster.vmi("t1", "vm1") or {}).get("status", {}).get("activePods", {})
        ),
        30,
        "virt-controller to list the forged pod",
        detail=lambda: vm_cluster.describe("t1"),
    )
    active = vm_cluster.vmi("t1", "vm1")["status"]["activePods"]  # type: ignore[index]
    assert set(active) == {launcher["metadata"]["uid"], stored["metadata"]["uid"]}
    # kube-scheduler ran it beside the launcher: 4 of the node's 8 GPUs in use. gpuplane, which
    # trusts activePods, counts the forged pod's 2 as the VM's own: the hole the policy closes.
    wait_for(lambda: vm_cluster.request("GET", pod_path("t1", "forged"))["status"].get("phase") == "Running", 30,
             "the forged pod running")  # fmt: skip
    assert vm_cluster.request("GET", pod_path("t1", "forged"))["spec"]["nodeName"] == node
    listed = models.VirtualMachineInstance.objects.filter(name="vm1", active_pods__has_key=stored["metadata"]["uid"])
    mirrored(lambda: models.Pod.objects.filter(name="forged", phase="Running").exists() and listed.exists(),
             "the forged pod mirrored", vm_cluster, gpuplane)  # fmt: skip
    assert booked(node) == 2 and usage("t1", H100) == 2


def test_a_pod_naming_the_vmis_uid_under_another_kind_counts_as_raw(vm_cluster: VmCluster, gpuplane: Gpuplane) -> None:
    """virt-controller matches a controller reference by uid alone: a tenant's pod naming the VMI's
    uid under a kind no API serves passes the launcher policy (which guards the kind
    VirtualMachineInstance), is left alone by the garbage collector (it cannot look the owner up;
    it deletes a pod naming an existing kind whose object has another uid) and is listed in
    activePods. gpuplane takes only a VirtualMachineInstance controller reference as the hint of
    which VMI to look up, so the pod's GPUs count as raw usage in full."""
    two_nodes(vm_cluster)
    devices = vm_cluster.order("t1", "vm1", 2)
    vm_cluster.vm("t1", "vm1", devices)
    launcher = vm_cluster.running_launcher("t1", "vm1")
    node = launcher["spec"]["nodeName"]
    vmi = vm_cluster.vmi("t1", "vm1")
    assert vmi is not None
    disguised = forged_launcher("t1", "disguised", "vm1", vmi["metadata"]["uid"], {H100: 2})
    disguised["metadata"]["ownerReferences"][0].update(apiVersion="forged.example.com/v1", kind="Widget")
    disguised["metadata"]["annotations"] = {"kubevirt.io/domain": "vm1"}
    disguised["spec"]["nodeSelector"] = {
        "kubernetes.io/hostname": launcher["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    }
    stored = vm_cluster.request("POST", pod_path("t1"), disguised, identity=TENANT_USER)
    # virt-controller finds the VMI to sync from a pod's controller reference only when its kind is
    # VirtualMachineInstance, so this pod alone does not wake it; the VMI's next sync lists it (any
    # event of the VMI or its launcher: here a label the tenant may set on its own pod).
    vm_cluster.request("PATCH", pod_path("t1", launcher["metadata"]["name"]), {"metadata": {"labels": {"t": "1"}}},
                       identity=TENANT_USER)  # fmt: skip
    wait_for(
        lambda: (
            stored["metadata"]["uid"] in (vm_cluster.vmi("t1", "vm1") or {}).get("status", {}).get("activePods", {})
        ),
        30,
        "virt-controller to list the disguised pod",
        detail=lambda: vm_cluster.describe("t1"),
    )
    mirrored(lambda: models.Pod.objects.filter(name="disguised", phase="Running").exists() and booked(node) == 4,
             "the disguised pod's 2 GPUs counted as raw", vm_cluster, gpuplane)  # fmt: skip
    assert usage("t1", H100) == 4


def stopped_vm(cluster: VmCluster) -> tuple[list[str], dict[str, Any], str, str]:
    """Two nodes, tenant t2 too, and t1's vm1 (2 GPUs) started once and stopped: its devices, its
    first launcher, the node its set is kept on and the other node."""
    two_nodes(cluster)
    cluster.tenant_namespace("t2")
    devices = cluster.order("t1", "vm1", 2)
    cluster.vm("t1", "vm1", devices)
    first = cluster.running_launcher("t1", "vm1")
    node = first["spec"]["nodeName"]
    cluster.set_running("t1", "vm1", False)
    wait_for(lambda: not cluster.launchers("t1", "vm1"), 60, "the launcher gone")
    return devices, first, node, "n2" if node == "n1" else "n1"


def test_a_raw_pod_on_a_stopped_vms_units_moves_its_set_before_the_vm_starts_again(
    vm_cluster: VmCluster, gpuplane: Gpuplane
) -> None:
    """kube-scheduler knows nothing of the units gpuplane keeps for a stopped VM: with the launcher
    gone it sees them free and places a raw pod there (the race KubeVirt's proposal for keeping
    devices across a stop names: another workload grabs the device during the restart). gpuplane
    sees the node over-booked and moves the stopped VM's set to a node with room, so the restart
    is pinned there and its launcher runs; the raw pod keeps the units it was given."""
    devices, first, node, other = stopped_vm(vm_cluster)

    hostname = first["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    trainer = raw_pod("t2", "trainer", {H100: 8}, {"kubernetes.io/hostname": hostname})
    vm_cluster.request("POST", pod_path("t2"), trainer, identity=TENANT_USER)
    wait_for(lambda: vm_cluster.request("GET", pod_path("t2", "trainer"))["status"].get("phase") == "Running", 60,
             "kube-scheduler and kwok to run the raw pod on the stopped VM's units")  # fmt: skip
    assert vm_cluster.request("GET", pod_path("t2", "trainer"))["spec"]["nodeName"] == node
    mirrored(lambda: vm_cluster.placement("t1", devices) == {("Bound", other)},
             "the stopped VM's set moved off the over-booked node", vm_cluster, gpuplane)  # fmt: skip
    reason = vm_cluster.gpus("t1")[devices[0]]["status"]["reason"]
    assert f"node {node} is over-booked" in reason, reason

    vm_cluster.set_running("t1", "vm1", True)
    second = vm_cluster.running_launcher("t1", "vm1")
    assert second["spec"]["nodeName"] == other
    vmi = vm_cluster.vmi("t1", "vm1")
    assert vmi is not None and vmi["spec"]["nodeSelector"]["kubernetes.io/hostname"] != hostname
    mirrored(lambda: booked(other) == 2 and booked(node) == 8, "the launcher counted once, the pod's 8 on its node",
             vm_cluster, gpuplane)  # fmt: skip


def test_a_restart_with_no_room_left_is_refused_saying_why_and_starts_once_room_returns(
    vm_cluster: VmCluster, gpuplane: Gpuplane
) -> None:
    """As above, but the other node is full too: the stopped VM's set goes Lost, its reason and the
    Lost page saying why; the restart's VMI is refused by the webhook with the binder's reason (no
    VMI is created pinned anywhere), KubeVirt's VM controller retries, and once a raw pod ends the
    Lost set is bound again and the VM starts there."""
    devices, first, node, other = stopped_vm(vm_cluster)
    for name, where in (("filler", other), ("trainer", node)):
        hostname = "hgx-01" if where == "n1" else where
        vm_cluster.request("POST", pod_path("t2"), raw_pod("t2", name, {H100: 8}, {"kubernetes.io/hostname": hostname}),
                           identity=TENANT_USER)  # fmt: skip
        wait_for(lambda n=name: vm_cluster.request("GET", pod_path("t2", n))["status"].get("phase") == "Running", 60,
                 f"the raw pod {name} running")  # fmt: skip
    mirrored(lambda: vm_cluster.placement("t1", devices) == {("Lost", "")}, "the set Lost", vm_cluster, gpuplane)
    reason = vm_cluster.gpus("t1")[devices[0]]["status"]["reason"]
    assert "no other node has room for the set" in reason, reason
    staff = Client()
    staff.force_login(account("ops", staff=True, superuser=True))
    lost_page = staff.get("/admin/binder/lostset/").content.decode()
    assert "t1/vm1" in lost_page and "over-booked" in lost_page

    vm_cluster.set_running("t1", "vm1", True)
    vm_path = "/apis/kubevirt.io/v1/namespaces/t1/virtualmachines/vm1"
    wait_for(lambda: "vmi.gpuplane.io" in json_of(vm_cluster.request("GET", vm_path).get("status", {})), 60,
             "the VM's status to carry the webhook's refusal",
             detail=lambda: json_of(vm_cluster.request("GET", vm_path).get("status", {})))  # fmt: skip
    refusal = json_of(vm_cluster.request("GET", vm_path)["status"])
    assert "denied the request" in refusal and "no other node has room for the set" in refusal, refusal
    assert vm_cluster.vmi("t1", "vm1") is None

    vm_cluster.request("DELETE", pod_path("t2", "filler") + "?gracePeriodSeconds=0")
    second = vm_cluster.running_launcher("t1", "vm1", timeout=120)
    assert second["spec"]["nodeName"] == other
    assert vm_cluster.placement("t1", devices) == {("Bound", other)}


def test_node_loss_moves_the_set_and_the_restarted_vm_is_pinned_to_the_new_node(
    vm_cluster: VmCluster, gpuplane: Gpuplane, settings: Any
) -> None:
    """kwok marks the node NotReady; kube-controller-manager's node lifecycle controller taints it
    and evicts the launcher; virt-controller fails the VMI and the VM controller starts a new one,
    which the webhook refuses while the set is on the NotReady node; after
    GPUPLANE_NODE_GRACE_SECONDS (5 s here) a full pass moves the set, and KubeVirt's next try is
    pinned to the new node, where the launcher runs."""
    settings.GPUPLANE_NODE_GRACE_SECONDS = 5  # the passes this test runs itself (embedded topology)
    two_nodes(vm_cluster)
    vm_cluster.add_node("n3", {H100: 8})
    vm_cluster.wait_nodes_ready("n3")  # three nodes: one NotReady of three is no zone-wide outage
    devices = vm_cluster.order("t1", "vm1", 2)
    vm_cluster.vm("t1", "vm1", devices)
    first = vm_cluster.running_launcher("t1", "vm1")
    lost_node = first["spec"]["nodeName"]

    vm_cluster.request("PATCH", f"/api/v1/nodes/{lost_node}", {"metadata": {"labels": {NOT_READY_LABEL: "true"}}})

    def tainted() -> bool:
        taints = vm_cluster.request("GET", f"/api/v1/nodes/{lost_node}")["spec"].get("taints") or []
        return any(t["key"] == "node.kubernetes.io/not-ready" and t["effect"] == "NoExecute" for t in taints)

    wait_for(tainted, 60, "the node lifecycle controller to taint the NotReady node")
    wait_for(lambda: all(p["metadata"]["uid"] != first["metadata"]["uid"] for p in vm_cluster.launchers("t1", "vm1")),
             60, "the taint to evict the launcher", detail=lambda: vm_cluster.describe("t1"))  # fmt: skip

    def moved() -> bool:
        return {node for phase, node in vm_cluster.placement("t1", devices) if phase == "Bound"} - {lost_node} != set()

    mirrored(moved, "a full pass to move the set off the NotReady node", vm_cluster, gpuplane, timeout=90)
    ((_, new_node),) = vm_cluster.placement("t1", devices)
    reason = vm_cluster.gpus("t1")[devices[0]]["status"]["reason"]
    assert f"node {lost_node} has been NotReady since" in reason, reason

    second = vm_cluster.running_launcher("t1", "vm1", timeout=180)
    assert second["spec"]["nodeName"] == new_node
    vmi = vm_cluster.vmi("t1", "vm1")
    assert vmi is not None and vmi["metadata"]["annotations"]["gpuplane.io/pinned"] == new_node


RACE_RUNS = 8


def test_a_vm_starting_while_a_pass_moves_its_set_is_never_left_pinned_where_the_set_is_not(
    vm_cluster: VmCluster, gpuplane: Gpuplane
) -> None:
    """The pin and the move racing, on the real chain, many times: a stopped VM is started at the
    moment a raw pod lands on the units its set holds, so a full pass moves the set (the node is
    over-booked and the set has no VMI yet) while the webhook pins the new VMI to it. Whichever
    writes the set's first member second fails (SPEC §4 "Admission and moves exclude each other"),
    and a set whose VMI exists is no longer moved off an over-booked node. So every run ends with
    the VMI pinned to the node its set is Bound on: its launcher runs there, or waits there for
    the raw pod's units; never a VMI pinned to a node its set has left."""
    two_nodes(vm_cluster)
    vm_cluster.tenant_namespace("t2")
    devices = vm_cluster.order("t1", "vm1", 2)
    vm_cluster.vm("t1", "vm1", devices, running=False)
    mirrored(lambda: {p for p, _ in vm_cluster.placement("t1", devices)} == {"Bound"}, "the set bound",
             vm_cluster, gpuplane)  # fmt: skip
    outcomes: Counter[str] = Counter()
    for run in range(RACE_RUNS):
        ((_, node),) = vm_cluster.placement("t1", devices)
        hostname = "hgx-01" if node == "n1" else node
        raw = raw_pod("t2", f"grab-{run}", {H100: 8}, {"kubernetes.io/hostname": hostname})
        starter = threading.Thread(target=vm_cluster.set_running, args=("t1", "vm1", True))
        starter.start()
        vm_cluster.request("POST", pod_path("t2"), raw, identity=TENANT_USER)
        starter.join()

        def settled() -> bool:
            vmi = vm_cluster.vmi("t1", "vm1")
            spots = vm_cluster.placement("t1", devices)
            return vmi is not None and len(spots) == 1 and bool(vmi["metadata"].get("annotations", {}).get(
                "gpuplane.io/pinned"))  # fmt: skip

        wait_for(settled, 60, f"run {run}: the VMI admitted", detail=lambda: vm_cluster.describe("t1"))
        time.sleep(2)  # passes after the admission: none may move the set away from its VMI
        vmi = vm_cluster.vmi("t1", "vm1")
        assert vmi is not None
        pinned = vmi["metadata"]["annotations"]["gpuplane.io/pinned"]
        assert vm_cluster.placement("t1", devices) == {("Bound", pinned)}, (run, vm_cluster.describe("t1"))
        outcomes["moved first" if pinned != node else "admitted first"] += 1
        # Back to a stopped VM, the raw pod gone.
        vm_cluster.set_running("t1", "vm1", False)
        vm_cluster.request("DELETE", pod_path("t2", raw["metadata"]["name"]) + "?gracePeriodSeconds=0")
        wait_for(lambda: vm_cluster.vmi("t1", "vm1") is None and not vm_cluster.launchers("t1", "vm1"), 60,
                 f"run {run}: the VM stopped")  # fmt: skip
    print(f"pin/move race, {RACE_RUNS} runs: {dict(outcomes)}")
    assert sum(outcomes.values()) == RACE_RUNS


def test_a_borrowed_set_marked_for_reclaim_is_released_only_once_its_vm_has_stopped(
    vm_cluster: VmCluster, gpuplane: Gpuplane
) -> None:
    """Lending with real stops: t1's VM borrows idle GPUs beyond its limit and runs; t2 orders
    within its budget and waits; the borrowed set is marked for t2's order but stays Bound while
    its VM runs. The tenant stops the VM: virt-controller deletes the VMI and its launcher, and
    only then does a pass release the borrowed set and place t2's order on the freed units."""
    # One device of 4 units per VM: a set of one GPU object, placed whole by whichever pass sees it
    # (a set whose members are created one by one may be placed in part, then grow: see below).
    vm_cluster.add_node("n1", {H100: 4}, hostname="hgx-01")
    vm_cluster.request("POST", "/apis/gpuplane.io/v1alpha1/gpuclasses", class_obj("h100x4", H100, units=4))
    for tenant, limits, borrowing in (("t1", {"h100x4": 2}, {"h100x4": 2}), ("t2", {"h100x4": 4}, None)):
        vm_cluster.tenant_namespace(tenant)
        budget = budget_obj(tenant, limits, borrowing=borrowing)
        budget["metadata"].pop("uid")
        vm_cluster.request("POST", f"/apis/gpuplane.io/v1alpha1/namespaces/{tenant}/gpubudgets", budget)
    vm_cluster.wait_nodes_ready("n1")
    mirrored(lambda: models.GpuBudget.objects.count() == 2, "the budgets mirrored", vm_cluster, gpuplane)
    borrower = vm_cluster.order("t1", "vm1", 1, "h100x4")
    vm_cluster.vm("t1", "vm1", borrower)
    launcher = vm_cluster.running_launcher("t1", "vm1")
    assert launcher["spec"]["nodeName"] == "n1"
    assert {(g["status"]["phase"], g["status"].get("borrowed")) for g in vm_cluster.gpus("t1").values()} == {
        ("Bound", True)
    }

    waiter = vm_cluster.order("t2", "vm2", 1, "h100x4")

    def marked() -> bool:
        return all((g.get("status") or {}).get("reclaimFor") == "t2/vm2" for g in vm_cluster.gpus("t1").values())

    mirrored(marked, "the borrowed set marked for t2/vm2", vm_cluster, gpuplane)
    time.sleep(2)  # more passes: the VM runs, so the mark never becomes a release
    assert vm_cluster.placement("t1", borrower) == {("Bound", "n1")}
    assert vm_cluster.placement("t2", waiter) == {("Pending", "")}

    vm_cluster.set_running("t1", "vm1", False)
    mirrored(lambda: vm_cluster.placement("t2", waiter) == {("Bound", "n1")}, "t2's order placed", vm_cluster,
             gpuplane, timeout=60)  # fmt: skip
    # Released only once the VM stopped: its launcher no longer runs (its VMI may still be finishing
    # its deletion, as virt-controller removes its finalizer once the pod is gone).
    vmi = vm_cluster.vmi("t1", "vm1")
    assert vmi is None or vmi["metadata"].get("deletionTimestamp"), vm_cluster.describe("t1")
    assert all(p["status"].get("phase") != "Running" or p["metadata"].get("deletionTimestamp")
               for p in vm_cluster.launchers("t1", "vm1"))  # fmt: skip
    assert vm_cluster.gpus("t1")[borrower[0]]["status"]["phase"] == "Pending"
    assert not models.Pod.objects.filter(uid=launcher["metadata"]["uid"]).exists()

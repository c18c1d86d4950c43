"""A pod is a VMI's launcher only when the VMI lists its UID in activePods.

Objects come from the real KubeVirt captures (harness/shapes.py); the checks go through
the engine's ledger, the same numbers the binder, dump_state and the catalog use.
"""

from __future__ import annotations

import copy

from binder.engine import Cluster, full_pass, is_launcher, launcher_of, ledger_for, raw_usage, tenant_usage
from binder.engine import types as e
from harness.shapes import (
    H100,
    NOW,
    budget,
    engine,
    gpu,
    gpu_class,
    launcher_obj,
    node,
    plain_pod_obj,
    real,
    vmi_obj,
)

VGPU = "nvidia.com/NVIDIA_A10-12Q"


def _running_vm(n_gpus: int = 2, node_name: str = "n1") -> tuple[dict, dict, list[e.Device]]:  # type: ignore[type-arg]
    devices = [gpu("t1", f"vm1-gpu{i}", "h100", "vm1", phase="Bound", node=node_name) for i in range(n_gpus)]
    launcher_uid = "e566efd1-741e-4def-b164-403f2585fbba"  # the captured launcher's uid
    vmi = vmi_obj("t1", "vm1", [d.name for d in devices], {launcher_uid: node_name}, node_name)
    pod = launcher_obj(vmi, H100, n_gpus, node_name, uid=launcher_uid)
    return vmi, pod, devices


def test_captured_pair_is_launcher_by_active_pods() -> None:
    vmi = engine(real("vmi-with-gpus.yaml", 0))
    pod = engine(real("virt-launcher-pod.yaml", 0))
    assert pod.owner_vmi == "fedora06"
    assert is_launcher(pod, vmi)
    assert launcher_of(pod, lambda ns, name: vmi if (ns, name) == ("default", "fedora06") else None) is vmi


def test_forged_owner_reference_counts_in_full_in_budget_and_capacity() -> None:
    vmi, real_pod, devices = _running_vm(2)
    forged = launcher_obj(vmi, H100, 1, "n1", name="virt-launcher-vm1-fake1")  # uid not in activePods
    forged_pod = engine(forged)
    assert forged_pod.owner_vmi == "vm1"  # it names the VMI in its owner reference and labels ...
    assert forged["metadata"]["labels"]["kubevirt.io/created-by"] == vmi["metadata"]["uid"]
    vmi_e = engine(vmi)
    assert not is_launcher(forged_pod, vmi_e)  # ... but activePods does not list it

    cluster = Cluster(
        now=NOW,
        classes=(gpu_class("h100", H100),),
        nodes=(node("n1", {H100: 8}),),
        devices=tuple(devices),
        vmis=(vmi_e,),
        pods=(engine(real_pod), forged_pod),
    )
    ledger = ledger_for(cluster)
    # devices 2 + real launcher 0 (its 2 GPUs are the devices) + forged 1
    assert tenant_usage(ledger, "t1") == {"h100": 2, H100: 3}
    assert ledger.booked["n1"][H100] == 3
    assert ledger.free("n1", H100) == 5

    usage = raw_usage(forged_pod, launcher_of(forged_pod, lambda ns, n: vmi_e), devices, {"h100": cluster.classes[0]})
    assert usage.budget == {H100: 1} and usage.capacity == {H100: 1}


def test_forged_pod_takes_capacity_from_new_orders() -> None:
    vmi, real_pod, devices = _running_vm(2)
    forged = [engine(launcher_obj(vmi, H100, 3, "n1", name=f"virt-launcher-vm1-fake{i}")) for i in range(2)]
    order = [gpu("t2", f"big-gpu{i}", "h100", "big") for i in range(3)]
    cluster = Cluster(
        now=NOW,
        classes=(gpu_class("h100", H100),),
        nodes=(node("n1", {H100: 8}),),
        devices=(*devices, *order),
        vmis=(engine(vmi),),
        pods=(engine(real_pod), *forged),
    )
    result = full_pass(cluster)
    placed = {d.name: d for d in result.devices}
    # 2 held + 6 forged = 8: no room for 3 more, though owner references would hide 6.
    assert all(placed[d.name].phase is e.Phase.PENDING for d in order)
    assert "no Ready, schedulable node" in placed["big-gpu0"].reason


def test_live_migration_counts_gpus_once_in_budget_and_target_pod_on_its_node() -> None:
    vmi = real("vmi-with-gpus.yaml", 1)  # testvm, two activePods: source on -01, target on -02
    target = real("virt-launcher-pod-migration-target.yaml", 0)
    source = copy.deepcopy(target)
    source["metadata"]["name"] = "virt-launcher-testvm-n2lww"
    source["metadata"]["uid"] = "e19201bc-9cb1-46bc-af3d-687d9c9419fb"
    del source["metadata"]["labels"]["kubevirt.io/migrationJobUID"]
    del source["metadata"]["annotations"]["kubevirt.io/migrationJobName"]
    source["spec"]["nodeName"] = "yj-qaovnk8swork-01"
    device = gpu("default", "testvm-vgpu0", "a10-12q", "testvm", phase="Bound", node="yj-qaovnk8swork-01")
    cluster = Cluster(
        now=NOW,
        classes=(gpu_class("a10-12q", VGPU),),
        nodes=(node("yj-qaovnk8swork-01", {VGPU: 4}), node("yj-qaovnk8swork-02", {VGPU: 4})),
        devices=(device,),
        vmis=(engine(vmi),),
        pods=(engine(source), engine(target)),
        budgets=(budget("default", {VGPU: 1}),),
    )
    ledger = ledger_for(cluster)
    assert tenant_usage(ledger, "default") == {"a10-12q": 1, VGPU: 1}  # once, not three times
    assert ledger.booked["yj-qaovnk8swork-01"][VGPU] == 1  # the device (the source pod holds it)
    assert ledger.booked["yj-qaovnk8swork-02"][VGPU] == 1  # the target pod's vGPU
    # The budget of 1 is exactly used: the pass refuses nothing and moves nothing.
    result = full_pass(cluster)
    assert result.changes == ()


def test_finished_source_pod_still_in_active_pods_uses_nothing() -> None:
    vmi = real("vmi-with-gpus.yaml", 1)
    source = real("virt-launcher-pod-migration-target.yaml", 0)
    source["metadata"]["uid"] = "e19201bc-9cb1-46bc-af3d-687d9c9419fb"
    source["spec"]["nodeName"] = "yj-qaovnk8swork-01"
    source["status"]["phase"] = "Succeeded"
    pod = engine(source)
    assert is_launcher(pod, engine(vmi))
    usage = raw_usage(pod, engine(vmi), (), {})
    assert usage.budget == {} and usage.capacity == {}


def test_unbound_pod_counts_in_budget_but_on_no_node() -> None:
    obj = plain_pod_obj("t1", "trainer-0", H100, 2, "")
    cluster = Cluster(now=NOW, classes=(gpu_class("h100", H100),), nodes=(node("n1", {H100: 8}),), pods=(engine(obj),))
    ledger = ledger_for(cluster)
    assert tenant_usage(ledger, "t1") == {H100: 2}
    assert ledger.booked["n1"][H100] == 0


def test_lost_set_with_running_vmi_is_not_counted_twice_but_books_its_node() -> None:
    vmi, pod, devices = _running_vm(2)
    lost = [gpu("t1", d.name, "h100", "vm1", phase="Lost") for d in devices]
    cluster = Cluster(
        now=NOW,
        classes=(gpu_class("h100", H100),),
        nodes=(node("n1", {H100: 8}),),
        devices=tuple(lost),
        vmis=(engine(vmi),),
        pods=(engine(pod),),
    )
    ledger = ledger_for(cluster)
    assert tenant_usage(ledger, "t1") == {"h100": 2, H100: 2}  # Lost devices count; the pod adds nothing
    assert ledger.booked["n1"][H100] == 2  # Lost devices hold no units; the running pod does


def test_lost_set_rebinds_onto_the_node_its_vm_runs_on_even_when_full() -> None:
    # n1 is full: 6 units of raw pods plus the running VM's pod (2). Rebinding the set there
    # replaces the pod's raw booking by the devices, so it fits; elsewhere there is no room.
    vmi, pod, devices = _running_vm(2)
    lost = [gpu("t1", d.name, "h100", "vm1", phase="Lost") for d in devices]
    raw = engine(plain_pod_obj("t1", "trainer-0", H100, 6, "n1"))
    cluster = Cluster(
        now=NOW,
        classes=(gpu_class("h100", H100),),
        nodes=(node("n1", {H100: 8}), node("n2", {H100: 1})),
        devices=tuple(lost),
        vmis=(engine(vmi),),
        pods=(engine(pod), raw),
    )
    result = full_pass(cluster)
    assert {(d.phase, d.node) for d in result.devices} == {(e.Phase.BOUND, "n1")}
    assert result.devices[0].reason.startswith("rebound:")


def test_pod_naming_a_vmi_of_another_namespace_is_not_its_launcher() -> None:
    vmi, pod, _ = _running_vm(1)
    pod_e = engine(pod)
    other = e.Pod(namespace="t2", name=pod_e.name, uid=pod_e.uid, node="n1", requests={H100: 1}, owner_vmi="vm1")
    assert not is_launcher(other, engine(vmi))

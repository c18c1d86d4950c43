"""Making room on the VM cluster, with the real writer of every field gpuplane reads.

Stopped VMs keep their GPUs booked; when their sets leave no node with room for a waiting big
order, a full pass moves some of them so it fits (SPEC §4 "Making room"), and a stopped VM's
next start is pinned wherever its set is then. The VM cluster (harness/vm_cluster.py)
runs kube-scheduler, KubeVirt's virt-controller, kwok and kube-controller-manager; gpuplane runs
as deployed. Tests act through the API as a tenant (VMs, their runStrategy) or an operator
(GPUs, classes, cordons) does; no test writes a status, a node name or ``activePods``.

The waiting order is one GPU of an 8-unit class (a device of 8 H100s): a set of several GPU
objects created one by one may be placed in part by a pass that saw only some of them, and a
set that then grows is not an order that making room serves. The stopped VMs' sets have two
GPU objects each, so a move writes a first member before the other (SPEC §4 "Admission and moves
exclude each other").
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from binder import models
from binder.reports.state import cluster_state
from harness.shapes import H100, class_obj
from harness.vm_cluster import GPUS, TENANT_USER, VMS, Gpuplane, VmCluster, gpu_object, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

#: Node n1's own hostname label differs from its name (as on EKS): the pin uses the label.
HOSTNAMES = {"n1": "hgx-01"}
#: The waiting order's class: one device of 8 H100s (see the module's docstring).
BIG = "h100x8"
#: A race run's timing: the VM is started this many seconds after the waiting order is created
#: (before it, when negative), or one side goes first and the other waits until it has landed.
ADMITTED_FIRST = "admitted, then the order"
MOVED_FIRST = "moved, then the start"
SCHEDULE: tuple[str | float, ...] = (ADMITTED_FIRST, MOVED_FIRST, -0.2, 0.0, 0.05, 0.1, 0.2, 0.4)
RACE_RUNS = len(SCHEDULE)


@pytest.fixture
def deploy(
    vm_cluster: VmCluster, transactional_db: None, broker: Any, tmp_path: Path, settings: Any
) -> Iterator[Callable[..., Gpuplane]]:
    """``deploy(**env)``: gpuplane as deployed (the ``gpuplane`` fixture's) with ``env`` on top,
    the same settings in this process too (on SQLite it runs the periodic full passes itself);
    stopped before the test's database is emptied."""
    started: list[Gpuplane] = []

    def start(**env: str) -> Gpuplane:
        for name, value in env.items():
            setattr(settings, name, type(getattr(settings, name))(value))
        deployed = Gpuplane(vm_cluster, tmp_path, GPUPLANE_NODE_GRACE_SECONDS="5", **env)
        started.append(deployed.start())
        return deployed

    yield start
    for deployed in started:
        deployed.stop()


def hostname(node: str) -> str:
    return HOSTNAMES.get(node, node)


def nodes_and_classes(cluster: VmCluster, *names: str) -> None:
    """Nodes of 8 H100 each, the classes ``h100`` (1 unit) and ``h100x8`` (8 units), tenants t1
    (the VMs) and t2 (the waiting order)."""
    for name in names:
        cluster.add_node(name, {H100: 8}, hostname=hostname(name))
    cluster.request("POST", "/apis/gpuplane.io/v1alpha1/gpuclasses", class_obj("h100", H100))
    cluster.request("POST", "/apis/gpuplane.io/v1alpha1/gpuclasses", class_obj(BIG, H100, units=8))
    cluster.tenant_namespace("t1")
    cluster.tenant_namespace("t2")
    cluster.wait_nodes_ready(*names)


def settle(condition: Callable[[], bool], what: str, cluster: VmCluster, gpuplane: Gpuplane,
           timeout: float = 90) -> None:  # fmt: skip
    """Until ``condition()`` holds, with the periodic full pass a deployment runs
    (``Gpuplane.resync``: on SQLite this process runs it)."""
    gpuplane.until(condition, what, timeout, detail=lambda: describe(cluster, gpuplane))


def describe(cluster: VmCluster, gpuplane: Gpuplane) -> str:
    """The tenants' objects in the API, gpuplane's view of the nodes and pods, its logs' ends."""
    booked = {row["name"]: row["resources"] for row in cluster_state()["nodes"]}
    pods = list(models.Pod.objects.values_list("namespace__name", "name", "node", "phase"))
    logs = "".join(f"\n--- {name} log ---\n{gpuplane.log(name)[-2500:]}" for name in ("sync", "worker"))
    return f"{cluster.describe('t1')}\n{cluster.describe('t2')}\ngpuplane's nodes: {booked}\nits pods: {pods}{logs}"


def booked(node: str) -> int:
    """The H100 units gpuplane's view books on ``node`` (sets and pods' raw usage)."""
    for row in cluster_state()["nodes"]:
        if row["name"] == node:
            return int(row["resources"].get(H100, {}).get("booked", 0))
    return 0


def cordon(cluster: VmCluster, gpuplane: Gpuplane, node: str, cordoned: bool) -> None:
    """An operator's cordon (``spec.unschedulable``), until gpuplane's mirror has it; uncordoned,
    also until kube-controller-manager has lifted the taint that keeps kube-scheduler off it."""
    cluster.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": cordoned or None}})

    def done() -> bool:
        if not models.Node.objects.filter(name=node, unschedulable=cordoned).exists():
            return False
        taints = cluster.request("GET", f"/api/v1/nodes/{node}")["spec"].get("taints") or []
        return cordoned or all(t["key"] != "node.kubernetes.io/unschedulable" for t in taints)

    settle(done, f"node {node} {'cordoned' if cordoned else 'uncordoned'}", cluster, gpuplane)


def bound_on(cluster: VmCluster, namespace: str, names: list[str]) -> str:
    """The node the set is Bound on, whole; "" otherwise."""
    spots = cluster.placement(namespace, names)
    if len(spots) != 1:
        return ""
    ((phase, node),) = spots
    return node if phase == "Bound" else ""


def since(cluster: VmCluster, namespace: str, names: list[str]) -> set[str]:
    """The set's ``status.since`` values: they change with every phase or node change."""
    gpus = cluster.gpus(namespace)
    return {(gpus[n].get("status") or {}).get("since", "") for n in names}


def full_passes_after(moment: datetime, count: int, cluster: VmCluster, gpuplane: Gpuplane) -> None:
    """Until ``count`` full passes started after ``moment`` have finished."""
    settle(lambda: models.PassRun.objects.filter(kind=models.PassKind.FULL, started__gt=moment,
                                                 finished__isnull=False).count() >= count,
           f"{count} full passes", cluster, gpuplane)  # fmt: skip


def pinned_to(cluster: VmCluster, namespace: str, vm: str) -> str:
    """The node the webhook pinned the VM's VMI to (its ``gpuplane.io/pinned``); "" if none."""
    vmi = cluster.vmi(namespace, vm)
    return str(((vmi or {}).get("metadata", {}).get("annotations") or {}).get("gpuplane.io/pinned", ""))


def assert_pinned_where_its_set_is(cluster: VmCluster, namespace: str, vm: str, devices: list[str]) -> str:
    """The VMI pinned (annotation and nodeSelector by the node's hostname label) to the node its
    set is Bound on, whole, and its launcher running there, listed in activePods; that node."""
    launcher = cluster.running_launcher(namespace, vm, timeout=120)
    vmi = cluster.vmi(namespace, vm)
    assert vmi is not None
    node = str(vmi["metadata"]["annotations"]["gpuplane.io/pinned"])
    assert cluster.placement(namespace, devices) == {("Bound", node)}, cluster.describe(namespace)
    assert vmi["spec"]["nodeSelector"]["kubernetes.io/hostname"] == hostname(node), cluster.describe(namespace)
    assert launcher["spec"]["nodeName"] == node, cluster.describe(namespace)
    return node


def delete_gpus(cluster: VmCluster, gpuplane: Gpuplane, namespace: str, names: list[str]) -> None:
    """Delete the GPUs as their owner does; until gpuplane has released them (its finalizer) and
    its mirror has dropped them."""
    for name in names:
        cluster.request("DELETE", f"{GPUS.format(ns=namespace)}/{name}")
    settle(lambda: not set(names) & set(cluster.gpus(namespace))
           and not models.GpuDevice.objects.filter(namespace__name=namespace, name__in=names).exists(),
           f"GPUs {names} released and gone", cluster, gpuplane)  # fmt: skip


# -- the plain case ------------------------------------------------------------------------------


def test_two_stopped_vms_sets_move_so_an_eight_gpu_vm_starts_on_the_node_they_left(
    vm_cluster: VmCluster, deploy: Callable[..., Gpuplane]
) -> None:
    """n1 holds the sets of two VMs that ran and were stopped (2 GPUs each), n2 the 1-GPU set of a
    running VM: no node has room for 8. A tenant orders 8: once the stopped VMs' admissions are
    older than GPUPLANE_MOVE_GRACE_SECONDS (5 s here), a full pass moves both stopped sets to n2
    and places the order on n1, naming the moves. The running VM's set, the cheapest to move were
    it movable, stays. The 8-GPU VM starts pinned to n1, its launcher asking kube-scheduler for 8
    H100 there; the stopped VMs start again pinned to n2, where their sets now are."""
    gpuplane = deploy(GPUPLANE_MOVE_GRACE_SECONDS="5")
    nodes_and_classes(vm_cluster, "n1", "n2")
    settle(lambda: models.Node.objects.filter(ready=True, unschedulable=False).count() == 2
           and models.GpuClass.objects.count() == 2, "the nodes and classes mirrored", vm_cluster,
           gpuplane)  # fmt: skip
    stopped = {vm: vm_cluster.order("t1", vm, 2) for vm in ("a", "b")}
    settle(lambda: all(bound_on(vm_cluster, "t1", d) == "n1" for d in stopped.values()),
           "a and b bound on n1 (the fullest node with room)", vm_cluster, gpuplane)  # fmt: skip
    for vm, devices in stopped.items():
        vm_cluster.vm("t1", vm, devices)
    for vm, devices in stopped.items():
        assert assert_pinned_where_its_set_is(vm_cluster, "t1", vm, devices) == "n1"
        vm_cluster.set_running("t1", vm, False)
    wait_for(lambda: not any(vm_cluster.vmi("t1", vm) or vm_cluster.launchers("t1", vm) for vm in stopped), 60,
             "a and b stopped", detail=lambda: vm_cluster.describe("t1"))  # fmt: skip
    # c runs on n2 (n1 cordoned while it starts: the fullest node with room would be n1).
    cordon(vm_cluster, gpuplane, "n1", True)
    running = vm_cluster.order("t1", "c", 1)
    vm_cluster.vm("t1", "c", running)
    assert assert_pinned_where_its_set_is(vm_cluster, "t1", "c", running) == "n2"
    cordon(vm_cluster, gpuplane, "n1", False)
    settle(lambda: models.VirtualMachine.objects.filter(namespace__name="t1").count() == 3
           and not models.VirtualMachineInstance.objects.filter(name__in=list(stopped)).exists(),
           "the VMs mirrored, a's and b's VMIs gone", vm_cluster, gpuplane)  # fmt: skip
    running_since = since(vm_cluster, "t1", running)

    big = vm_cluster.order("t2", "big", 1, BIG)
    settle(lambda: bound_on(vm_cluster, "t2", big) == "n1"
           and all(bound_on(vm_cluster, "t1", d) == "n2" for d in stopped.values()),
           "a and b moved to n2, the 8-GPU order placed on n1", vm_cluster, gpuplane, timeout=120)  # fmt: skip
    gpus = vm_cluster.gpus("t1")
    for devices in stopped.values():
        for name in devices:
            reason = gpus[name]["status"]["reason"]
            assert reason.startswith("moved from n1: made room there for t2/big"), reason
    reason = vm_cluster.gpus("t2")[big[0]]["status"]["reason"]
    assert "room made by moving" in reason and "off n1" in reason, reason
    assert bound_on(vm_cluster, "t1", running) == "n2" and since(vm_cluster, "t1", running) == running_since
    # The pass commits its record and decisions after its writes to the API have landed.
    moves = models.Decision.objects.filter(namespace="t1", from_node="n1", to_node="n2", reason_code="MadeRoom")
    settle(lambda: models.PassRun.objects.filter(made_room=2).exists() and moves.count() == 4,
           "the pass's record and its four decisions", vm_cluster, gpuplane)  # fmt: skip

    vm_cluster.vm("t2", "big", big)
    assert assert_pinned_where_its_set_is(vm_cluster, "t2", "big", big) == "n1"
    launcher = vm_cluster.running_launcher("t2", "big")
    compute = next(c for c in launcher["spec"]["containers"] if c["name"] == "compute")
    assert compute["resources"]["requests"][H100] == "8"  # virt-controller asked kube-scheduler for all 8

    for vm in stopped:
        vm_cluster.set_running("t1", vm, True)
    for vm, devices in stopped.items():
        assert assert_pinned_where_its_set_is(vm_cluster, "t1", vm, devices) == "n2"
    assert since(vm_cluster, "t1", running) == running_since


# -- the race ----------------------------------------------------------------------------------


def test_a_vm_started_while_a_pass_makes_room_with_its_set_is_never_left_pinned_where_the_set_is_not(
    vm_cluster: VmCluster, deploy: Callable[..., Gpuplane]
) -> None:
    """The pin and making room racing, on the real chain, RACE_RUNS times. Each run: a stopped VM's
    2-GPU set on n1 and another's on n2 leave no node room for 8; a tenant orders 8 and, around
    the same moment, starts the VM on n1. A full pass would move that set (the cheapest plan, n1
    before n2 by name) while the webhook pins the new VMI to it. Whichever writes the set's first
    member second fails (SPEC §4 "Admission and moves exclude each other"), and a set whose VM
    was admitted is not movable. So every run ends with the VMI pinned to the node its set is
    Bound on and its launcher running there; the order placed on the node freed (n1 when the set
    moved first, else n2, by moving the other stopped VM's set to n1); and the admitted set never
    moved after. The first two runs let one side land before the other begins (so both outcomes
    happen); the rest start the VM at a spread of moments around the order."""
    gpuplane = deploy()
    nodes_and_classes(vm_cluster, "n1", "n2")
    outcomes: Counter[str] = Counter()
    seen = conflicts(gpuplane)
    for run, timing in enumerate(SCHEDULE):
        outcome = race_once(vm_cluster, gpuplane, run, timing)
        outcomes[outcome] += 1
        now = conflicts(gpuplane)
        print(f"run {run} ({timing}): {outcome}, conflicts {now - seen}")
        seen = now
    print(f"making room / pin race, {RACE_RUNS} runs: {dict(outcomes)}, conflicts: {dict(seen)}")
    assert outcomes["moved first"] >= 1 and outcomes["admitted first"] >= 1, outcomes


def race_once(cluster: VmCluster, gpuplane: Gpuplane, run: int, timing: str | float) -> str:
    """One run of the race (see the test): its outcome, "moved first" or "admitted first"."""
    big = f"big{run}"
    settle(lambda: booked("n1") == booked("n2") == 0
           and models.Node.objects.filter(name__in=["n1", "n2"], ready=True, unschedulable=False).count() == 2,
           f"run {run}: the nodes Ready and empty in gpuplane's view", cluster, gpuplane)  # fmt: skip
    # Fragmented: one stopped VM's 2-GPU set on each node (the node of the first cordoned while the
    # second is ordered). Equal plans are taken by node name: n1's VM is the one that races.
    first = cluster.order("t1", f"p{run}", 2)
    cluster.vm("t1", f"p{run}", first, running=False)
    settle(lambda: bound_on(cluster, "t1", first) != "", f"run {run}: p{run} placed", cluster, gpuplane)
    held = bound_on(cluster, "t1", first)
    cordon(cluster, gpuplane, held, True)
    second = cluster.order("t1", f"q{run}", 2)
    cluster.vm("t1", f"q{run}", second, running=False)
    settle(lambda: bound_on(cluster, "t1", second) not in ("", held), f"run {run}: q{run} placed on the other node",
           cluster, gpuplane)  # fmt: skip
    cordon(cluster, gpuplane, held, False)
    (a, a_devices), (b, b_devices) = sorted([(f"p{run}", first), (f"q{run}", second)],
                                            key=lambda s: bound_on(cluster, "t1", s[1]))  # fmt: skip
    assert bound_on(cluster, "t1", a_devices) == "n1" and bound_on(cluster, "t1", b_devices) == "n2"
    settle(lambda: models.VirtualMachine.objects.filter(namespace__name="t1", name__in=[a, b]).count() == 2,
           f"run {run}: the VMs mirrored", cluster, gpuplane)  # fmt: skip
    big_devices = [f"{big}-gpu0"]

    def start() -> None:
        cluster.set_running("t1", a, True)

    def order_big() -> None:
        cluster.request("POST", GPUS.format(ns="t2"), gpu_object("t2", big_devices[0], big, BIG))

    if timing == ADMITTED_FIRST:
        start()
        wait_for(lambda: pinned_to(cluster, "t1", a) != "", 60, f"run {run}: the VMI admitted")
        order_big()
    elif timing == MOVED_FIRST:
        order_big()
        settle(lambda: bound_on(cluster, "t1", a_devices) == "n2", f"run {run}: {a} moved", cluster, gpuplane)
        start()
    else:
        assert isinstance(timing, float)
        now, then = (order_big, start) if timing >= 0 else (start, order_big)
        failures: list[BaseException] = []

        def later() -> None:
            time.sleep(abs(timing))
            try:
                then()
            except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
                failures.append(exc)

        thread = threading.Thread(target=later)
        thread.start()
        now()
        thread.join()
        if failures:
            raise failures[0]

    settle(lambda: pinned_to(cluster, "t1", a) != "" and bound_on(cluster, "t2", big_devices) != "",
           f"run {run}: the VMI admitted and the order placed", cluster, gpuplane, timeout=120)  # fmt: skip
    node = assert_pinned_where_its_set_is(cluster, "t1", a, a_devices)
    placed = bound_on(cluster, "t2", big_devices)
    kept_since = since(cluster, "t1", a_devices)
    # More full passes after the launcher runs: none may move the admitted set from its VMI.
    full_passes_after(timezone.now(), 2, cluster, gpuplane)
    assert assert_pinned_where_its_set_is(cluster, "t1", a, a_devices) == node, (run, timing)
    assert since(cluster, "t1", a_devices) == kept_since, (run, timing, cluster.describe("t1"))
    assert bound_on(cluster, "t2", big_devices) == placed, (run, timing)
    if node == "n2":  # moved first: the order took n1, b stayed on n2
        outcome = "moved first"
        assert placed == "n1" and bound_on(cluster, "t1", b_devices) == "n2", (run, timing, describe(cluster, gpuplane))
    else:  # admitted first: a stayed on n1, so b's set made room on n2
        outcome = "admitted first"
        assert node == "n1", (run, timing)
        assert placed == "n2" and bound_on(cluster, "t1", b_devices) == "n1", (run, timing, describe(cluster, gpuplane))

    # Back to empty nodes: a stopped, the run's VMs and GPUs deleted.
    cluster.set_running("t1", a, False)
    wait_for(lambda: cluster.vmi("t1", a) is None and not cluster.launchers("t1", a), 60, f"run {run}: {a} stopped")
    for vm in (a, b):
        cluster.request("DELETE", f"{VMS.format(ns='t1')}/{vm}", identity=TENANT_USER)
    delete_gpus(cluster, gpuplane, "t1", a_devices + b_devices)
    delete_gpus(cluster, gpuplane, "t2", big_devices)
    return outcome


def conflicts(gpuplane: Gpuplane) -> Counter[str]:
    """How often each end of the protocol found the other had landed first, from gpuplane's logs:
    a pass's move held back, the webhook's ``admitted`` write refused (on SQLite the full passes
    this process runs log here, uncounted)."""
    logs = "".join(gpuplane.log(name) for name in ("sync", "worker", "webhook-server"))
    return Counter(
        {
            "pass held back": logs.count("stays where it is this pass"),
            "webhook refused": logs.count("admitted not written on GPU"),
        }
    )

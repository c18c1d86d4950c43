"""Usage records when binder workers take turns: what one worker's full pass recorded for
an object that was gone again before the other worker caught up is still put right.

Each worker follows the other's passes through the change feed, which names changed rows
by id. A row created and deleted between two of a worker's catch-ups (a short-lived pod, a
device ordered and deleted, a whole namespace deleted with its pods) cannot be read any
more, so nothing names it; if the other worker's full pass saw it meanwhile, that pass
opened its usage record, or changed a launcher pod's raw usage through it. The next full
pass of the first worker must still leave open exactly what is held (the state machine in
tests/system/test_stateful_database.py found the namespace case with two workers taking turns).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from binder import models, sync
from binder.mirror.snapshot import load_objects
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from harness.clock import Clock
from harness.controlplane import ControlPlane
from harness.shapes import H100, class_obj, gpu_obj, launcher_obj, namespace_obj, node_obj, plain_pod_obj, vmi_obj
from usage.models import UsageRecord

LAUNCHER_UID = "3f0c2a57-4a50-4b8e-9a62-6d1f8f7c1b10"


def open_records() -> set[tuple[str, str, str, int]]:
    return set(UsageRecord.objects.open().values_list("namespace", "subject_kind", "subject", "units"))


def full_pass(worker: ClusterState) -> models.PassRun:
    return run_pass(models.PassKind.FULL, worker)


def _delete_namespace() -> None:
    models.Namespace.objects.filter(name="team-b").delete()


def _delete_pod() -> None:
    models.Pod.objects.filter(name="trainer").delete()


def _delete_device() -> None:
    models.GpuDevice.objects.filter(name="vm1-gpu0").delete()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("arrives", "leaves"),
    [
        ([plain_pod_obj("team-b", "trainer", H100, 1, "node-1")], _delete_namespace),
        ([plain_pod_obj("team-b", "trainer", H100, 1, "node-1")], _delete_pod),
        ([gpu_obj("team-b", "vm1-gpu0", "h100", "vm1")], _delete_device),
        ([gpu_obj("team-b", "vm1-gpu0", "h100", "vm1")], _delete_namespace),
    ],
    ids=["raw-pod-namespace-deleted", "raw-pod-deleted", "device-deleted", "device-namespace-deleted"],
)
def test_a_record_another_worker_opened_closes_when_its_subject_is_gone(
    clock: Clock, arrives: list[dict[str, Any]], leaves: Callable[[], None]
) -> None:
    first, second = ClusterState(), ClusterState()
    load_objects(
        [namespace_obj("team-a"), namespace_obj("team-b"), class_obj("h100", H100), node_obj("node-1", {H100: 4})]
    )
    full_pass(first)  # the first worker's last pass: the object does not exist yet
    clock.advance(seconds=300)
    load_objects(arrives)
    full_pass(second)  # the other worker's pass sees it and opens its record
    assert len(open_records()) == 1
    clock.advance(seconds=300)
    leaves()
    run = full_pass(first)  # follows the feed: the object's row is already gone
    assert open_records() == set()
    assert run.records_closed == 1
    (closed,) = UsageRecord.objects.all()
    assert closed.end == clock.now


@pytest.mark.django_db
def test_a_vmi_that_came_and_went_leaves_its_launcher_pod_billed_in_full(clock: Clock) -> None:
    """Without its VMI a launcher pod's GPUs are raw usage (the launcher rule); the other
    worker saw the VMI and closed that raw record; the VMI is gone before this worker's
    next pass, which must open the pod's raw record again."""
    first, second = ClusterState(), ClusterState()
    vmi = vmi_obj("team-b", "vm1", ["vm1-gpu0"], {LAUNCHER_UID: "node-1"}, "node-1")
    load_objects(
        [
            namespace_obj("team-b"),
            class_obj("h100", H100),
            node_obj("node-1", {H100: 4}),
            gpu_obj("team-b", "vm1-gpu0", "h100", "vm1", phase="Bound", node="node-1"),
            launcher_obj(vmi, H100, 1, "node-1", uid=LAUNCHER_UID, name="virt-launcher-vm1-abcde"),
        ]
    )
    full_pass(first)
    assert ("team-b", "Pod", "virt-launcher-vm1-abcde", 1) in open_records()  # no VMI yet: raw
    clock.advance(seconds=300)
    load_objects([vmi])
    full_pass(second)
    assert open_records() == {("team-b", "GPU", "vm1-gpu0", 1)}  # its set holds the GPU now
    clock.advance(seconds=300)
    models.VirtualMachineInstance.objects.filter(name="vm1").delete()
    full_pass(first)
    assert open_records() == {("team-b", "GPU", "vm1-gpu0", 1), ("team-b", "Pod", "virt-launcher-vm1-abcde", 1)}


@pytest.mark.django_db
def test_one_worker_alone_does_not_reconcile_every_record_for_a_pod_that_came_and_went(clock: Clock) -> None:
    """The full reconciliation is only for what other passes may have recorded: a worker
    whose own last full pass is the latest reconciles just what changed."""
    worker = ClusterState()
    load_objects(
        [namespace_obj("team-b"), node_obj("node-1", {H100: 4}), plain_pod_obj("team-b", "kept", H100, 1, "node-1")]
    )
    full_pass(worker)
    load_objects([plain_pod_obj("team-b", "brief", H100, 1, "node-1")])
    models.Pod.objects.filter(name="brief").delete()
    catch = worker.catch_up()
    assert catch.vanished == {"Pod"}
    assert not catch.reconcile_all


@pytest.mark.django_db
def test_cluster_mode_a_raw_pod_deleted_between_one_workers_passes(apiserver: ControlPlane, clock: Clock) -> None:
    """The same in cluster mode: the sync mirrors the pod's arrival and its deletion."""
    first, second = ClusterState(), ClusterState()
    apiserver.seed(namespace_obj("team-b"), node_obj("node-1", {H100: 4}), class_obj("h100", H100))
    sync.sync_once()
    full_pass(first)
    clock.advance(seconds=300)
    apiserver.seed(plain_pod_obj("team-b", "trainer", H100, 1, "node-1"))
    sync.sync_once()
    full_pass(second)
    assert open_records() == {("team-b", "Pod", "trainer", 1)}
    clock.advance(seconds=300)
    # gracePeriodSeconds=0: what its kubelet confirms once the pod stopped (no kubelet here).
    apiserver.request("DELETE", "/api/v1/namespaces/team-b/pods/trainer?gracePeriodSeconds=0")
    sync.sync_once()
    assert not models.Pod.objects.exists()
    full_pass(first)
    assert open_records() == set()

"""Usage records: written by full passes, GPUs counted once, history append-only.

Clusters are built from the real captures (harness/shapes.py) and loaded into the mirror;
passes run for real (``binder.runtime.passes.run_pass``) at times set by the ``clock`` fixture.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import IntegrityError, connection, transaction
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from binder import models
from binder.engine import types as e
from binder.engine.usage import (
    HOLDING_ORDER,
    OpenRecord,
    RecordPhase,
    SubjectKind,
    UsageHolding,
    holdings,
    reconcile_usage,
)
from binder.mirror.snapshot import load_objects
from binder.models import ClosedRecordError
from binder.runtime.passes import run_pass
from harness.clock import Clock
from harness.shapes import (
    A10,
    H100,
    class_obj,
    gpu,
    gpu_class,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    real,
    vmi_obj,
)
from usage import queries
from usage.models import UsageRecord

LAUNCHER_UID = "e566efd1-741e-4def-b164-403f2585fbba"  # the captured launcher's uid
VGPU = "nvidia.com/NVIDIA_A10-12Q"


def records(**filters: Any) -> list[UsageRecord]:
    return list(UsageRecord.objects.filter(**filters).order_by("start", "subject", "id"))


def full_pass() -> models.PassRun:
    return run_pass(models.PassKind.FULL)


def hours(namespace: str, start: Any, end: Any, now: Any) -> queries.GpuHours:
    return queries.gpu_hours(namespace, start, end, now)


def running_vm(forged_units: int = 0, launcher_units: int = 2) -> list[dict[str, Any]]:
    """t1/vm1: two h100 devices Bound on n1, its real launcher, optionally a forged one."""
    vmi = vmi_obj("t1", "vm1", ["vm1-gpu0", "vm1-gpu1"], {LAUNCHER_UID: "n1"}, "n1")
    objects = [
        namespace_obj("t1"),
        class_obj("h100", H100),
        node_obj("n1", {H100: 8}),
        gpu_obj("t1", "vm1-gpu0", "h100", "vm1", phase="Bound", node="n1"),
        gpu_obj("t1", "vm1-gpu1", "h100", "vm1", phase="Bound", node="n1"),
        vmi,
        launcher_obj(vmi, H100, launcher_units, "n1", uid=LAUNCHER_UID, name="virt-launcher-vm1-real1"),
    ]
    if forged_units:
        forged = launcher_obj(vmi, H100, forged_units, "n1", name="virt-launcher-vm1-fake1")
        # It names the VMI in its owner reference and labels, exactly like the real one ...
        assert forged["metadata"]["ownerReferences"][0]["name"] == "vm1"
        assert forged["metadata"]["labels"]["kubevirt.io/created-by"] == vmi["metadata"]["uid"]
        # ... but virt-controller never listed it in activePods.
        assert forged["metadata"]["uid"] not in vmi["status"]["activePods"]
        objects.append(forged)
    return objects


# -- the engine, with plain objects -----------------------------------------------------------


def test_engine_holdings_devices_and_pods() -> None:
    classes = {"h100": gpu_class("h100", H100, units=2)}
    devices = [
        gpu("t1", "a", "h100", "vm1", phase="Bound", node="n1"),
        gpu("t1", "b", "h100", "vm1", phase="Lost"),
        gpu("t1", "c", "h100", "vm2"),  # Pending: holds nothing
        gpu("t1", "d", "gone", "vm3", phase="Bound", node="n1"),  # class missing: holds nothing
    ]
    pods = [
        e.Pod("t1", "trainer", "uid-1", "n2", "Running", {A10: 3}),
        e.Pod("t1", "done", "uid-2", "n2", "Succeeded", {A10: 1}),
    ]
    found = holdings(devices, pods, classes, lambda ns, name: None)
    assert [(h.subject, h.phase, h.node, h.units, h.key) for h in found] == [
        ("a", RecordPhase.BOUND, "n1", 2, "h100"),
        ("b", RecordPhase.LOST, "", 2, "h100"),
        ("trainer", RecordPhase.RAW, "n2", 3, A10),
    ]


def test_engine_reconcile_keeps_unchanged_closes_changed_opens_new() -> None:
    bound = UsageHolding("t1", SubjectKind.GPU, "a", "", "h100", H100, 1, "n1", RecordPhase.BOUND, "vm1")
    moved = UsageHolding("t1", SubjectKind.GPU, "a", "", "h100", H100, 1, "n2", RecordPhase.BOUND, "vm1")
    other = UsageHolding("t1", SubjectKind.GPU, "b", "", "h100", H100, 1, "n1", RecordPhase.BOUND, "vm1")
    plan = reconcile_usage([OpenRecord(1, bound), OpenRecord(2, other), OpenRecord(3, other)], [moved, other])
    assert plan.close == (1, 3)  # a moved; a duplicate open record of b is closed too
    assert plan.open == (moved,)
    assert not reconcile_usage([OpenRecord(2, other)], [other])


@hypothesis_settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.builds(
            UsageHolding,
            st.sampled_from(["t1", "t2"]),
            st.sampled_from(list(SubjectKind)),
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["", "uid-1"]),
            st.sampled_from(["h100", "a10", H100]),
            st.sampled_from([H100, "nvidia.com/A10"]),
            st.integers(min_value=0, max_value=3),
            st.sampled_from(["", "n1", "n2"]),
            st.sampled_from(list(RecordPhase)),
            st.sampled_from(["", "vm1", "vm2"]),
        ),
        max_size=30,
    )
)
def test_holdings_sort_by_their_key_in_the_dataclass_order(found: list[UsageHolding]) -> None:
    """The sort key that replaced the dataclass's ``__lt__`` orders holdings the same way,
    ties and all: usage plans stay exactly as deterministic as before."""
    assert sorted(found, key=HOLDING_ORDER) == sorted(found)


# -- the launcher rule in records -------------------------------------------------------------


@pytest.mark.django_db
def test_forged_owner_pod_gets_raw_record_for_full_request_real_launcher_none(clock: Clock) -> None:
    load_objects(running_vm(forged_units=3))
    run = full_pass()
    assert (run.records_opened, run.records_closed) == (3, 0)
    devices = records(subject_kind="GPU")
    assert [(r.subject, r.phase, r.node, r.units, r.key) for r in devices] == [
        ("vm1-gpu0", "Bound", "n1", 1, "h100"),
        ("vm1-gpu1", "Bound", "n1", 1, "h100"),
    ]
    pods = records(subject_kind="Pod")
    assert [(r.subject, r.phase, r.units, r.key, r.node) for r in pods] == [
        ("virt-launcher-vm1-fake1", "Raw", 3, H100, "n1")
    ]
    # The real launcher (listed in activePods) holds only the devices' units: no record.
    assert not records(subject="virt-launcher-vm1-real1")


@pytest.mark.django_db
def test_real_launcher_requesting_more_than_its_devices_hold_gets_the_rest(clock: Clock) -> None:
    load_objects(running_vm(launcher_units=3))
    full_pass()
    assert [(r.subject, r.units) for r in records(subject_kind="Pod")] == [("virt-launcher-vm1-real1", 1)]


@pytest.mark.django_db
def test_records_read_the_vmi_fresh_not_the_pass_snapshot(clock: Clock) -> None:
    """Usage records ask the VMI named by the pod's owner hint at write time."""
    load_objects(running_vm())
    from binder.runtime import usage_records

    calls: list[set[tuple[str, str]]] = []
    real_read = usage_records.fresh_vmis

    def spy(pods: Any) -> Any:
        found = real_read(pods)
        calls.append(set(found))
        return found

    with mock.patch.object(usage_records, "fresh_vmis", side_effect=spy):
        full_pass()
    assert calls == [{("t1", "vm1")}]  # one read, of the VMI the launcher pod names
    assert not records(subject_kind="Pod")


# -- live migration, Lost sets, moves ----------------------------------------------------------


def migrating_vm() -> list[dict[str, Any]]:
    """default/testvm with one vGPU Bound on -01 and two active pods (source -01, target -02)."""
    vmi = real("vmi-with-gpus.yaml", 1)
    vmi["spec"]["domain"]["devices"]["gpus"] = [{"deviceName": "gpuplane.io/testvm-vgpu0", "name": "vgpu0"}]
    target = real("virt-launcher-pod-migration-target.yaml", 0)
    source = copy.deepcopy(target)
    source["metadata"]["name"] = "virt-launcher-testvm-n2lww"
    source["metadata"]["uid"] = "e19201bc-9cb1-46bc-af3d-687d9c9419fb"
    del source["metadata"]["labels"]["kubevirt.io/migrationJobUID"]
    del source["metadata"]["annotations"]["kubevirt.io/migrationJobName"]
    source["spec"]["nodeName"] = "yj-qaovnk8swork-01"
    assert set(vmi["status"]["activePods"]) == {source["metadata"]["uid"], target["metadata"]["uid"]}
    return [
        namespace_obj("default"),
        class_obj("a10-12q", VGPU),
        node_obj("yj-qaovnk8swork-01", {VGPU: 4}),
        node_obj("yj-qaovnk8swork-02", {VGPU: 4}),
        gpu_obj("default", "testvm-vgpu0", "a10-12q", "testvm", phase="Bound", node="yj-qaovnk8swork-01"),
        vmi,
        source,
        target,
    ]


@pytest.mark.django_db
def test_live_migration_gpu_hours_count_the_vms_gpu_once(clock: Clock) -> None:
    load_objects(migrating_vm())
    start = clock.now
    full_pass()
    assert [(r.subject_kind, r.subject) for r in records()] == [("GPU", "testvm-vgpu0")]
    clock.advance(hours=3)
    full_pass()  # still migrating: nothing changes
    got = hours("default", start - timedelta(days=1), clock.now, clock.now)
    assert got.total == pytest.approx(3.0)  # one vGPU for 3 hours, not 3 (device + 2 pods)
    assert got.pods == 0.0
    assert got.per_key == pytest.approx({"a10-12q": 3.0, VGPU: 3.0})


@pytest.mark.django_db
def test_lost_set_has_lost_records_and_its_running_pod_adds_nothing(clock: Clock) -> None:
    vmi = vmi_obj("t1", "vm2", ["vm2-gpu0", "vm2-gpu1"], {LAUNCHER_UID: "n1"}, "n1")
    load_objects(
        [
            namespace_obj("t1"),
            class_obj("h100", H100),
            node_obj("n1", {H100: 2}, unschedulable=True),  # cordoned: the set cannot rebind
            gpu_obj("t1", "vm2-gpu0", "h100", "vm2", phase="Lost"),
            gpu_obj("t1", "vm2-gpu1", "h100", "vm2", phase="Lost"),
            vmi,
            launcher_obj(vmi, H100, 2, "n1", uid=LAUNCHER_UID),
        ]
    )
    full_pass()
    assert set(models.GpuDevice.objects.values_list("phase", flat=True)) == {"Lost"}
    assert [(r.subject, r.phase, r.node) for r in records()] == [("vm2-gpu0", "Lost", ""), ("vm2-gpu1", "Lost", "")]
    start = clock.now
    clock.advance(hours=2)
    got = hours("t1", start, clock.now, clock.now)
    assert got.total == pytest.approx(4.0) and got.pods == 0.0


@pytest.mark.django_db
def test_move_closes_one_record_and_opens_the_next_continuously(clock: Clock) -> None:
    load_objects(
        [
            namespace_obj("t1"),
            class_obj("h100", H100),
            node_obj("n1", {H100: 8}),
            node_obj("n2", {H100: 8}),
            gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node="n1"),
        ]
    )
    t0 = clock.now
    full_pass()
    clock.advance(hours=1)
    node = models.Node.objects.get(name="n1")
    node.labels = {**node.labels, "gpuplane.io/drain": "true"}
    node.save()
    t1 = clock.now
    run = full_pass()
    assert (run.moved, run.records_opened, run.records_closed) == (1, 1, 1)
    first, second = records()
    assert (first.node, first.start, first.end, first.closed_by_pass) == ("n1", t0, t1, run.pk)
    assert (second.node, second.start, second.end, second.opened_by_pass) == ("n2", t1, None, run.pk)
    clock.advance(minutes=30)
    got = hours("t1", t0, clock.now, clock.now)
    assert got.total == pytest.approx(1.5)  # no gap and no overlap at the move
    assert hours("t1", t0 + timedelta(minutes=30), t1 + timedelta(minutes=15), clock.now).total == pytest.approx(0.75)


@pytest.mark.django_db
def test_units_change_opens_a_new_record_and_second_pass_writes_nothing(clock: Clock) -> None:
    load_objects([namespace_obj("t1"), class_obj("a10", A10), node_obj("n1", {A10: 8}),
                  gpu_obj("t1", "g0", "a10", "vm1", phase="Bound", node="n1")])  # fmt: skip
    full_pass()
    assert full_pass().records_opened == 0
    models.GpuClass.objects.filter(name="a10").update(units_per_device=2)
    clock.advance(hours=1)
    run = full_pass()
    assert (run.records_opened, run.records_closed) == (1, 1)
    assert [(r.units, r.end is None) for r in records()] == [(1, False), (2, True)]


@pytest.mark.django_db
def test_raw_pod_record_closes_when_the_pod_finishes(clock: Clock) -> None:
    load_objects([namespace_obj("t2"), node_obj("n1", {A10: 8}), plain_pod_obj("t2", "trainer", A10, 4, "n1")])
    full_pass()
    (record,) = records()
    assert (record.subject_kind, record.units, record.phase, record.subject_uid != "") == ("Pod", 4, "Raw", True)
    clock.advance(hours=1)
    models.Pod.objects.filter(name="trainer").update(phase="Succeeded")
    full_pass()
    record.refresh_from_db()
    assert record.end == clock.now


@pytest.mark.django_db
def test_answer_pass_writes_no_records(clock: Clock) -> None:
    load_objects([namespace_obj("t1"), class_obj("h100", H100), node_obj("n1", {H100: 8}),
                  gpu_obj("t1", "g0", "h100", "vm1", bind_request="req-1")])  # fmt: skip
    run = run_pass(models.PassKind.ANSWER)
    assert run.bound == 1
    assert models.GpuDevice.objects.get(name="g0").phase == "Bound"
    assert not records()
    full_pass()
    assert [r.phase for r in records()] == ["Bound"]


# -- deletion, with the feature off -----------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("what", ["device", "class", "namespace"])
def test_deletions_close_records_even_with_gpus_disabled(clock: Clock, settings: Any, what: str) -> None:
    load_objects(running_vm())
    full_pass()
    assert len(records(end__isnull=True)) == 2
    settings.GPUPLANE_ENABLED = False
    clock.advance(hours=1)
    if what == "device":
        models.GpuDevice.objects.filter(name="vm1-gpu0").delete()
    elif what == "class":
        models.GpuClass.objects.filter(name="h100").delete()
    else:
        models.Namespace.objects.filter(name="t1").delete()
    run = full_pass()
    assert run.skipped  # nothing placed ...
    closed = records(end__isnull=False)  # ... but records closed
    expected = {"device": ["vm1-gpu0"], "class": ["vm1-gpu0", "vm1-gpu1"], "namespace": ["vm1-gpu0", "vm1-gpu1"]}
    assert [r.subject for r in closed] == expected[what]
    assert all(r.end == clock.now for r in closed)
    if what == "class":
        # With the class gone the launcher pod's 2 GPUs are no longer held by devices: raw usage.
        assert [(r.subject_kind, r.units) for r in records(end__isnull=True)] == [("Pod", 2)]


# -- append-only ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_closed_records_cannot_be_changed_or_deleted(clock: Clock) -> None:
    load_objects([namespace_obj("t2"), node_obj("n1", {A10: 8}), plain_pod_obj("t2", "trainer", A10, 4, "n1")])
    full_pass()
    models.Pod.objects.all().delete()
    clock.advance(hours=1)
    full_pass()
    (record,) = records()
    assert record.end is not None
    record.units = 1
    with pytest.raises(ClosedRecordError, match="closed"):
        record.save()
    with pytest.raises(ClosedRecordError, match="never deleted"):
        record.delete()
    with pytest.raises(ClosedRecordError, match="never deleted"):
        UsageRecord.objects.all().delete()
    with pytest.raises(ClosedRecordError, match="cannot update units"):
        UsageRecord.objects.update(units=9)
    assert UsageRecord.objects.filter(pk=record.pk).update(end=clock.now) == 0  # closed rows never match
    with pytest.raises(ClosedRecordError, match="reopened"):
        UsageRecord.objects.update(end=None)
    record.refresh_from_db()
    assert record.units == 4


@pytest.mark.django_db
def test_open_record_may_only_be_closed(clock: Clock) -> None:
    load_objects([namespace_obj("t2"), node_obj("n1", {A10: 8}), plain_pod_obj("t2", "trainer", A10, 4, "n1")])
    full_pass()
    (record,) = records()
    record.node = "elsewhere"
    with pytest.raises(ClosedRecordError, match="node"):
        record.save()


@pytest.mark.django_db
@pytest.mark.postgres
def test_postgresql_trigger_stops_raw_sql_on_closed_records(clock: Clock) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the append-only trigger is PostgreSQL's")
    load_objects([namespace_obj("t2"), node_obj("n1", {A10: 8}), plain_pod_obj("t2", "trainer", A10, 4, "n1")])
    full_pass()
    (record,) = records()
    with connection.cursor() as cursor:
        with pytest.raises(IntegrityError, match="only end and closed_by_pass"), transaction.atomic():
            cursor.execute("UPDATE usage_usagerecord SET units = 1 WHERE id = %s", [record.pk])
        with pytest.raises(IntegrityError, match="cannot be deleted"), transaction.atomic():
            cursor.execute("DELETE FROM usage_usagerecord WHERE id = %s", [record.pk])
        cursor.execute('UPDATE usage_usagerecord SET "end" = now() WHERE id = %s', [record.pk])
        with pytest.raises(IntegrityError, match="is closed"), transaction.atomic():
            cursor.execute('UPDATE usage_usagerecord SET "end" = NULL WHERE id = %s', [record.pk])


@pytest.mark.django_db
def test_one_open_record_per_subject_is_a_database_constraint(clock: Clock) -> None:
    fields = dict(namespace="t1", subject_kind="GPU", subject="g0", key="h100", resource_name=H100, units=1,
                  node="n1", phase="Bound", start=clock.now)  # fmt: skip
    UsageRecord.objects.create(**fields)
    with pytest.raises(IntegrityError), transaction.atomic():
        UsageRecord.objects.create(**fields)

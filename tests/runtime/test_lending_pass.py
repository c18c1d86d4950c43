"""Lending through the product: the loader, the database pass (kept state and from
scratch alike), its writes, the verification, ``dump_state --json`` and answer passes."""

from __future__ import annotations

import csv
import io
import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from binder import models
from binder.mirror.snapshot import SnapshotError, load_objects
from binder.runtime.mirror_state import Catchup
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from binder.runtime.verify import compare_records
from harness.accounts import account, token_client
from harness.clock import Clock
from harness.shapes import (
    A10,
    H100,
    NOW,
    budget_obj,
    class_obj,
    gpu_obj,
    launcher_obj,
    namespace_obj,
    node_obj,
    vmi_obj,
)
from usage.models import UsageRecord


def dump() -> dict[str, Any]:
    out = io.StringIO()
    call_command("dump_state", "--json", stdout=out)
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def devices_of(vm: str) -> list[dict[str, Any]]:
    return [d for d in dump()["devices"] if d["vm"] == vm]


def tenant(ns: str) -> dict[str, Any]:
    return next(t for t in dump()["tenants"] if t["namespace"] == ns)


def same_as_a_rebuild(state: ClusterState) -> None:
    """The kept state equals one read from scratch, the lending fields and counts included."""
    scratch = ClusterState()
    scratch.rebuild("test")
    assert compare_records(state, scratch) == []
    assert state.scope(Catchup(view="incremental")) == scratch.scope(Catchup(view="incremental"))
    mine, theirs = state.ledger(), scratch.ledger()
    for counts in ("used", "borrowed"):
        assert {k: +c for k, c in getattr(mine, counts).items() if +c} == {
            k: +c for k, c in getattr(theirs, counts).items() if +c
        }
    assert mine.borrowed_sets == theirs.borrowed_sets
    assert mine.lending_index() == theirs.lending_index()  # by tenant, by resource and node


def base() -> list[dict[str, Any]]:
    """t1 may hold 2 A10s and borrow 4 more; t2 may hold 4; one 4-A10 node."""
    return [
        namespace_obj("t1"),
        namespace_obj("t2"),
        class_obj("a10", A10),
        node_obj("n1", {A10: 4}),
        budget_obj("t1", {"a10": 2}, borrowing={"a10": 4}),
        budget_obj("t2", {"a10": 4}),
    ]


def borrower_running(phase: str = "Running") -> list[dict[str, Any]]:
    """t1's borrower: a VMI naming its 4 devices and its launcher pod on n1."""
    vmi = vmi_obj("t1", "borrower", [f"borrower-gpu{i}" for i in range(4)], {}, "n1")
    vmi["metadata"]["uid"] = "vmi-borrower"
    pod = launcher_obj(vmi, A10, 4, "n1", uid="pod-borrower", phase=phase, name="virt-launcher-borrower")
    vmi["status"]["activePods"] = {"pod-borrower": "n1"}
    return [vmi, pod]


@pytest.mark.django_db
def test_the_loader_reads_borrowing_and_refuses_a_negative_one() -> None:
    load_objects(base())
    assert models.GpuBudget.objects.get(namespace__name="t1").borrowing == {"a10": 4}
    with pytest.raises(SnapshotError, match="spec.borrowing"):
        load_objects([budget_obj("t1", {"a10": 2}, borrowing={"a10": -1})])


@pytest.mark.django_db
@pytest.mark.parametrize("fresh", [False, True], ids=["kept-state", "from-scratch"])
def test_borrow_mark_and_release_through_the_database(fresh: bool) -> None:
    state = ClusterState()

    def full() -> models.PassRun:
        return run_pass(models.PassKind.FULL, ClusterState() if fresh else state)

    load_objects([*base(), *(gpu_obj("t1", f"borrower-gpu{i}", "a10", "borrower") for i in range(4))])
    full()
    assert {(d["phase"], d.get("borrowed")) for d in devices_of("borrower")} == {("Bound", True)}
    assert tenant("t1")["borrowing"] == {"a10": 4} and tenant("t1")["borrowed"] == {"a10": 4, A10: 4}
    assert "borrowing" not in tenant("t2") and "borrowed" not in tenant("t2")
    assert models.GpuBudget.objects.get(namespace__name="t1").borrowed == {"a10": 4, A10: 4}
    assert models.GpuDevice.objects.filter(borrowed=True).count() == 4

    # Its VM runs; t2 orders 4 within budget: the borrower is marked, not released.
    load_objects([*borrower_running(), *(gpu_obj("t2", f"waiting-gpu{i}", "a10", "waiting") for i in range(4))])
    full()
    assert {(d["phase"], d.get("reclaimFor")) for d in devices_of("borrower")} == {("Bound", "t2/waiting")}
    assert {d["phase"] for d in devices_of("waiting")} == {"Pending"}
    assert "waits for its VM to stop" in devices_of("waiting")[0]["reason"]
    if not fresh:
        same_as_a_rebuild(state)

    # The VM stops: the next pass releases the borrower and binds t2 on n1.
    load_objects(borrower_running(phase="Succeeded"))
    full()
    assert {(d["phase"], d.get("borrowed"), d.get("reclaimFor")) for d in devices_of("borrower")} == {
        ("Pending", None, None)
    }
    assert {(d["phase"], d["node"]) for d in devices_of("waiting")} == {("Bound", "n1")}
    assert "borrowed" not in tenant("t1")
    assert models.GpuBudget.objects.get(namespace__name="t1").borrowed == {}
    # The borrower's records were borrowed ones, closed at the release; none is open.
    records = UsageRecord.objects.filter(vm_name="borrower")
    assert records.count() == 4 and all(r.borrowed and r.end is not None for r in records)
    if not fresh:
        same_as_a_rebuild(state)
    released = models.Decision.objects.filter(vm_name="borrower", to_phase="Pending")
    assert released.count() == 4 and "taken back for t2/waiting" in released[0].reason


@pytest.mark.django_db
def test_a_verification_finds_no_difference_with_borrowed_and_marked_sets(settings: Any) -> None:
    load_objects([*base(), *(gpu_obj("t1", f"borrower-gpu{i}", "a10", "borrower") for i in range(4))])
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    load_objects([*borrower_running(), *(gpu_obj("t2", f"waiting-gpu{i}", "a10", "waiting") for i in range(4))])
    run_pass(models.PassKind.FULL, state)
    settings.GPUPLANE_VERIFY_SECONDS = 0
    run = run_pass(models.PassKind.FULL, state)
    assert run.verify_mismatches == 0
    assert models.GpuDevice.objects.filter(reclaim_for="t2/waiting").count() == 4


@pytest.mark.django_db
def test_a_verification_compares_the_ledgers_kept_lending_indexes(settings: Any) -> None:
    """Repay and reclaim read the borrowed sets from indexes the worker's ledger keeps
    (by tenant, by resource and node): a kept index that drifted is a verification mismatch."""
    load_objects([*base(), *(gpu_obj("t1", f"borrower-gpu{i}", "a10", "borrower") for i in range(4))])
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    ledger = state.ledger()
    assert ledger.lent_of == {"t1": {("t1", "borrower")}}
    assert ledger.lent_on == {A10: {"n1": {("t1", "borrower")}}}
    ledger.lent_on.clear()  # drifted: reclaim would find nothing to mark
    settings.GPUPLANE_VERIFY_SECONDS = 0
    run = run_pass(models.PassKind.FULL, state)
    assert run.verify_mismatches == 1
    assert state.ledger().lent_on == {A10: {"n1": {("t1", "borrower")}}}  # continued from the rebuilt state


@pytest.mark.django_db
@pytest.mark.parametrize("fresh", [False, True], ids=["kept-state", "from-scratch"])
def test_a_waiting_order_mixing_resources_marks_the_borrowed_set_in_its_way(fresh: bool) -> None:
    """t2's order of one A10 and one H100 (no alternatives: held as ordered) finds n1's A10
    held by t1's borrowed set, whose VM runs: the pass marks it, and once the VM stops, the
    next pass releases it and places the order on n1 whole."""
    state = ClusterState()

    def full() -> models.PassRun:
        return run_pass(models.PassKind.FULL, ClusterState() if fresh else state)

    vmi = vmi_obj("t1", "lent", ["lent-gpu0"], {}, "n1")
    vmi["metadata"]["uid"] = "vmi-lent"
    pod = launcher_obj(vmi, A10, 1, "n1", uid="pod-lent", name="virt-launcher-lent")
    vmi["status"]["activePods"] = {"pod-lent": "n1"}
    load_objects([
        namespace_obj("t1"), namespace_obj("t2"), class_obj("a10", A10), class_obj("h100", H100),
        node_obj("n1", {A10: 1, H100: 1}), budget_obj("t1", {"a10": 0}, borrowing={"a10": 1}),
        gpu_obj("t1", "lent-gpu0", "a10", "lent", phase="Bound", node="n1", borrowed=True), vmi, pod,
        gpu_obj("t2", "mixed-a", "a10", "mixed"), gpu_obj("t2", "mixed-h", "h100", "mixed"),
    ])  # fmt: skip
    full()
    lent = models.GpuDevice.objects.get(name="lent-gpu0")
    assert (lent.phase, lent.node, lent.borrowed, lent.reclaim_for) == ("Bound", "n1", True, "t2/mixed")
    assert all("waits for reclaim: t1/lent on n1" in d.reason for d in models.GpuDevice.objects.filter(vm_name="mixed"))
    models.Pod.objects.filter(uid="pod-lent").update(phase="Succeeded")
    full()
    assert {(d.phase, d.node) for d in models.GpuDevice.objects.filter(vm_name="mixed")} == {("Bound", "n1")}
    lent = models.GpuDevice.objects.get(name="lent-gpu0")
    assert (lent.phase, lent.borrowed, lent.reclaim_for) == ("Pending", False, "")
    if not fresh:
        same_as_a_rebuild(state)


@pytest.mark.django_db
def test_a_repaid_set_is_recorded_as_a_decision() -> None:
    objects = [*base(), *(gpu_obj("t1", f"own-gpu{i}", "a10", "own", phase="Bound", node="n1") for i in range(2))]
    objects += [gpu_obj("t1", f"lent-gpu{i}", "a10", "lent", phase="Bound", node="n1", borrowed=True) for i in range(2)]
    load_objects(objects)
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    assert models.GpuDevice.objects.filter(borrowed=True).count() == 2  # 2 own + 2 is past the limit of 2
    models.GpuDevice.objects.filter(vm_name="own").delete()
    run_pass(models.PassKind.FULL, state)
    assert models.GpuDevice.objects.filter(borrowed=True).count() == 0
    repaid = models.Decision.objects.filter(vm_name="lent")
    assert repaid.count() == 2 and all(d.from_node == d.to_node == "n1" and "repaid" in d.reason for d in repaid)
    same_as_a_rebuild(state)
    # Each device's borrowed record closed where its own record opened.
    records = UsageRecord.objects.filter(vm_name="lent", subject="lent-gpu0").order_by("start", "id")
    assert [(r.borrowed, r.end is None) for r in records] == [(True, False), (False, True)]
    assert records[0].end == records[1].start


@pytest.mark.django_db
def test_an_answer_pass_releases_a_marked_set_and_refuses_it_naming_the_waiting_set() -> None:
    objects = [*base(), *(gpu_obj("t2", f"waiting-gpu{i}", "a10", "waiting") for i in range(4))]
    objects += [
        gpu_obj("t1", f"borrower-gpu{i}", "a10", "borrower", phase="Bound", node="n1", borrowed=True,
                reclaim_for="t2/waiting", bind_request="req-1")
        for i in range(4)
    ]  # fmt: skip
    load_objects(objects)
    run_pass(models.PassKind.ANSWER, ClusterState())
    rows = models.GpuDevice.objects.filter(vm_name="borrower")
    assert {(r.phase, r.node, r.borrowed, r.reclaim_for) for r in rows} == {("Pending", "", False, "")}
    assert all(r.answer.startswith("refused:") and "t2/waiting" in r.answer for r in rows)


@pytest.mark.django_db
def test_the_tenant_usage_api_shows_borrowing_borrowed_units_and_borrowed_gpu_hours_apart(clock: Clock) -> None:
    load_objects([*base(), *(gpu_obj("t1", f"borrower-gpu{i}", "a10", "borrower") for i in range(3))])
    run_pass(models.PassKind.FULL, ClusterState())
    clock.advance(hours=2)
    client = token_client(account("alice", "t1"))
    answer = client.get("/api/v1/tenants/t1/usage", {"from": (NOW - timedelta(hours=1)).isoformat()})
    assert answer.status_code == 200
    body = answer.json()
    keys = {k["key"]: k for k in body["keys"]}
    assert keys["a10"] == {"key": "a10", "kind": "class", "used": 3, "limit": 2, "remaining": 0, "gpuHours": 6.0,
                                "borrowing": 4, "borrowed": 3, "borrowedGpuHours": 6.0}  # fmt: skip
    assert body["gpuHours"]["borrowed"] == 6.0 and body["gpuHours"]["total"] == 6.0
    assert {r["borrowed"] for r in body["openRecords"]} == {True}
    export = client.get("/api/v1/tenants/t1/usage-records", {"format": "csv"})
    rows = list(csv.DictReader(io.StringIO(b"".join(export.streaming_content).decode())))
    assert len(rows) == 3 and {r["borrowed"] for r in rows} == {"True"}


@pytest.mark.django_db
def test_metrics_show_borrowed_units_per_class_and_tenant_and_marks_with_their_wait(clock: Clock) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    load_objects([*base(), *(gpu_obj("t1", f"borrower-gpu{i}", "a10", "borrower") for i in range(4))])
    run_pass(models.PassKind.FULL, ClusterState())
    load_objects([*borrower_running(), *(gpu_obj("t2", f"waiting-gpu{i}", "a10", "waiting") for i in range(4))])
    run_pass(models.PassKind.FULL, ClusterState())
    clock.advance(hours=1)
    text = Client().get("/metrics").content.decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("gpuplane_borrowed_units", (("class", "a10"), ("namespace", "t1")))] == 4
    assert samples[("gpuplane_reclaim_marks", ())] == 1
    created = models.GpuDevice.objects.filter(vm_name="waiting").first().created  # type: ignore[union-attr]
    assert samples[("gpuplane_reclaim_mark_oldest_wait_seconds", ())] == (clock.now - created).total_seconds()


@pytest.mark.django_db
def test_the_staff_console_draws_borrowed_units_and_marks_apart_and_explains_the_wait(admin_client: Client) -> None:
    from django.urls import reverse

    load_objects([*base(), *(gpu_obj("t1", f"borrower-gpu{i}", "a10", "borrower") for i in range(4))])
    run_pass(models.PassKind.FULL, ClusterState())
    load_objects([*borrower_running(), *(gpu_obj("t2", f"waiting-gpu{i}", "a10", "waiting") for i in range(4))])
    run_pass(models.PassKind.FULL, ClusterState())
    board = admin_client.get(reverse("admin:placement-board")).content.decode()
    assert 'id="legend-borrowed"' in board and "4 units lent beyond budgets" in board
    assert 'id="legend-reclaim"' in board and "waits for its VM to stop" in board
    assert board.count(" bw rc") == 4  # the borrower's four units: borrowed and marked
    assert "marked for reclaim by t2/waiting: waits for its VM to stop" in board
    waiting = models.GpuDevice.objects.filter(vm_name="waiting").first()
    assert waiting is not None
    page = admin_client.get(reverse("admin:binder_gpudevice_change", args=[waiting.pk])).content.decode()
    assert "waits for reclaim: t1/borrower on n1" in page
    budgets = admin_client.get(reverse("admin:budgets")).content.decode()
    assert 'data-tenant="t1" data-key="a10"' in budgets and 'data-borrowing="4" data-borrowed="4"' in budgets

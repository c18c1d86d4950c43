"""The pass that binds many new orders at once (issue 24): the catch-up that reads them and
the device writes of a large pass take faster paths; both must leave exactly what the
general paths leave."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from binder import models
from binder.mirror.snapshot import load_objects
from binder.runtime import passes
from binder.runtime.mirror_state import Catchup
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from binder.runtime.verify import compare_records
from harness.shapes import H100, budget_obj, class_obj, gpu_obj, launcher_obj, namespace_obj, node_obj, vmi_obj


def _cluster(orders: int) -> list[dict[str, Any]]:
    """Two nodes, one Bound set, ``orders`` new sets of 1-3 devices (one with a VMI)."""
    objects = [
        namespace_obj("t1"),
        class_obj("h100", H100),
        node_obj("n1", {H100: 16}),
        node_obj("n2", {H100: 16}),
        budget_obj("t1", {"h100": 64}),
        gpu_obj("t1", "old-gpu0", "h100", "old", phase="Bound", node="n1"),
        vmi_obj("t1", "o0", ["o0-gpu0"], {}, ""),
    ]
    for i in range(orders):
        objects += [gpu_obj("t1", f"o{i}-gpu{k}", "h100", f"o{i}") for k in range(1 + i % 3)]
    return objects


def _same_as_a_rebuild(state: ClusterState) -> None:
    scratch = ClusterState()
    scratch.rebuild("test")
    assert compare_records(state, scratch) == []
    assert state.device_ids == scratch.device_ids
    assert {k: dict(v) for k, v in state.members.items()} == {k: dict(v) for k, v in scratch.members.items()}
    assert state.wanting == scratch.wanting
    assert state.scope(Catchup(view="incremental")) == scratch.scope(Catchup(view="incremental"))
    mine, theirs = state.ledger(), scratch.ledger()
    for counts in ("booked", "used"):
        assert {k: +c for k, c in getattr(mine, counts).items() if +c} == {
            k: +c for k, c in getattr(theirs, counts).items() if +c
        }
    assert {set_key: state.set_members(set_key) for set_key in state.members} == {
        set_key: mine.devices(set_key) for set_key in state.members
    }


@pytest.mark.django_db
def test_a_catch_up_of_new_changed_and_deleted_devices_equals_a_rebuild() -> None:
    load_objects(_cluster(3))
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    state.ledger()  # kept, so the catch-up moves it set by set
    # Another writer: new orders, one device moved to another set, one deleted, one asks.
    load_objects([gpu_obj("t1", f"n{i}-gpu{k}", "h100", f"n{i}") for i in range(4) for k in range(2)])
    models.GpuDevice.objects.filter(name="o1-gpu1").update(vm_name="o2")
    models.GpuDevice.objects.filter(name="o2-gpu0").delete()
    models.GpuDevice.objects.filter(name="old-gpu0").update(bind_request="req-1")
    catch = state.catch_up(models.PassKind.FULL)
    assert catch.view == "incremental"
    assert ("t1", "n3-gpu1") in catch.changed["GPU"] and ("t1", "o2-gpu0") in catch.changed["GPU"]
    assert {("t1", "n0"), ("t1", "o1"), ("t1", "o2"), ("t1", "old")} <= catch.dirty_sets
    assert ("t1", "old") in state.wanting
    _same_as_a_rebuild(state)
    # The pass then places the new orders: what the state keeps per set follows it.
    assert run_pass(models.PassKind.FULL, state).bound >= 4
    _same_as_a_rebuild(state)


@pytest.mark.django_db
def test_a_new_vmi_keeps_the_ledger_and_one_its_launcher_names_moves_it() -> None:
    """A VM start is a new VMI before its launcher pod exists: the ledger, which reads VMIs
    only to tell launchers from other pods, is kept (rebuilding it cost the next answer pass
    most of a second at 110k devices). Once a pod names the VMI as its owner, a change of
    the VMI decides whether that pod is its launcher, and the ledger follows."""
    load_objects(_cluster(1))
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    ledger = state.ledger()
    base = ledger.used["t1"][H100]  # the Bound set and the order o0 the pass placed
    load_objects([vmi_obj("t1", "vm9", ["vm9-gpu0"], {}, "")])
    state.catch_up(models.PassKind.ANSWER)
    assert state.ledger() is ledger, "a VMI no pod names rebuilt the ledger"
    _same_as_a_rebuild(state)
    # o0's launcher pod, not (yet) in o0's activePods: raw usage, until the VMI lists it.
    node = models.GpuDevice.objects.get(name="o0-gpu0").node
    o0 = vmi_obj("t1", "o0", ["o0-gpu0"], {}, "")
    pod = launcher_obj(o0, H100, 1, node)
    load_objects([pod])
    state.catch_up(models.PassKind.ANSWER)
    assert state.ledger().used["t1"][H100] == base + 1
    _same_as_a_rebuild(state)
    load_objects([vmi_obj("t1", "o0", ["o0-gpu0"], {pod["metadata"]["uid"]: node}, node)])
    state.catch_up(models.PassKind.ANSWER)
    assert state.ledger().used["t1"][H100] == base, "the launcher still counted as raw usage"
    _same_as_a_rebuild(state)


@pytest.mark.django_db
def test_the_members_of_a_set_come_sorted_by_name() -> None:
    load_objects(_cluster(0) + [gpu_obj("t1", f"big-gpu{k}", "h100", "big") for k in (3, 1, 10, 0)])
    state = ClusterState()
    state.catch_up(models.PassKind.FULL)
    assert [d.name for d in state.set_members(("t1", "big"))] == ["big-gpu0", "big-gpu1", "big-gpu10", "big-gpu3"]
    assert state.set_members(("t1", "nothing")) == ()


@pytest.mark.django_db
@pytest.mark.parametrize("temp_refused", [False, True])
def test_a_pass_writing_many_devices_writes_them_as_a_small_one_does(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, temp_refused: bool
) -> None:
    """On PostgreSQL a pass writing many devices COPYs them into a table of its transaction
    first: the rows, the feed entries and the worker's state come out the same. A database
    user that may not create temporary tables gets the single statement instead."""
    if connection.vendor != "postgresql":
        pytest.skip("the COPY path is PostgreSQL's")
    monkeypatch.setattr(passes, "COPY_DEVICES_FROM", 1)
    if temp_refused:  # what CREATE TEMP TABLE raises without the TEMP privilege
        monkeypatch.setattr(passes, "DEVICE_WRITES_TABLE", "DO $$ BEGIN RAISE insufficient_privilege; END $$")
    load_objects(_cluster(6))
    state = ClusterState()
    before = models.Change.objects.order_by("-position").values_list("position", flat=True).first() or 0
    run = run_pass(models.PassKind.FULL, state)
    assert run.bound == 6 and run.devices_written == 12
    rows = {
        name: (phase, node, status_class_name, reason)
        for name, phase, node, status_class_name, reason in models.GpuDevice.objects.values_list(
            "name", "phase", "node", "status_class_name", "reason"
        )
    }
    for object_id, device in state.records["GPU"].items():
        if device.name == "old-gpu0":  # loaded Bound, not written
            continue
        assert rows[device.name] == (device.phase.value, device.node, "h100", device.reason), object_id
    assert all(phase == "Bound" and node in ("n1", "n2") for phase, node, _, _ in rows.values())
    written = set(models.Change.objects.filter(position__gt=before, kind="GPU", op="U").values_list("name", flat=True))
    assert written == {name for name in rows if name != "old-gpu0"}
    # The table of the transaction is gone, and the next pass reads none of its own writes.
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('gpuplane_device_writes')")
        assert cursor.fetchone()[0] is None
    assert ("no temporary table for the device writes" in caplog.text) == temp_refused
    follow = run_pass(models.PassKind.FULL, state)
    assert follow.view in ("incremental", "unchanged") and follow.rows_read == 0
    _same_as_a_rebuild(state)


def _pending_rows() -> dict[str, tuple[str, str]]:
    return {name: (phase, node) for name, phase, node in models.GpuDevice.objects.values_list("name", "phase", "node")}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("side", ["database", "bookkeeping"])
def test_a_failure_beside_the_large_writes_rolls_the_whole_pass_back(
    monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    """A large pass's writes run in a thread while the state's bookkeeping runs in the
    pass's: a failure on either side fails the pass after both ended, nothing is written,
    the state is dropped, and the next pass places the same orders from a rebuild."""
    if connection.vendor != "postgresql":
        pytest.skip("the writes beside the bookkeeping are PostgreSQL's")
    monkeypatch.setattr(passes, "COPY_DEVICES_FROM", 1)
    load_objects(_cluster(6))
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)  # places the six orders: a rebuild
    models.GpuDevice.objects.exclude(vm_name="old").update(phase="Pending", node="", status_class_name="")
    before = _pending_rows()
    ran: list[str] = []

    def broken(*args: Any, **kwargs: Any) -> None:
        ran.append(side)
        raise RuntimeError(f"{side} failed")

    if side == "database":
        monkeypatch.setattr(passes, "_write_statements", broken)
    else:
        monkeypatch.setattr(ClusterState, "apply_result", broken)
    with pytest.raises(RuntimeError, match=f"{side} failed"):
        run_pass(models.PassKind.FULL, state)
    assert ran == [side]
    assert _pending_rows() == before
    assert not state.valid
    monkeypatch.undo()
    monkeypatch.setattr(passes, "COPY_DEVICES_FROM", 1)
    again = run_pass(models.PassKind.FULL, state)
    assert again.view == "rebuilt" and again.bound == 6
    _same_as_a_rebuild(state)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("temp_refused", [False, True])
def test_a_large_device_update_alone_plans_with_its_own_settings(
    monkeypatch: pytest.MonkeyPatch, temp_refused: bool
) -> None:
    """A large pass's device UPDATE runs with more work_mem, without jit and with random
    reads priced lower (either way it writes: COPY or one statement); the statements after
    it, the usage records' among them, plan with the configured values again."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's settings")
    settings = (
        "current_setting('work_mem') AS work_mem, current_setting('jit') AS jit,"
        " current_setting('random_page_cost') AS random_page_cost"
    )
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {settings}")
        configured = cursor.fetchone()
        cursor.execute("DROP TABLE IF EXISTS gpuplane_seen")
        cursor.execute(f"CREATE TEMP TABLE gpuplane_seen AS SELECT 'before' AS at, {settings} LIMIT 0")
    seen = f"INSERT INTO gpuplane_seen SELECT '%s', {settings}; "
    monkeypatch.setattr(passes, "COPY_DEVICES_FROM", 1)
    if temp_refused:
        monkeypatch.setattr(passes, "DEVICE_WRITES_TABLE", "DO $$ BEGIN RAISE insufficient_privilege; END $$")
    # Observed in the same session: at the UPDATE (either form) and right after the writes.
    monkeypatch.setattr(passes, "DEVICE_UPDATE_FROM_COPY", seen % "update" + passes.DEVICE_UPDATE_FROM_COPY)
    unnest = passes._update_devices_by_unnest

    def observed(binary: Any, changed: Any) -> None:
        binary.execute(seen % "update")
        unnest(binary, changed)

    monkeypatch.setattr(passes, "_update_devices_by_unnest", observed)
    monkeypatch.setattr(
        passes, "LARGE_UPDATE_SETTINGS_RESET", passes.LARGE_UPDATE_SETTINGS_RESET + "; " + seen % "after"
    )
    load_objects(_cluster(6))
    assert run_pass(models.PassKind.FULL, ClusterState()).bound == 6
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM gpuplane_seen")
        rows = cursor.fetchall()
        cursor.execute(f"SELECT {settings}")
        assert cursor.fetchone() == configured
        cursor.execute("DROP TABLE gpuplane_seen")
    assert rows == [("update", f"{passes.WORK_MEM_MIB[0]}MB", "off", "1.1"), ("after", *configured)]

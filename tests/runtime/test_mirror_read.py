"""Reading the whole mirror into engine records (binder.mirror.read, binder.runtime.mirror_state).

- A whole-table read on PostgreSQL comes in batches from a server-side cursor: with a
  batch of two rows it yields every row once, inside a pass's transaction and outside
  any transaction (the read model builds in autocommit), and leaves no transaction open.
- The records are those of the ORM read (``read_cluster`` through Django), jsonb included;
  a catch-up reads just the rows it names (one array query per batch on PostgreSQL).
- The ledger a state builds from the sets it keeps equals ``build_ledger`` of its records.
- Node label keys and values, and the strings records share by the thousand, are interned.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from binder import models
from binder.engine import build_ledger
from binder.mirror import read
from binder.mirror.snapshot import load_objects
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from harness.shapes import H100, budget_obj, class_obj, gpu_obj, namespace_obj, node_obj, plain_pod_obj, vmi_obj


def cluster() -> list[dict[str, Any]]:
    return [
        namespace_obj("t1"),
        namespace_obj("t2"),
        class_obj("h100", H100),
        node_obj("n1", {H100: 4}),
        node_obj("n2", {H100: 8}),
        node_obj("n3", {H100: 8}),
        *(gpu_obj("t1", f"g{i}", "h100", f"vm{i // 2}") for i in range(7)),
        gpu_obj("t2", "x0", "h100", "vmx"),
        budget_obj("t1", {"h100": 8}),
        vmi_obj("t1", "vm0", ["g0", "g1"], {}, ""),
        plain_pod_obj("t1", "raw", H100, 1, "n1"),
        plain_pod_obj("t2", "raw", H100, 2, "n2"),
    ]


def by_key(records: list[Any]) -> dict[tuple[str, str], Any]:
    return {(getattr(r, "namespace", ""), r.name): r for r in records}


def orm_read(kind: str) -> dict[tuple[str, str], Any]:
    """The records as the ORM path reads them (a queryset: Django's loaders, no batches)."""
    model = read.KINDS[kind][0]
    return by_key(read.read_rows(kind, queryset=model.objects.all()))


@pytest.fixture
def batches_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read, "_BATCH", 2)


@pytest.mark.django_db
@pytest.mark.usefixtures("batches_of_two")
def test_a_whole_table_read_yields_every_row_once_in_batches() -> None:
    load_objects(cluster())
    run_pass(models.PassKind.FULL, ClusterState())
    for kind in read.KINDS:
        ids: dict[tuple[str, str], int] = {}
        records = read.read_rows(kind, ids=ids)
        assert len(records) == read.KINDS[kind][0].objects.count()
        assert by_key(records) == orm_read(kind)
        assert set(ids) == set(by_key(records))


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("batches_of_two", "postgres_only")
def test_a_batched_read_outside_a_transaction_opens_and_closes_its_own() -> None:
    load_objects(cluster())
    assert not connection.in_atomic_block
    state = ClusterState()
    state.rebuild("a read model builds in autocommit")
    assert not connection.in_atomic_block
    assert len(state.records["GPU"]) == 8
    with transaction.atomic():
        assert by_key(read.read_rows("GPU")) == orm_read("GPU")


@pytest.mark.django_db
def test_the_kept_ledger_equals_build_ledger_of_the_records() -> None:
    load_objects(cluster())
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    load_objects([gpu_obj("t2", "x1", "h100", "vmx"), gpu_obj("t1", "g9", "h100", "vm9")])
    run_pass(models.PassKind.FULL, state)
    state._ledger = None  # built again from the sets the state keeps
    mine = state.ledger()
    theirs = build_ledger(
        classes=state.records["GPUClass"].values(),
        nodes=state.records["Node"].values(),
        devices=state.records["GPU"].values(),
        pods=state.records["Pod"].values(),
        vmis=state.records["VirtualMachineInstance"].values(),
    )
    assert {n: dict(c) for n, c in mine.booked.items() if +c} == {n: dict(c) for n, c in theirs.booked.items() if +c}
    assert {n: dict(c) for n, c in mine.used.items() if +c} == {n: dict(c) for n, c in theirs.used.items() if +c}
    assert {k: mine.devices(k) for k in state.members} == {k: theirs.devices(k) for k in state.members}
    for resource in (H100,):
        assert list(mine.fullest_with_room(resource, 1)) == list(theirs.fullest_with_room(resource, 1))


@pytest.mark.django_db
def test_strings_records_share_are_interned() -> None:
    load_objects(cluster())
    state = ClusterState()
    state.rebuild("read")
    n1, n2 = (state.records["Node"][i] for i in sorted(state.records["Node"])[:2])
    shared = [k for k in n1.labels if k in n2.labels]
    assert shared
    for key in shared:
        other = next(k for k in n2.labels if k == key)
        assert other is key
        if n1.labels[key] == n2.labels[key]:
            assert n1.labels[key] is n2.labels[key]
    pods = list(state.records["Pod"].values())
    assert pods[0].phase is pods[1].phase


@pytest.mark.django_db
@pytest.mark.usefixtures("batches_of_two")
def test_a_catch_up_reads_just_the_rows_named_in_batches() -> None:
    load_objects(cluster())
    run_pass(models.PassKind.FULL, ClusterState())
    model, _, fields = read.KINDS["GPU"]
    columns = ("id", "name", "namespace_id", *fields)
    wanted = sorted(model.objects.filter(name__in=["g0", "g3", "g6", "x0"]).values_list("id", flat=True))
    rows = list(read.fetch_ids(model, columns, [*wanted, 10**9]))  # an id gone: no row
    assert sorted(r[0] for r in rows) == wanted
    orm = {r[0]: r for r in model.objects.filter(id__in=wanted).values_list(*columns)}
    assert {r[0]: tuple(r) for r in rows} == orm

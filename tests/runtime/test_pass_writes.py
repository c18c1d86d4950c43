"""What a pass binding many devices writes: the device table's indexes (what each bound
device costs, and what the lookups by phase still find through an index) and its decisions."""

from __future__ import annotations

import pytest
from django.db import connection

from binder import models


def _indexes() -> dict[str, tuple[list[str], bool]]:
    """Index name -> (columns, partial) of the device table, from the database itself."""
    table = models.GpuDevice._meta.db_table
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, table)
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT indexrelid::regclass::text FROM pg_index WHERE indpred IS NOT NULL AND indrelid = %s::regclass",
                [table],
            )
        else:
            cursor.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = %s AND sql LIKE '%%WHERE%%'",
                [table],
            )
        partial = {row[0] for row in cursor.fetchall()}
    return {name: (c["columns"], name in partial) for name, c in constraints.items() if c["index"] or c["unique"]}


@pytest.mark.django_db
def test_no_device_index_repeats_the_leading_column_of_another() -> None:
    """Each index costs every bound device an entry: namespace_id alone is already the
    leading column of the unique (namespace, name) index."""
    columns = [cols for cols, _ in _indexes().values()]
    assert ["namespace_id"] not in columns
    assert ["namespace_id", "name"] in columns and ["namespace_id", "vm_name"] in columns


@pytest.mark.django_db
def test_the_phase_index_holds_pending_and_lost_devices_only() -> None:
    indexes = _indexes()
    assert indexes["device_unbound_idx"] == (["phase"], True)
    assert not [name for name, (cols, partial) in indexes.items() if "phase" in cols and not partial]


@pytest.mark.django_db
def test_lost_and_pending_devices_are_looked_up_through_the_phase_index() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the query plan is PostgreSQL's")
    for phase in (models.Phase.LOST, models.Phase.PENDING):
        query = models.GpuDevice.objects.filter(phase=phase).order_by().values("namespace_id", "vm_name")
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")
            plan = query.explain()
        assert "device_unbound_idx" in plan, plan


@pytest.mark.django_db
def test_a_pass_run_deleted_takes_its_decisions_with_it() -> None:
    """The database does not check a decision's pass_run (a pass writes both in one
    transaction); deleting a PassRun through the ORM still deletes its decisions."""
    from django.utils import timezone

    now = timezone.now()
    runs = [models.PassRun.objects.create(kind=models.PassKind.FULL, started=now) for _ in range(2)]
    for run in runs:
        models.Decision.objects.create(
            pass_run=run, namespace="t1", vm_name="vm", device_name="vm-gpu0", from_phase="Pending", from_node="",
            to_phase="Bound", to_node="n1", reason="bound", created=now,
        )  # fmt: skip
    runs[0].delete()
    assert list(models.Decision.objects.values_list("pass_run_id", flat=True)) == [runs[1].pk]


def test_a_pass_writes_the_answer_to_a_bind_request_never_the_request() -> None:
    """The bind request's columns belong to the webhook, the answer's to the pass
    (binder.runtime.bind_requests): the fields a pass writes hold every answer column and
    no request column, and both are real device columns."""
    from binder.runtime.bind_requests import ANSWER_COLUMNS, REQUEST_COLUMNS
    from binder.runtime.passes import PLACEMENT_FIELDS

    columns = {f.name for f in models.GpuDevice._meta.get_fields()}
    assert set(ANSWER_COLUMNS) <= set(PLACEMENT_FIELDS)
    assert not set(REQUEST_COLUMNS) & set(PLACEMENT_FIELDS)
    assert set(ANSWER_COLUMNS) | set(REQUEST_COLUMNS) <= columns

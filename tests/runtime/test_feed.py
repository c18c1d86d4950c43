"""The change feed and the worker's in-memory state.

- Every write path to a mirrored table leaves a feed entry in the same transaction
  (enumerated below: the ORM, bulk paths, raw SQL, the mirror writers the sync and
  ``load_snapshot`` use, ``clear_mirror``, the admin change form, the pass's own writes,
  a namespace's cascade, TRUNCATE).
- A transaction that took a lower position but commits after a pass read a higher one
  is still applied by the next pass (two connections, PostgreSQL).
- The state is rebuilt whenever it cannot be proven current, and verification compares
  it and the pass's decisions with a rebuild from scratch.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from prometheus_client import generate_latest

from binder import models
from binder.kube.objects import parse_object
from binder.metrics import REGISTRY
from binder.mirror.snapshot import load_file, load_objects
from binder.mirror.write import clear_mirror, mirror_event, mirror_list, write_parsed
from binder.runtime.feed import OwnWrites, own_feed_position, read_feed
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from harness.shapes import (
    H100,
    budget_obj,
    class_obj,
    gpu_obj,
    namespace_obj,
    node_obj,
    plain_pod_obj,
    real,
    vmi_obj,
)

Entry = tuple[str, str, str]  # kind, name, op


class Undone(Exception):
    """Rolls back the transaction around a pass."""


def top() -> int:
    return models.Change.objects.order_by("-position").values_list("position", flat=True).first() or 0


def since(position: int) -> list[Entry]:
    return list(models.Change.objects.filter(position__gt=position).values_list("kind", "name", "op"))


def small() -> list[dict[str, Any]]:
    return [
        namespace_obj("t1"),
        class_obj("h100", H100),
        node_obj("n1", {H100: 4}),
        gpu_obj("t1", "g0", "h100", "vm1"),
        gpu_obj("t1", "g1", "h100", "vm1"),
        budget_obj("t1", {"h100": 8}),
        vmi_obj("t1", "vm1", ["g0", "g1"], {}, ""),
        plain_pod_obj("t1", "raw", H100, 1, "n1"),
    ]


@pytest.mark.django_db
def test_every_write_path_reaches_the_feed(admin_client: Client, tmp_path: Path) -> None:  # noqa: C901 - one nested writer per path, enumerated
    mark = top()
    load_objects(small())
    loaded = set(since(mark))
    for entry in [("Namespace", "t1", "I"), ("GPUClass", "h100", "I"), ("Node", "n1", "I"), ("GPU", "g0", "I"),
                  ("GPU", "g1", "I"), ("GPUBudget", "gpu-budget", "I"), ("VirtualMachineInstance", "vm1", "I"),
                  ("Pod", "raw", "I")]:  # fmt: skip
        assert entry in loaded, entry
    ns = models.Namespace.objects.get(name="t1")

    paths: list[tuple[str, Any, list[Entry]]] = []

    def orm_save() -> None:
        node = models.Node.objects.get(name="n1")
        node.unschedulable = True
        node.save()

    def orm_create_and_delete() -> None:
        models.GpuClass.objects.create(name="tmp", resource_name=H100).delete()

    def queryset_update() -> None:
        models.GpuDevice.objects.filter(name="g0").update(class_name="other")

    def bulk_update() -> None:
        rows = list(models.Pod.objects.filter(name="raw"))
        rows[0].phase = "Succeeded"
        models.Pod.objects.bulk_update(rows, ["phase"])

    def bulk_create_update_conflicts() -> None:
        models.GpuBudget.objects.bulk_create(
            [models.GpuBudget(namespace=ns, name="gpu-budget", limits={"h100": 2})],
            update_conflicts=True,
            unique_fields=["namespace", "name"],
            update_fields=["limits"],
        )

    def raw_sql() -> None:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE binder_virtualmachineinstance SET phase = 'Succeeded' WHERE name = 'vm1'")
            cursor.execute(
                "INSERT INTO binder_node (name, uid, labels, allocatable, unschedulable, taints, ready, ready_since,"
                " created, parse_error) VALUES ('raw-node', '', '{}', '{}', false, '[]', true, NULL, NULL, '')"
            )
            cursor.execute("DELETE FROM binder_node WHERE name = 'raw-node'")

    def mirror_writers() -> None:
        parsed = parse_object(node_obj("n2", {H100: 2}), where="test")
        assert parsed is not None
        write_parsed([parsed])
        mirror_event("Node", "MODIFIED", node_obj("n2", {H100: 3}))
        mirror_list("Node", [node_obj("n1", {H100: 4})], queue=False)  # n2 is stale: deleted

    def admin_change_form() -> None:
        node = models.Node.objects.get(name="n1")
        url = reverse("admin:binder_gpuclass_change", args=[models.GpuClass.objects.get(name="h100").pk])
        form = admin_client.get(url).context["adminform"].form
        data = {name: form.initial.get(name, "") for name in form.fields}
        data.update(display_name="H100 80GB", node_selector="{}", units_per_device=1)
        data.update(created_0="2026-11-01", created_1="00:00:00")
        response = admin_client.post(url, data)
        assert response.status_code == 302, response.context["adminform"].form.errors
        assert node.pk

    def the_pass() -> None:
        models.GpuDevice.objects.filter(name="g0").update(class_name="h100")
        models.Node.objects.filter(name="n1").update(unschedulable=False)
        run_pass(models.PassKind.FULL)

    paths = [
        ("ORM save", orm_save, [("Node", "n1", "U")]),
        ("ORM create and delete", orm_create_and_delete, [("GPUClass", "tmp", "I"), ("GPUClass", "tmp", "D")]),
        ("QuerySet.update", queryset_update, [("GPU", "g0", "U")]),
        ("bulk_update", bulk_update, [("Pod", "raw", "U")]),
        ("bulk_create update_conflicts", bulk_create_update_conflicts, [("GPUBudget", "gpu-budget", "U")]),
        (
            "raw SQL",
            raw_sql,
            [("VirtualMachineInstance", "vm1", "U"), ("Node", "raw-node", "I"), ("Node", "raw-node", "D")],
        ),  # fmt: skip
        (
            "write_parsed, mirror_event, mirror_list",
            mirror_writers,
            [("Node", "n2", "I"), ("Node", "n2", "U"), ("Node", "n2", "D")],
        ),  # fmt: skip
        ("admin change form", admin_change_form, [("GPUClass", "h100", "U")]),
        ("the pass's own writes", the_pass, [("GPU", "g0", "U"), ("GPU", "g1", "U")]),
    ]
    for what, write, expected in paths:
        mark = top()
        write()
        found = since(mark)
        for entry in expected:
            assert entry in found, f"{what}: {entry} not in {found}"

    # load_snapshot --replace: clear_mirror deletes every row (tombstones), then the load inserts.
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump_all([namespace_obj("t2"), node_obj("n9", {H100: 1})]))
    mark = top()
    call_command("load_snapshot", str(path), "--replace", stdout=io.StringIO())
    found = since(mark)
    for entry in [("GPU", "g0", "D"), ("GPU", "g1", "D"), ("Node", "n1", "D"), ("GPUClass", "h100", "D"),
                  ("GPUBudget", "gpu-budget", "D"), ("VirtualMachineInstance", "vm1", "D"), ("Pod", "raw", "D"),
                  ("Namespace", "t1", "D"), ("Namespace", "t2", "I"), ("Node", "n9", "I")]:  # fmt: skip
        assert entry in found, entry
    mark = top()
    clear_mirror()
    assert {("Node", "n9", "D"), ("Namespace", "t2", "D")} <= set(since(mark))
    assert load_file(path).loaded["Node"] == 1


@pytest.mark.django_db
def test_namespace_delete_leaves_a_tombstone_for_each_of_its_rows() -> None:
    load_objects(small())
    mark = top()
    models.Namespace.objects.filter(name="t1").delete()
    found = set(since(mark))
    assert {("GPU", "g0", "D"), ("GPU", "g1", "D"), ("GPUBudget", "gpu-budget", "D"),
            ("VirtualMachineInstance", "vm1", "D"), ("Pod", "raw", "D"), ("Namespace", "t1", "D")} <= found  # fmt: skip


@pytest.mark.django_db
def test_an_update_that_changes_nothing_leaves_no_entry_on_postgresql() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's row triggers record every UPDATE (harmless: the reader compares records)")
    load_objects(small())
    mark = top()
    models.Node.objects.filter(name="n1").update(ready=True)
    assert since(mark) == []


@pytest.mark.django_db(transaction=True)
def test_truncate_is_a_reset_and_the_worker_rebuilds() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no TRUNCATE")
    load_objects(small())
    state = ClusterState()
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"
    assert run_pass(models.PassKind.FULL, state).view in ("incremental", "unchanged")
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE binder_pod")
    assert ("*", "binder_pod", "T") in since(0)
    run = run_pass(models.PassKind.FULL, state)
    assert run.view == "rebuilt"
    assert not state.records["Pod"]
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE binder_change")
    assert since(0) == [("*", "binder_change", "T")]
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"


def _dsn() -> str:
    db = connection.settings_dict
    return f"host={db['HOST']} port={db['PORT'] or 5432} user={db['USER']} dbname={db['NAME']}"


def _insert_node(conn: psycopg.Connection[Any], name: str) -> None:
    conn.execute(
        "INSERT INTO binder_node (name, uid, labels, allocatable, unschedulable, taints, ready, ready_since, created,"
        " parse_error) VALUES (%s, '', '{}', %s, false, '[]', true, NULL, NULL, '')",
        [name, json.dumps({H100: 2})],
    )


@pytest.mark.django_db(transaction=True)
def test_a_lower_position_committed_after_a_pass_is_applied_by_the_next() -> None:
    """The in-flight gap: A takes a position, B takes a higher one and commits, a pass
    reads B's; A commits; the next pass must apply A's entry although its position is
    below the highest one the worker has seen (the in-progress transactions rule)."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite runs one writer at a time: positions commit in order")
    load_objects(small())
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    with psycopg.connect(_dsn()) as a, psycopg.connect(_dsn(), autocommit=True) as b:
        _insert_node(a, "late")  # A's transaction stays open, holding the lower position
        _insert_node(b, "early")
        positions = dict(models.Change.objects.filter(kind="Node").values_list("name", "position"))
        assert "late" not in positions  # not committed yet
        first = run_pass(models.PassKind.FULL, state)
        assert first.view == "incremental"
        names = {n.name for n in state.records["Node"].values()}
        assert "early" in names and "late" not in names
        a.commit()
    late, early = (models.Change.objects.get(kind="Node", name=n).position for n in ("late", "early"))
    assert late < early <= state.position  # the gap the worker must not skip
    second = run_pass(models.PassKind.FULL, state)
    assert second.view == "incremental"
    assert {"early", "late"} <= {n.name for n in state.records["Node"].values()}
    scratch = ClusterState()
    scratch.rebuild("test")
    assert sorted(map(repr, state.records["Node"].values())) == sorted(map(repr, scratch.records["Node"].values()))


@pytest.mark.django_db
def test_the_state_is_rebuilt_whenever_it_cannot_be_proven_current(monkeypatch: pytest.MonkeyPatch) -> None:
    load_objects(small())
    state, other = ClusterState(), ClusterState()
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"  # a new process
    models.Node.objects.filter(name="n1").update(unschedulable=True)
    follow = run_pass(models.PassKind.FULL, state)
    # The node only: the rows the previous pass wrote (its devices, class and budget status)
    # are in the state already, so their feed entries are skipped, not re-read.
    assert follow.view == "incremental" and follow.rows_read == 1
    assert [n.unschedulable for n in state.records["Node"].values()] == [True]
    assert run_pass(models.PassKind.FULL, state).view == "unchanged"  # nothing changed since: no engine
    assert run_pass(models.PassKind.FULL, other).view == "rebuilt"  # another worker's first pass
    # ...which this one follows through the feed: the other's writes left entries too.
    assert run_pass(models.PassKind.FULL, state).view in ("incremental", "unchanged")
    assert run_pass(models.PassKind.ANSWER, other).view == "incremental"
    assert run_pass(models.PassKind.ANSWER, state).view == "incremental"
    # A worker judged gone (its FeedReader row pruned as stale) reads everything again.
    models.FeedReader.objects.filter(worker=other.worker).delete()
    assert run_pass(models.PassKind.FULL, other).view == "rebuilt"

    def boom(*args: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr("binder.runtime.passes.write_result", boom)
    with pytest.raises(RuntimeError, match="injected"):
        run_pass(models.PassKind.FULL, state)
    monkeypatch.undo()
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"  # the failed pass rolled back

    # Feed rows below the worker's position may go (pruning): nothing is missed.
    models.Change.objects.filter(position__lt=state.position).delete()
    models.Node.objects.filter(name="n1").update(unschedulable=False)
    assert run_pass(models.PassKind.FULL, state).view == "incremental"
    # The entry at its position gone too: it cannot prove nothing it never saw was lost.
    models.Change.objects.filter(position__lte=state.position).delete()
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"
    # The sequence restarted and new entries passed the worker's position: caught by the
    # entry at its position, which is another one now.
    for flag in (True, False, True):
        models.Node.objects.filter(name="n1").update(unschedulable=flag)
    run_pass(models.PassKind.FULL, state)
    assert state.position >= 3
    models.Change.objects.all().delete()
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("ALTER SEQUENCE binder_change_position_seq RESTART WITH 1")
        else:
            cursor.execute("UPDATE sqlite_sequence SET seq = 0 WHERE name = 'binder_change'")
    for flag in [False, True] * (state.position // 2 + 2):
        models.Node.objects.filter(name="n1").update(unschedulable=flag)
    assert top() > state.position
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"
    # The sequence restarted (the feed reset): positions went backwards.
    models.Change.objects.all().delete()
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("ALTER SEQUENCE binder_change_position_seq RESTART WITH 1")
        else:
            cursor.execute("UPDATE sqlite_sequence SET seq = 0 WHERE name = 'binder_change'")
    models.Node.objects.filter(name="n1").update(unschedulable=False)
    assert top() == 1
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"

    models.Namespace.objects.filter(name="t1").update(name="t1-renamed")
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"
    assert {d.namespace for d in state.records["GPU"].values()} == {"t1-renamed"}

    with pytest.raises(Undone), transaction.atomic():
        run_pass(models.PassKind.FULL, state)
        raise Undone  # an outer rollback undoes the worker's last pass
    assert run_pass(models.PassKind.FULL, state).view == "rebuilt"


@pytest.mark.django_db
def test_delete_and_recreate_with_the_same_name() -> None:
    load_objects(small())
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    old_id = models.GpuDevice.objects.get(name="g0").pk
    models.GpuDevice.objects.filter(name="g0").delete()
    load_objects([gpu_obj("t1", "g0", "h100", "vm2")])
    run = run_pass(models.PassKind.FULL, state)
    assert run.view == "incremental"
    new_id = models.GpuDevice.objects.get(name="g0").pk
    assert new_id != old_id and state.device_ids[("t1", "g0")] == new_id
    assert old_id not in state.records["GPU"] and state.records["GPU"][new_id].vm_name == "vm2"
    assert models.GpuDevice.objects.get(name="g0").phase == "Bound"


@pytest.mark.django_db
def test_verification_compares_with_a_rebuild_counts_and_continues_from_it(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    load_objects(small())
    settings.GPUPLANE_VERIFY_SECONDS = 0
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    models.Node.objects.filter(name="n1").update(unschedulable=True)
    clean = run_pass(models.PassKind.FULL, state)
    assert (clean.view, clean.verify_mismatches) == ("incremental", 0)
    # Corrupt the worker's memory: it believes n1 offers far more than it does.
    node_id = models.Node.objects.get(name="n1").pk
    node = state.records["Node"][node_id]
    state.records["Node"][node_id] = type(node)(name=node.name, allocatable={H100: 64}, labels=node.labels)
    state._tuples.clear()
    state._ledger = None
    with caplog.at_level(logging.ERROR, logger="binder.runtime.passes"):
        caught = run_pass(models.PassKind.FULL, state)
    assert caught.verify_mismatches and caught.verify_mismatches >= 1
    assert any("Node /n1" in r.getMessage() for r in caplog.records)
    assert state.records["Node"][node_id].allocatable == {H100: 4}  # continued from the rebuilt state
    metrics = generate_latest(REGISTRY).decode()
    assert f"gpuplane_verify_mismatches_total {float(caught.verify_mismatches)}" in metrics


@pytest.mark.django_db
def test_run_pass_repeat_prints_one_json_line_per_pass() -> None:
    load_objects(small())
    out = io.StringIO()
    call_command("run_pass", "--repeat", "3", stdout=out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert {"duration_ms", "devices_seen", "rows_read", "dirty_sets"} <= set(line)
        assert line["devices_seen"] == 2
    assert lines[-1]["view"] == "unchanged" and lines[-1]["rows_read"] == 0


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_a_bad_verify_period_stops_start_up_naming_the_variable(raw: str) -> None:
    env = {**os.environ, "GPUPLANE_VERIFY_SECONDS": raw, "DJANGO_SETTINGS_MODULE": "gpuplane.settings"}
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert f"GPUPLANE_VERIFY_SECONDS={raw!r}" in done.stderr


@pytest.mark.django_db
def test_a_full_pass_prunes_the_entries_it_applied_and_keeps_its_mark() -> None:
    load_objects(small())
    state = ClusterState()
    run_pass(models.PassKind.FULL, state)
    models.Node.objects.filter(name="n1").update(unschedulable=True)
    run_pass(models.PassKind.FULL, state)
    assert not models.Change.objects.filter(position__lt=state.position).exists()
    assert models.Change.objects.filter(position=state.mark_at, token=state.mark).exists()
    models.Node.objects.filter(name="n1").update(unschedulable=False)
    assert run_pass(models.PassKind.FULL, state).view == "incremental"  # pruning broke nothing


@pytest.mark.django_db(transaction=True)
def test_a_pass_skips_only_its_own_writes_in_the_feed() -> None:
    """The entries of a pass's own status writes are skipped by the next catch-up; a change
    another writer makes to the same rows after it is still read."""
    load_objects(small())
    state = ClusterState()
    first = run_pass(models.PassKind.FULL, state)
    assert first.devices_written > 0
    assert state.own_writes is not None and state.own_writes.upto > state.own_writes.after
    device = models.GpuDevice.objects.filter(phase="Bound").order_by("id").first()
    assert device is not None
    # Another writer (the webhook) changes a row the pass wrote.
    models.GpuDevice.objects.filter(pk=device.pk).update(bind_request="req-after-the-pass")
    follow = run_pass(models.PassKind.FULL, state)
    assert follow.view == "incremental" and follow.rows_read == 1
    record = state.records["GPU"][device.pk]
    assert record.bind_request == "req-after-the-pass"
    assert record.answered_request == "req-after-the-pass"  # and the pass answered it


@pytest.mark.django_db(transaction=True)
def test_the_feed_read_leaves_out_exactly_the_skipped_transactions_entries() -> None:
    """PostgreSQL leaves a pass's own entries out in the read itself: the skipped
    transaction's entries in the range go, an entry of that range without a transaction id
    (an anchor) and every other writer's entries stay."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite runs one writer at a time: a pass's own entries are skipped by position alone")
    load_objects(small())
    start = top()
    with transaction.atomic():
        models.Node.objects.filter(name="n1").update(unschedulable=True)
        xid, after = own_feed_position()
        models.Node.objects.filter(name="n1").update(unschedulable=False)
        anchor = models.Change.objects.create(kind="*", op=models.ChangeOp.ANCHOR, name="t", token="anchor-token")
        models.Node.objects.filter(name="n1").update(unschedulable=True)
        _, upto = own_feed_position()
    models.Node.objects.filter(name="n1").update(unschedulable=False)  # another writer, after
    assert xid is not None and after < anchor.position < upto
    everything = [position for position, *_ in read_feed(start, (), 0).entries]
    skipped = [position for position, *_ in read_feed(start, (), 0, OwnWrites(xid, after, upto)).entries]
    own = {p for p in everything if after < p <= upto and p != anchor.position}
    assert len(own) == 2
    assert skipped == [p for p in everything if p not in own]
    assert anchor.position in skipped and everything[-1] in skipped


@pytest.mark.django_db(transaction=True)
def test_pruning_keeps_what_another_live_worker_has_not_read(settings: Any) -> None:
    """Two workers take turns: one's pruning never deletes an entry the other has not
    applied while the other is live; once it is not seen for GPUPLANE_FEED_RETENTION_SECONDS
    its row goes, pruning moves on, and it reads everything again."""
    load_objects(small())
    ahead, behind = ClusterState(), ClusterState()
    run_pass(models.PassKind.FULL, behind)
    behind_at = behind.position
    for flag in (True, False, True):
        models.Node.objects.filter(name="n1").update(unschedulable=flag)
        run_pass(models.PassKind.FULL, ahead)
    # ahead pruned, but kept every entry after behind's position.
    assert models.Change.objects.filter(position__gt=behind_at).count() >= 3
    follow = run_pass(models.PassKind.FULL, behind)
    assert follow.view == "incremental"
    assert [n.unschedulable for n in behind.records["Node"].values()] == [True]

    models.FeedReader.objects.filter(worker=behind.worker).update(updated=timezone.now() - timedelta(hours=1))
    settings.GPUPLANE_FEED_RETENTION_SECONDS = 60
    models.Node.objects.filter(name="n1").update(unschedulable=False)
    run_pass(models.PassKind.FULL, ahead)
    assert not models.FeedReader.objects.filter(worker=behind.worker).exists()
    assert not models.Change.objects.filter(position__lte=behind.position).exclude(kind="*").exists()
    assert run_pass(models.PassKind.FULL, behind).view == "rebuilt"


# -- every mirrored table keeps its triggers through every migration ------------------------------


def _mirrored_tables() -> list[str]:
    """The tables of every mirrored kind (the kinds passes read, and namespaces), from the
    models: a new mirrored model is covered without touching this test."""
    from binder.mirror.read import KINDS

    return sorted({model._meta.db_table for model, *_ in KINDS.values()} | {models.Namespace._meta.db_table})


@pytest.mark.django_db
def test_every_mirrored_table_has_its_feed_triggers_after_migrate() -> None:
    """SQLite cannot add a NOT NULL column in place: Django rebuilds the table, and the old
    table's triggers go with it, so the feed would silently stop seeing that kind. Every
    migration that rebuilds a mirrored table must re-create its triggers (as 0010 does);
    this fails for any mirrored table the migrated test database left without them, on
    either database (PostgreSQL keeps them, and also needs the TRUNCATE trigger)."""
    tables = _mirrored_tables()
    assert len(tables) == 8
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("SELECT tbl_name, name FROM sqlite_master WHERE type = 'trigger'")
            found = {(table, name) for table, name in cursor.fetchall()}
            wanted = {(t, f"binder_feed_{t}_{op}") for t in tables for op in ("i", "u", "d")}
        else:
            cursor.execute(
                "SELECT c.relname, t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
                " WHERE NOT t.tgisinternal AND t.tgenabled <> 'D'"
            )
            found = {(table, name) for table, name in cursor.fetchall()}
            wanted = {(t, f"binder_feed_{op}") for t in tables for op in ("i", "u", "d", "t")}
    assert sorted(wanted - found) == []


@pytest.mark.django_db
def test_every_mirrored_table_writes_the_feed_after_migrate() -> None:
    """The same, by behaviour: one insert, update and delete per mirrored table each leave
    an entry (a trigger present but on the wrong table would pass the check above)."""
    start = top()
    load_objects(
        [namespace_obj("t1"), node_obj("n1", {H100: 8}), class_obj("h100", H100), budget_obj("t1", {"h100": 4}),
         gpu_obj("t1", "g0", "h100", "vm1"), vmi_obj("t1", "vm1", ["g0"], {}, "n1"),
         plain_pod_obj("t1", "p1", H100, 1, "n1"), virtual_machine("t1", "vm1")]
    )  # fmt: skip
    kinds = {kind for kind, _name, op in since(start) if op == "I"}
    assert kinds == {
        "Namespace", "Node", "GPUClass", "GPUBudget", "GPU", "VirtualMachineInstance", "Pod", "VirtualMachine"
    }  # fmt: skip


def virtual_machine(namespace: str, name: str) -> dict[str, Any]:
    vm = real("virtualmachine.yaml")
    vm["metadata"].update(namespace=namespace, name=name)
    return vm

"""A late commit above the reader's snapshot horizon (PostgreSQL, three connections).

A feed read takes the highest position ``P`` and the transactions its snapshot lists as
in progress (``pg_snapshot_xip``). PostgreSQL lists there only transactions whose id is
below the snapshot's ``xmax`` (one past the newest *completed* transaction): a
transaction with a newer id is just as much in progress, but left out. So when writer L
takes a position, an older transaction E takes a higher one and commits, and nothing newer
than L has completed when the reader reads, L is neither below ``P`` nor in the list, and
its entry, committed a moment later, was never read: the model said its device did not
exist (the load bench's "does not exist in namespace" denial, one new order in ~2,000).

Each test sets that order up with real connections and checks the precondition (no
transaction newer than L completed before the read) from a third connection; when other
work on the same server completed one in between, the set-up is tried again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import Client
from psycopg import sql

from binder import models
from binder.mirror.snapshot import load_objects
from binder.runtime import readmodel
from binder.runtime.passes import run_pass
from binder.runtime.readmodel import ReadModel
from binder.runtime.state import ClusterState
from binder.runtime.verify import compare_records
from harness.factories import new_vmi, review
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj
from harness.webhook_calls import allowed_patch, post

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

#: Tries at the set-up before giving up (each fails only when another session on the
#: server completes a transaction inside a window of a few milliseconds).
TRIES = 20


def _dsn() -> str:
    db = connection.settings_dict
    return f"host={db['HOST']} port={db['PORT'] or 5432} user={db['USER']} dbname={db['NAME']}"


@pytest.fixture(autouse=True)
def _postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("transaction ids and snapshots are PostgreSQL's (make test-postgres)")


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadModel]:
    load_objects(
        [
            namespace_obj("t1"),
            class_obj("h100", H100),
            node_obj("n1", {H100: 8}),
            gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node="n1"),
        ]
    )
    built = ReadModel("test")
    monkeypatch.setattr(readmodel, "MODEL", built)
    built.current()  # built, and its FeedReader row written (no write on the follows below)
    yield built


def _insert_node(conn: psycopg.Connection[Any], name: str) -> None:
    conn.execute(
        "INSERT INTO binder_node (name, uid, labels, allocatable, unschedulable, taints, ready, ready_since, created,"
        " parse_error) VALUES (%s, '', '{}', %s, false, '[]', true, NULL, NULL, '')",
        [name, json.dumps({H100: 2})],
    )


def _insert_device_like_g0(conn: psycopg.Connection[Any], name: str, vm: str) -> None:
    """A device of a new set, Bound on g0's node: a copy of g0's row under other names."""
    columns = [
        c
        for (c,) in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'binder_gpudevice'"
            " AND column_name <> 'id' ORDER BY ordinal_position"
        ).fetchall()
    ]
    given = {"name": sql.Placeholder("name"), "vm_name": sql.Placeholder("vm")}
    picked = sql.SQL(", ").join(given.get(c, sql.Identifier(c)) for c in columns)
    conn.execute(
        sql.SQL("INSERT INTO binder_gpudevice ({}) SELECT {} FROM binder_gpudevice WHERE name = 'g0'").format(
            sql.SQL(", ").join(map(sql.Identifier, columns)), picked
        ),
        {"name": name, "vm": vm},
    )


def _xmax_now() -> int:
    """The xmax a snapshot taken now has (autocommit, no transaction id of its own)."""
    with psycopg.connect(_dsn(), autocommit=True) as probe:
        row = probe.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
        assert row is not None
        return int(row[0])


@contextmanager
def late_commit_window(read: Any, tag: str) -> Iterator[tuple[psycopg.Connection[Any], int]]:
    """Run ``read`` while a late writer L (a device of set ``vm-<tag>``) is open with a
    position below a committed one and an id at or above the snapshot's xmax; yield L
    (still open) and its transaction id. The caller commits L."""
    for attempt in range(TRIES):
        early = psycopg.connect(_dsn())
        between = psycopg.connect(_dsn())
        late = psycopg.connect(_dsn())
        try:
            _insert_node(early, f"early-{tag}-{attempt}-a")  # E's id is taken first
            # An id between E's and L's, still open: L's is then above the read's xmax,
            # not just equal to it (xmax itself is kept in the horizon).
            between.execute("SELECT pg_current_xact_id()")
            _insert_device_like_g0(late, f"gpu-{tag}", f"vm-{tag}")  # L: a newer id, a lower position
            row = late.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
            assert row is not None
            late_xid = int(row[0])
            _insert_node(early, f"early-{tag}-{attempt}-b")  # a higher position, committed first
            early.commit()
            read()
            if _xmax_now() < late_xid:
                # Nothing newer than L completed before the read (xmax only grows): the
                # read's snapshot left L out of its in-progress list.
                yield late, late_xid
                return
        except BaseException:
            late.rollback()
            raise
        finally:
            early.close()
            between.close()
        late.rollback()
        late.close()
    pytest.fail(f"other sessions on the server completed a transaction inside the window {TRIES} times")


def _late_positions(tag: str) -> tuple[int, int]:
    late = models.Change.objects.get(kind="GPU", name=f"gpu-{tag}").position
    early = models.Change.objects.filter(kind="Node", name__startswith=f"early-{tag}-").order_by("-position")[0]
    return late, early.position


def _same_as_scratch(model: ReadModel) -> None:
    """The model, brought current (a Bound VMI's admission writes its stamp after the model's
    follow), equals one read from scratch."""
    model.current()
    scratch = ReadModel("scratch")
    scratch.rebuild("test")
    assert compare_records(model, scratch) == []


def test_a_late_commit_above_the_snapshots_xmax_is_read_by_the_next_follow(client: Client, model: ReadModel) -> None:
    with late_commit_window(model.current, "a") as (late, _):
        late.commit()
        late.close()
    position, higher = _late_positions("a")
    assert position < higher <= model.position  # the gap: L's entry sits below what the model read
    body = review(new_vmi("t1", "vm-a", ["gpu-a"]))
    patched = allowed_patch(post(client, body), body)  # not "device ... does not exist in namespace t1"
    assert patched["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n1"
    assert model.counters.rebuilds == 1  # followed, not read again
    _same_as_scratch(model)


def test_a_pass_does_not_prune_a_late_commit_a_reader_has_not_read(model: ReadModel) -> None:
    """The binder's pruning keeps what a reader's last read may still have to read: here
    the model reads in the window and records its place, L commits, a full pass (which
    read L) prunes below the model's position; the model's next follow still finds L."""
    worker = ClusterState()
    run_pass(models.PassKind.FULL, worker)

    with late_commit_window(model.current, "b") as (late, _):
        model._record_reader()  # its place, from that read (a write: after the window's check)
        late.commit()
        late.close()
    position, _ = _late_positions("b")
    assert position < model.position
    run_pass(models.PassKind.FULL, worker)  # its prune: below the model's recorded position
    assert worker.pruned > position
    model.current()
    assert any(d.name == "gpu-b" for d in model.records["GPU"].values())
    assert model.counters.rebuilds == 1
    _same_as_scratch(model)


def test_the_binders_state_reads_a_late_commit_above_the_snapshots_xmax(model: ReadModel) -> None:
    """The same reader in the binder's state (one module for both)."""
    worker = ClusterState()
    run_pass(models.PassKind.FULL, worker)
    with late_commit_window(worker.follow, "c") as (late, _):
        late.commit()
        late.close()
    catch = worker.follow()
    assert catch.view == "incremental"
    assert any(d.name == "gpu-c" for d in worker.records["GPU"].values())

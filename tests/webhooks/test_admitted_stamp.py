"""The webhook's end of "admission and moves exclude each other" (SPEC §4), standalone.

Before allowing a VMI naming a Bound set the webhook writes ``admitted`` on the set's first
member, conditioned on the set still being Bound where it decided (``binder.runtime.admissions``);
a pass moving the set locks that row and compares it with the record it decided from. Whichever
lands second fails:

- the stamp first: the pass finds the first member changed and leaves the set where it is;
- the move first: the stamp matches no row, and the call reads again and pins the set's new
  node; on PostgreSQL a stamp arriving while the pass holds the row waits for its commit, then
  fails the same way (two connections).

And what the stamp costs the read model: a stamp-only change keeps the namespace's slice and
the webhook's view of it (its device index is built once, not per call), while a real move
reaches the next decision.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from binder import models
from binder.engine import Device, PassResult, Phase
from binder.mirror.snapshot import load_objects
from binder.runtime import admissions, readmodel
from binder.runtime.readmodel import ReadModel
from binder.runtime.state import ClusterState
from binder.runtime.verify import compare_records
from harness.factories import new_vmi, review
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj
from harness.webhook_calls import allowed_patch, post
from webhooks import binding

HOSTNAME = "kubernetes.io/hostname"


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadModel]:
    """A read model of this test's own, as the web process's."""
    fresh = ReadModel("test-admitted")
    monkeypatch.setattr(readmodel, "MODEL", fresh)
    yield fresh


def _bound_on(node: str) -> None:
    """t1/vm1: g0 and g1, Bound on ``node``; n1 and n2 have room for it."""
    load_objects(
        [
            namespace_obj("t1"),
            class_obj("h100", H100),
            node_obj("n1", {H100: 4}),
            node_obj("n2", {H100: 4}),
            gpu_obj("t1", "g0", "h100", "vm1", phase="Bound", node=node),
            gpu_obj("t1", "g1", "h100", "vm1", phase="Bound", node=node),
        ]
    )


def _pinned(client: Client) -> str:
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    return str(allowed_patch(post(client, body), body)["spec"]["nodeSelector"][HOSTNAME])


def _admitted(name: str = "g0") -> Any:
    return models.GpuDevice.objects.get(namespace__name="t1", name=name).admitted


def _move_to(node: str) -> None:
    """What a pass writes when it moves the set (the first member first)."""
    models.GpuDevice.objects.filter(namespace__name="t1", vm_name="vm1").update(node=node, since=timezone.now())


def _first_member(state: ClusterState) -> Device:
    return state.set_members(("t1", "vm1"))[0]


def _move_decided(state: ClusterState, node: str) -> PassResult:
    """A pass's decision to move t1/vm1 to ``node``."""
    now = timezone.now()
    moved = tuple(d.placed(d.class_name, Phase.BOUND, node, now, "moved") for d in state.set_members(("t1", "vm1")))
    return PassResult(devices=moved, changes=(), counts={})


# -- the webhook's stamp and the read model ----------------------------------------------------------


def test_a_change_of_the_stamp_alone_is_the_only_one_a_slice_does_not_see() -> None:
    now = timezone.now()
    first = Device("t1", "g0", "h100", "vm1", phase=Phase.BOUND, node="n1", admitted=now, keep_node=True)
    restamped = dataclasses.replace(first, admitted=now + timedelta(seconds=1))
    assert readmodel.stamp_only(first, restamped)
    assert readmodel.stamp_only(first, dataclasses.replace(first, admitted=None))
    assert readmodel.unstamped(first) == dataclasses.replace(first, admitted=None)
    assert readmodel.unstamped(readmodel.unstamped(first)) == readmodel.unstamped(first)
    changes: list[dict[str, Any]] = [
        {"namespace": "t2"}, {"node": "n2"}, {"phase": Phase.LOST}, {"vm_name": "vm2"},
        {"reclaim_for": "t2/vm9"}, {"borrowed": True}, {"keep_node": False}, {"answer": "bound:n2"},
    ]  # fmt: skip
    for change in changes:
        assert not readmodel.stamp_only(first, dataclasses.replace(restamped, **change)), change
    assert not readmodel.stamp_only(first, first)
    assert not readmodel.stamp_only(None, first) and not readmodel.stamp_only(first, None)



@pytest.mark.django_db(transaction=True)
def test_a_stamp_only_change_keeps_the_slice_and_the_view_and_a_real_move_reaches_the_next_call(
    client: Client, model: ReadModel
) -> None:
    _bound_on("n2")
    assert _pinned(client) == "n2"
    stamped = _admitted()
    assert stamped is not None
    part = model.slice("t1")
    view = binding.mirror_view("t1")
    index = view.index()
    # Another Bound admission: its follow reads the first call's stamp, its own stamp is the
    # next follow's. Neither changes what the slice holds, so neither rebuilds it or the index.
    assert _pinned(client) == "n2"
    model.current()
    assert _admitted() > stamped
    assert model.slice("t1") is part
    assert binding.mirror_view("t1") is view and view.index() is index
    # The slice holds devices without the stamp; the model's records hold it as stored.
    assert all(d.admitted is None for d in part.devices)
    scratch = ReadModel("scratch")
    scratch.rebuild("test")
    assert compare_records(model, scratch) == []
    first = model.records["GPU"][model.device_ids[("t1", "g0")]]
    assert first.admitted == _admitted()
    # A real move is a change of the slice: the next call decides from the new node.
    _move_to("n1")
    assert _pinned(client) == "n1"
    assert model.slice("t1") is not part
    assert model.counters.rebuilds == 1  # everything above was followed, not read again


# -- whichever lands second fails ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_move_that_lands_before_the_stamp_makes_the_call_read_again_and_pin_the_new_node(
    client: Client, model: ReadModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass moves the set between the call's decision (n2) and its stamp: the stamp,
    conditioned on n2, writes nothing, and the call reads again and pins n1."""
    _bound_on("n2")
    real_admit = admissions.admit
    tries: list[tuple[str, bool]] = []

    def moved_meanwhile(decided: Device, now: Any = None) -> bool:
        if not tries:
            _move_to("n1")
        landed = real_admit(decided, now)
        tries.append((decided.node, landed))
        return landed

    monkeypatch.setattr(admissions, "admit", moved_meanwhile)
    assert _pinned(client) == "n1"
    assert tries == [("n2", False), ("n1", True)]
    assert _admitted() is not None


@pytest.mark.django_db(transaction=True)
def test_a_stamp_that_lands_before_the_pass_locks_the_first_member_keeps_the_set_where_it_is(
    model: ReadModel,
) -> None:
    """The pass decided to move the set from the records it caught up to; the webhook's stamp
    committed after that: the pass's lock finds the first member changed and drops the move."""
    _bound_on("n2")
    state = ClusterState()
    state.follow()
    result = _move_decided(state, "n1")
    assert admissions.admit(_first_member(state))
    with transaction.atomic():
        kept, dropped = admissions.hold_first_members(result, state)
    assert kept.devices == () and dropped == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_stamp_waiting_for_the_pass_that_moves_the_set_fails_once_the_move_commits(
    client: Client, model: ReadModel
) -> None:
    """Two connections: the pass holds its first member's row (locked, compared: unchanged) and
    writes the move; the webhook's stamp, sent meanwhile, waits for that lock and then matches
    no row. The next call pins the new node."""
    if connection.vendor != "postgresql":
        pytest.skip("two writers at once need PostgreSQL")
    _bound_on("n2")
    state = ClusterState()
    state.follow()
    decided = _first_member(state)
    outcome: dict[str, bool] = {}

    def stamp() -> None:
        try:
            outcome["landed"] = admissions.admit(decided)
        finally:
            connection.close()

    webhook = threading.Thread(target=stamp)
    with transaction.atomic():
        kept, dropped = admissions.hold_first_members(_move_decided(state, "n1"), state)
        assert len(kept.devices) == 2 and dropped == 0
        webhook.start()
        _wait_for_a_lock_wait()
        _move_to("n1")
    webhook.join(10)
    assert outcome == {"landed": False}
    assert _admitted() is None
    assert _pinned(client) == "n1"
    assert _admitted() is not None


def _wait_for_a_lock_wait(timeout: float = 10.0) -> None:
    """Until another backend's stamp waits for a row lock."""
    db = connection.settings_dict
    dsn = f"host={db['HOST']} port={db['PORT'] or 5432} user={db['USER']} dbname={db['NAME']}"
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as probe:
        while time.monotonic() < deadline:
            row = probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND query LIKE %s",
                ["%SET admitted%"],
            ).fetchone()
            if row is not None and row[0]:
                return
            time.sleep(0.02)
    raise AssertionError("the webhook's stamp never waited for the pass's row lock")


# -- how the stamp commits (PostgreSQL) ---------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_stamp_skips_the_wal_flush_for_its_own_commit_only(model: ReadModel) -> None:
    """Outside a transaction the stamp's statement turns off ``synchronous_commit`` for the
    commit that ends it, and the connection's later writes (bind requests) wait for the flush
    as before; inside a caller's transaction it leaves the setting alone."""
    if connection.vendor != "postgresql":
        pytest.skip("synchronous_commit is PostgreSQL's")
    _bound_on("n2")
    state = ClusterState()
    state.follow()
    decided = _first_member(state)

    def setting() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            row = cursor.fetchone()
        assert row is not None
        return str(row[0])

    before = setting()
    assert admissions.admit(decided)
    assert setting() == before
    with transaction.atomic():
        assert admissions.admit(decided)
        assert setting() == before

"""The web processes' read model of the mirror (``binder.runtime.readmodel``).

- Property-based: after any sequence of mirror changes (inserts, updates, deletes of
  every kind, admission stamps, a namespace renamed, the feed reset, and on PostgreSQL late
  commits from a second connection), the model brought current equals a read from scratch,
  record for record and namespace slice for namespace slice (a slice kept across a stamp
  included).
- Freshness per call: a device bound, unbound or deleted on another connection just
  before a webhook call is seen by that call (PostgreSQL, two connections).
- Single flight: a call waits for a follow that began after it arrived.
- ``/readyz`` is 503 until the model is built, 200 after; ``/healthz`` is always 200.
- Verification: a model that drifted is found out, counted and replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from prometheus_client import generate_latest

from binder import models
from binder.engine import Ledger, ledger_for
from binder.metrics import REGISTRY
from binder.mirror.snapshot import load_objects
from binder.runtime import readmodel
from binder.runtime.readmodel import ReadModel
from binder.runtime.verify import compare_records
from harness.factories import new_vmi, review
from harness.shapes import H100, budget_obj, class_obj, gpu_obj, namespace_obj, node_obj, plain_pod_obj, vmi_obj
from harness.webhook_calls import allowed_patch, answer_of, post

NAMESPACES = ("t0", "t1")
NODES = ("n0", "n1", "n2")
DEVICES = ("g0", "g1", "g2", "g3")
VMS = ("vm0", "vm1")


def _dsn() -> str:
    db = connection.settings_dict
    return f"host={db['HOST']} port={db['PORT'] or 5432} user={db['USER']} dbname={db['NAME']}"


def _postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("two connections on one database need PostgreSQL (make test-postgres)")


def _same_as_scratch(model: ReadModel) -> None:
    scratch = ReadModel("scratch")
    scratch.rebuild("test")
    assert compare_records(model, scratch) == []
    for namespace in set(scratch.namespaces.values()) | set(NAMESPACES):
        mine, theirs = model.slice(namespace), scratch.slice(namespace)
        assert mine.devices == theirs.devices
        assert sorted(map(repr, mine.pods)) == sorted(map(repr, theirs.pods))
        assert sorted(map(repr, mine.vmis)) == sorted(map(repr, theirs.vmis))
        assert sorted(map(repr, mine.budgets)) == sorted(map(repr, theirs.budgets))
        assert mine.nodes == theirs.nodes and mine.classes == theirs.classes


class MirrorChanges(RuleBasedStateMachine):
    """Random mirror writes through the paths the product uses (the snapshot loader, ORM
    updates and deletes), the model following at random moments."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ReadModel("property")
        self.late: psycopg.Connection[Any] | None = None
        self.postgres = connection.vendor == "postgresql"

    @initialize()
    def start(self) -> None:
        load_objects([namespace_obj(n) for n in NAMESPACES] + [class_obj("h100", H100), node_obj("n0", {H100: 4})])
        self.model.current()

    @rule(ns=st.sampled_from(NAMESPACES), name=st.sampled_from(DEVICES), vm=st.sampled_from(VMS),
          bound=st.sampled_from(["", *NODES]))  # fmt: skip
    def put_device(self, ns: str, name: str, vm: str, bound: str) -> None:
        phase = "Bound" if bound else "Pending"
        load_objects([gpu_obj(ns, name, "h100", vm, phase=phase, node=bound)])

    @rule(name=st.sampled_from(DEVICES))
    def delete_device(self, name: str) -> None:
        models.GpuDevice.objects.filter(name=name).delete()

    @rule(name=st.sampled_from(DEVICES), node=st.sampled_from(NODES))
    def move_device(self, name: str, node: str) -> None:
        models.GpuDevice.objects.filter(name=name).update(phase="Bound", node=node)

    @rule(name=st.sampled_from(DEVICES))
    def stamp_device(self, name: str) -> None:
        """The webhook's admission stamp: a change of the records that changes no slice."""
        models.GpuDevice.objects.filter(name=name).update(admitted=timezone.now())

    @rule(name=st.sampled_from(NODES), units=st.integers(0, 8), label=st.sampled_from(["a", "b"]))
    def put_node(self, name: str, units: int, label: str) -> None:
        load_objects([node_obj(name, {H100: units}, labels={"pool": label})])

    @rule(name=st.sampled_from(NODES))
    def delete_node(self, name: str) -> None:
        models.Node.objects.filter(name=name).delete()

    @rule(ns=st.sampled_from(NAMESPACES), limit=st.integers(0, 8))
    def put_budget(self, ns: str, limit: int) -> None:
        load_objects([budget_obj(ns, {"h100": limit})])

    @rule(ns=st.sampled_from(NAMESPACES))
    def delete_budget(self, ns: str) -> None:
        models.GpuBudget.objects.filter(namespace__name=ns).delete()

    @rule(ns=st.sampled_from(NAMESPACES), vm=st.sampled_from(VMS), node=st.sampled_from(NODES))
    def put_vmi_and_pod(self, ns: str, vm: str, node: str) -> None:
        load_objects([vmi_obj(ns, vm, ["g0"], {}, node), plain_pod_obj(ns, f"raw-{vm}", H100, 1, node)])

    @rule(vm=st.sampled_from(VMS))
    def delete_vmi_and_pod(self, vm: str) -> None:
        models.VirtualMachineInstance.objects.filter(name=vm).delete()
        models.Pod.objects.filter(name=f"raw-{vm}").delete()

    @rule(units=st.integers(1, 2))
    def change_class(self, units: int) -> None:
        models.GpuClass.objects.filter(name="h100").update(units_per_device=units)

    @rule(ns=st.sampled_from(NAMESPACES))
    def rename_namespace_and_back(self, ns: str) -> None:
        models.Namespace.objects.filter(name=ns).update(name=f"{ns}-renamed")
        self.model.current()  # the rename must be seen (its rows' keys all change)
        models.Namespace.objects.filter(name=f"{ns}-renamed").update(name=ns)

    @rule()
    def reset_feed(self) -> None:
        """The feed emptied (a reset, or pruned past the model): the next follow rebuilds."""
        models.Change.objects.all().delete()

    @rule(name=st.sampled_from(("late-a", "late-b")))
    def begin_late_write(self, name: str) -> None:
        """Another connection takes a feed position and holds its commit."""
        if not self.postgres or self.late is not None:
            return
        self.late = psycopg.connect(_dsn())
        self.late.execute(
            "INSERT INTO binder_node (name, uid, labels, allocatable, unschedulable, taints, ready, ready_since,"
            " created, parse_error) VALUES (%s, '', '{}', '{}', false, '[]', true, NULL, NULL, '')"
            " ON CONFLICT (name) DO UPDATE SET unschedulable = NOT binder_node.unschedulable",
            [name],
        )

    @rule()
    def commit_late_write(self) -> None:
        if self.late is not None:
            self.late.commit()
            self.late.close()
            self.late = None

    @rule()
    def follow(self) -> None:
        self.model.current()

    @rule()
    def take_a_snapshot(self) -> None:
        """A page's snapshot: the model keeps the ledger it builds, then keeps it current."""
        self.model.snapshot(timezone.now())

    @invariant()
    def current_equals_scratch(self) -> None:
        if self.late is not None:
            return  # the scratch read would not see the uncommitted row either; checked after the commit
        self.model.current()
        _same_as_scratch(self.model)
        taken = self.model.snapshot(timezone.now())
        assert _ledger_facts(taken.ledger) == _ledger_facts(ledger_for(taken.cluster))

    def teardown(self) -> None:
        if self.late is not None:
            self.late.rollback()
            self.late.close()
        for model in (models.GpuDevice, models.Pod, models.VirtualMachineInstance, models.GpuBudget):
            model.objects.all().delete()
        models.Node.objects.all().delete()
        models.GpuClass.objects.all().delete()
        models.Namespace.objects.all().delete()
        models.FeedReader.objects.all().delete()


@pytest.mark.django_db(transaction=True)
def test_the_read_model_equals_a_read_from_scratch_after_any_changes() -> None:
    run_state_machine_as_test(
        MirrorChanges,
        settings=settings(
            max_examples=15,
            stateful_step_count=20,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# -- freshness per call (two connections) ------------------------------------------------------


@pytest.fixture
def fresh_model(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadModel]:
    model = ReadModel("test")
    monkeypatch.setattr(readmodel, "MODEL", model)
    yield model


def _vm1_bound(node: str = "n1") -> None:
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


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_device_changed_on_another_connection_just_before_a_call_is_seen_by_it(
    client: Client, fresh_model: ReadModel
) -> None:
    _postgres()
    _vm1_bound("n1")
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    assert allowed_patch(post(client, body), body)["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n1"
    assert fresh_model.built.is_set()
    with psycopg.connect(_dsn(), autocommit=True) as other:
        # Bound elsewhere (a pass moved the set) a moment before the call.
        other.execute("UPDATE binder_gpudevice SET node = 'n2' WHERE name IN ('g0', 'g1')")
        body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
        assert allowed_patch(post(client, body), body)["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n2"
        # Unbound: not placed any more, so the call asks the binder (which binds it again).
        other.execute("UPDATE binder_gpudevice SET phase = 'Pending', node = '' WHERE name IN ('g0', 'g1')")
        body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
        answer_of(post(client, body), body)
        assert models.GpuDevice.objects.filter(name="g0").exclude(bind_request="").exists()
        # Deleted: the call names a device that does not exist any more.
        other.execute("DELETE FROM binder_gpudevice WHERE name = 'g1'")
        body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
        answer = answer_of(post(client, body), body)
        assert answer["allowed"] is False
        assert "device gpuplane.io/g1 does not exist in namespace t1" in answer["status"]["message"]
    assert fresh_model.counters.rebuilds == 1  # every change above was followed, not re-read


@pytest.mark.django_db
def test_a_device_bound_just_before_a_call_is_seen_by_it(client: Client, fresh_model: ReadModel) -> None:
    """The same on one connection (SQLite too): the call's follow reads the change."""
    _vm1_bound("n1")
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    assert allowed_patch(post(client, body), body)["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n1"
    models.GpuDevice.objects.filter(name__in=["g0", "g1"]).update(node="n2")
    body = review(new_vmi("t1", "vm1", ["g0", "g1"]))
    assert allowed_patch(post(client, body), body)["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n2"


def test_a_call_waits_for_a_follow_that_began_after_it_arrived(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call arriving while a follow runs does not take that follow's result as its own;
    calls arriving together share the next one."""
    model = ReadModel("single-flight")
    follows: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def follow_now(self: ReadModel) -> None:
        follows.append(threading.current_thread().name)
        if len(follows) == 1:
            inside.set()
            release.wait(5)

    monkeypatch.setattr(ReadModel, "_follow_now", follow_now)
    first = threading.Thread(target=model.current, name="first")
    first.start()
    assert inside.wait(5)
    # These arrive while "first"'s follow runs: none may return before a follow that
    # began after it arrived, and they share one.
    done = [threading.Event() for _ in range(5)]

    def call(i: int) -> None:
        model.current()
        done[i].set()

    later = [threading.Thread(target=call, args=(i,), name=f"later-{i}") for i in range(5)]
    for thread in later:
        thread.start()
    assert not any(event.wait(0.05) for event in done)
    release.set()
    for thread in [first, *later]:
        thread.join(5)
    assert all(event.is_set() for event in done)
    assert follows[0] == "first" and len(follows) == 2 and follows[1].startswith("later-")


# -- readiness -----------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("urlconf", ["gpuplane.urls", "gpuplane.webhook_urls"])
def test_readyz_is_503_until_the_model_is_built_then_200(
    client: Client, fresh_model: ReadModel, settings: Any, urlconf: str
) -> None:
    settings.ROOT_URLCONF = urlconf
    _vm1_bound()
    before = client.get("/readyz")
    assert before.status_code == 503 and before.json()["status"] == "building the read model"
    assert client.get("/healthz").status_code == 200  # liveness does not wait for it
    fresh_model.current()
    after = client.get("/readyz")
    assert after.status_code == 200
    assert after.json() == {"status": "ready", "devices": 2, "nodes": 2}


@pytest.mark.django_db
def test_the_model_registers_as_a_feed_reader_so_pruning_keeps_its_entries(fresh_model: ReadModel) -> None:
    _vm1_bound()
    fresh_model.current()
    row = models.FeedReader.objects.get(worker=fresh_model.worker)
    assert row.position == fresh_model.position


@pytest.mark.django_db
def test_a_failed_follow_drops_the_model_and_the_next_call_rebuilds(
    fresh_model: ReadModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    _vm1_bound()
    fresh_model.current()
    models.GpuDevice.objects.filter(name="g0").update(node="n2")

    def broken(*args: Any) -> Any:
        raise RuntimeError("connection lost")

    monkeypatch.setattr("binder.runtime.mirror_state.MirrorState._apply", broken)
    with pytest.raises(RuntimeError):
        fresh_model.current()
    assert not fresh_model.valid
    monkeypatch.undo()
    fresh_model.current()
    assert fresh_model.counters.rebuilds == 2
    _same_as_scratch(fresh_model)


@pytest.mark.django_db
def test_verification_finds_a_drifted_model_counts_it_and_continues_from_a_fresh_read(
    fresh_model: ReadModel, caplog: pytest.LogCaptureFixture
) -> None:
    _vm1_bound()
    fresh_model.current()
    assert fresh_model.verify() == []
    # Drift the model behind the feed's back (what a bug would do).
    (object_id,) = [i for i, d in fresh_model.records["GPU"].items() if d.name == "g0"]
    fresh_model.records["GPU"][object_id] = dataclasses.replace(fresh_model.records["GPU"][object_id], node="n9")
    with caplog.at_level(logging.ERROR, logger="binder.runtime.readmodel"):
        problems = fresh_model.verify()
    assert len(problems) == 1 and "g0" in problems[0]
    assert fresh_model.counters.mismatches == 1 and fresh_model.counters.verifications == 2
    assert "read model verification" in caplog.text
    _same_as_scratch(fresh_model)
    text = generate_latest(REGISTRY).decode()
    assert 'gpuplane_readmodel_verify_mismatches_total{process="test"} 1.0' in text


def _ledger_facts(ledger: Ledger) -> tuple[Any, ...]:
    return (
        {n: {k: v for k, v in c.items() if v} for n, c in ledger.booked.items() if any(c.values())},
        {n: {k: v for k, v in c.items() if v} for n, c in ledger.used.items() if any(c.values())},
        {r: {f: list(ns) for f, ns in b.items() if ns} for r, b in ledger.by_free.items() if any(b.values())},
        {n: set(s) for n, s in ledger.sets_on.items() if s},
        {k: repr(v) for k, v in ledger.holdings().items()},
    )


@pytest.mark.django_db
def test_a_snapshot_has_a_ledger_of_its_own_equal_to_one_built_from_it(fresh_model: ReadModel) -> None:
    """The board and the catalog read a copy of the model's ledger: the same numbers as a
    ledger built from the snapshot, and unmoved by later follows."""
    _vm1_bound("n1")
    load_objects([plain_pod_obj("t1", "raw", H100, 1, "n2")])
    fresh_model.current()
    first = fresh_model.snapshot(timezone.now())  # builds the ledger (the model had none)
    assert _ledger_facts(first.ledger) == _ledger_facts(ledger_for(first.cluster))
    second = fresh_model.snapshot(timezone.now())  # a copy of the model's own
    assert _ledger_facts(second.ledger) == _ledger_facts(first.ledger)
    before = _ledger_facts(second.ledger)
    models.GpuDevice.objects.filter(name__in=["g0", "g1"]).update(node="n2")
    fresh_model.current()
    assert _ledger_facts(second.ledger) == before  # a later follow moved only the model's
    third = fresh_model.snapshot(timezone.now())
    assert _ledger_facts(third.ledger) == _ledger_facts(ledger_for(third.cluster)) != before

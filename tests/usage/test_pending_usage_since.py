"""Usage records dated by when a device's holding changed, not by when a full pass ran.

An answer pass binds a set seconds before the full pass that writes its usage record
(binder.tasks delays that full pass on purpose), so a record opens at the device's
``since`` and the record it replaces closes at that same instant. The engine's rules are
tested with plain objects, the whole path once with real passes on the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import pytest
from hypothesis import example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from binder import models
from binder.engine import types as e
from binder.engine.usage import (
    HOLDING_ORDER,
    OpenRecord,
    UsageHolding,
    UsagePlan,
    change_time,
    holdings,
    reconcile_usage,
)
from binder.mirror.snapshot import load_objects
from binder.runtime.passes import run_pass
from binder.runtime.usage_records import write_plan
from harness.clock import Clock
from harness.shapes import A10, H100, NOW, class_obj, gpu_class, gpu_obj, namespace_obj, node_obj
from usage.models import UsageRecord

T0 = NOW
CLASSES = {"h100": gpu_class("h100", H100), "a10": gpu_class("a10", A10, units=2)}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def device(name: str, phase: e.Phase, node: str, since: datetime, class_name: str = "h100") -> e.Device:
    return e.Device("t1", name, class_name, "vm1", phase, node if phase is e.Phase.BOUND else "", since)


def held(*devices: e.Device) -> tuple[UsageHolding, ...]:
    return holdings(devices, (), CLASSES, lambda ns, name: None)


def opened(holdings_: tuple[UsageHolding, ...], start: datetime) -> list[OpenRecord]:
    return [OpenRecord(i + 1, h, start) for i, h in enumerate(holdings_)]


# -- the engine, with plain objects -----------------------------------------------------------


def test_since_is_not_part_of_a_holdings_identity() -> None:
    """A record opened at the pass's time (before this rule) still stands for the same holding."""
    (a,) = held(device("g0", e.Phase.BOUND, "n1", at(5)))
    b = replace(a, since=at(99))
    assert a == b and hash(a) == hash(b) and HOLDING_ORDER(a) == HOLDING_ORDER(b)
    assert not reconcile_usage([OpenRecord(1, a, at(1))], [b], at(100), recorded_until=at(0))


def test_a_move_closes_and_opens_at_the_devices_since() -> None:
    before = held(device("g0", e.Phase.BOUND, "n1", at(1)))
    after = held(device("g0", e.Phase.BOUND, "n2", at(12)))  # an answer pass moved it at 12 s
    plan = reconcile_usage(opened(before, at(1)), after, at(15), recorded_until=at(10))
    assert plan.close == (1,) and plan.ends == (at(12),)
    assert [(h.node, h.since) for h in plan.open] == [("n2", at(12))]


def test_a_new_binding_opens_at_its_since() -> None:
    plan = reconcile_usage([], held(device("g0", e.Phase.BOUND, "n1", at(12))), at(15), recorded_until=at(10))
    assert [h.since for h in plan.open] == [at(12)]


def test_a_released_device_closes_at_its_since_a_deleted_one_at_the_pass() -> None:
    records = opened(held(device("g0", e.Phase.BOUND, "n1", at(1)), device("g1", e.Phase.BOUND, "n1", at(1))), at(1))
    # g0 is back to Pending since 12 s; g1 is gone (no time known for that).
    plan = reconcile_usage(records, [], at(15), recorded_until=at(10), device_since={("t1", "g0"): at(12)})
    assert plan.close == (1, 2) and plan.ends == (at(12), at(15))


@pytest.mark.parametrize(
    ("since", "why"),
    [
        (at(5), "older than the last pass that wrote records: not set by a pass since"),
        (at(20), "after the pass's own time (another process's clock)"),
        (None, "unknown"),
    ],
)
def test_an_untrusted_since_dates_nothing(since: datetime | None, why: str) -> None:
    before = held(device("g0", e.Phase.BOUND, "n1", at(1)))
    (moved,) = held(device("g0", e.Phase.BOUND, "n2", at(1)))
    plan = reconcile_usage(opened(before, at(1)), [replace(moved, since=since)], at(15), recorded_until=at(10))
    assert plan.ends == (at(15),), why
    assert [h.since for h in plan.open] == [at(15)], why


def test_units_changed_under_a_standing_device_change_at_the_pass() -> None:
    """A class edited to 2 units per device: phase and node stand, so ``since`` is as old
    as the open record and says nothing about when the units changed."""
    (before,) = held(device("g0", e.Phase.BOUND, "n1", at(12)))
    (after,) = held(device("g0", e.Phase.BOUND, "n1", at(12), class_name="a10"))
    plan = reconcile_usage([OpenRecord(1, before, at(12))], [after], at(30), recorded_until=at(10))
    assert plan.ends == (at(30),) and [h.since for h in plan.open] == [at(30)]


@pytest.mark.parametrize("bound_at", [at(10), at(12)], ids=["by the last full pass", "by an answer pass since"])
def test_a_device_bound_back_where_its_record_stands_dates_no_later_change(bound_at: datetime) -> None:
    """A device deleted and created again under the same name, then bound back to the node
    its record (open since 1 s) names: the holding is the same, so the record stays open,
    but ``since`` is now the binding, younger than the record. Its class edited to 2 units
    per device afterwards is no change of placement: it changes at the pass (30 s), not
    back at the binding, which would bill the new units for the time the old ones were held."""
    (before,) = held(device("g0", e.Phase.BOUND, "n1", at(1)))
    (after,) = held(device("g0", e.Phase.BOUND, "n1", bound_at, class_name="a10"))
    plan = reconcile_usage([OpenRecord(1, before, at(1))], [after], at(30), recorded_until=at(10))
    assert plan.ends == (at(30),) and [h.since for h in plan.open] == [at(30)]
    # Bound back to another node instead, it is a move: dated at the binding.
    (moved,) = held(device("g0", e.Phase.BOUND, "n2", bound_at, class_name="a10"))
    plan = reconcile_usage([OpenRecord(1, before, at(1))], [moved], at(30), recorded_until=at(10))
    assert plan.ends == (bound_at,) and [h.since for h in plan.open] == [bound_at]


def test_without_a_previous_pass_or_without_now_nothing_is_dated() -> None:
    """The first full pass (a snapshot's devices keep the times they were loaded with) opens at
    its own time; without ``now`` the caller dates everything (the plan carries no times)."""
    current = held(device("g0", e.Phase.BOUND, "n1", at(12)))
    assert [h.since for h in reconcile_usage([], current, at(15)).open] == [at(15)]
    plan = reconcile_usage(opened(held(device("g0", e.Phase.BOUND, "n0", at(1))), at(1)), current)
    assert plan.close == (1,) and plan.ends == () and [h.since for h in plan.open] == [None]


def test_a_record_never_ends_before_it_began() -> None:
    assert change_time(at(12), [at(14)], at(13), at(10)) == at(14)  # a start after the pass's now
    assert change_time(at(12), [None], at(15), at(10)) == at(15)  # a start not known


# -- property: a subject's records follow one another without gap or overlap ------------------


@dataclass
class Record:
    id: int
    holding: UsageHolding
    start: datetime
    end: datetime | None = None


@dataclass
class World:
    """Devices changed by answer passes (which set ``since``) and records written by full passes."""

    devices: dict[str, e.Device] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    now: datetime = T0
    last_full: datetime | None = None
    changed_at: dict[str, datetime] = field(default_factory=dict)

    def full_pass(self) -> UsagePlan:
        current = held(*self.devices.values())
        open_ = [OpenRecord(r.id, r.holding, r.start) for r in self.records if r.end is None]
        since = {d.key: d.since for d in self.devices.values()}
        plan = reconcile_usage(open_, current, self.now, recorded_until=self.last_full, device_since=since)
        for record_id, end in zip(plan.close, plan.ends, strict=True):
            assert end is not None
            self.records[record_id - 1].end = end
        for holding in plan.open:
            assert holding.since is not None
            self.records.append(Record(len(self.records) + 1, replace(holding, since=None), holding.since))
        self.last_full = self.now
        return plan


STEP = st.one_of(
    st.tuples(st.just("wait"), st.integers(min_value=1, max_value=30)),
    st.tuples(st.just("full"), st.none()),
    st.tuples(
        st.just("change"),
        st.tuples(
            st.sampled_from(["g0", "g1"]),
            st.sampled_from(["Pending", "Bound:n1", "Bound:n2", "Lost", "gone", "class:a10", "class:h100"]),
        ),
    ),
)


@hypothesis_settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=40))
@example(
    [
        ("change", ("g0", "Bound:n1")),
        ("full", None),
        ("wait", 5),
        ("change", ("g0", "gone")),
        ("change", ("g0", "Bound:n1")),  # bound back where its record stands: the record stays
        ("wait", 5),
        ("change", ("g0", "class:a10")),
        ("wait", 5),
    ]
)
def test_records_are_continuous_per_subject_and_start_when_the_holding_began(steps: list[tuple[str, object]]) -> None:
    world = World()
    for kind, arg in steps:
        if kind == "wait":
            assert isinstance(arg, int)
            world.now += timedelta(seconds=arg)
        elif kind == "change":
            assert isinstance(arg, tuple)
            name, what = arg
            old = world.devices.get(name, device(name, e.Phase.PENDING, "", world.now))
            if what == "gone":
                world.devices.pop(name, None)
                world.changed_at.pop(name, None)
                continue
            if what.startswith("class:"):
                # The held class changes while phase and node stand: ``since`` stays.
                world.devices[name] = replace(old, class_name=what.removeprefix("class:"))
                continue
            phase, _, node = what.partition(":")
            new = device(name, e.Phase(phase), node, world.now, old.class_name)
            if (new.phase, new.node) == (old.phase, old.node) and name in world.devices:
                new = replace(new, since=old.since)  # no phase or node change: since stands
            elif new.held:
                world.changed_at[name] = world.now
            world.devices[name] = new
        else:
            full_pass_and_check(world)
    full_pass_and_check(world)


def full_pass_and_check(world: World) -> None:
    previous, first_new = world.last_full, len(world.records) + 1
    plan = world.full_pass()
    current = held(*world.devices.values())
    assert sorted((r.holding for r in world.records if r.end is None), key=HOLDING_ORDER) == sorted(
        current, key=HOLDING_ORDER
    )
    by_subject: dict[str, list[Record]] = {}
    for record in world.records:
        assert record.start <= world.now  # never in the future
        assert record.end is None or record.start <= record.end <= world.now
        by_subject.setdefault(record.holding.subject, []).append(record)
    closed_here = set(plan.close)
    for name, history in by_subject.items():
        for before, after in zip(history, history[1:], strict=False):
            assert before.end is not None and before.end <= after.start  # one after another, never overlapping
            if before.id in closed_here and after.id >= first_new:
                assert before.end == after.start  # replaced by this pass: no gap either
        for record in history:
            if record.id < first_new:
                continue
            began = world.changed_at.get(name)
            replaced = [r for r in history if r.id in closed_here]
            assert record.start in (began, world.now)
            if any((r.holding.phase, r.holding.node) == (record.holding.phase, record.holding.node) for r in replaced):
                # Its record already had it there (a class edited under a standing device, or
                # one bound back after it was deleted and created again): what changed is its
                # class, at a time no ``since`` says.
                assert record.start == world.now
            elif (
                began is not None
                and previous is not None
                and previous <= began
                and all(r.start < began for r in replaced)
            ):
                # It became held (or moved) after the last full pass: billed from that moment.
                assert record.start == began


# -- the whole path, on the database ----------------------------------------------------------


@pytest.mark.django_db
def test_a_set_bound_by_an_answer_pass_is_billed_from_its_binding_not_the_full_pass(clock: Clock) -> None:
    load_objects([namespace_obj("t1"), class_obj("h100", H100), node_obj("n1", {H100: 8})])
    run_pass(models.PassKind.FULL)  # records are exact up to here: nothing held yet
    clock.advance(seconds=5)
    load_objects([gpu_obj("t1", "g0", "h100", "vm1", bind_request="req-1")])  # the webhook's bind request
    t0 = clock.now
    assert run_pass(models.PassKind.ANSWER).bound == 1
    assert models.GpuDevice.objects.get(name="g0").since == t0
    clock.advance(seconds=2)
    t1 = clock.now
    run = run_pass(models.PassKind.FULL)
    (record,) = UsageRecord.objects.all()
    assert (record.start, record.end, record.opened_by_pass) == (t0, None, run.pk)
    assert t1 > t0

    # Drained away by the next full pass: the next record begins where this one ends.
    clock.advance(seconds=30)
    node = models.Node.objects.get(name="n1")
    node.labels = {**node.labels, "gpuplane.io/drain": "true"}
    node.save()
    load_objects([node_obj("n2", {H100: 8})])
    t2 = clock.now
    run_pass(models.PassKind.FULL)
    first, second = UsageRecord.objects.order_by("id")
    assert (first.node, first.start, first.end) == ("n1", t0, t2)
    assert (second.node, second.start, second.end) == ("n2", t2, None)


@pytest.mark.django_db
def test_the_writer_closes_each_record_at_its_own_end_and_the_rest_at_the_pass(clock: Clock) -> None:
    fields = dict(namespace="t1", subject_kind="GPU", key="h100", resource_name=H100, units=1, phase="Bound")
    first = UsageRecord.objects.create(subject="g0", node="n1", start=at(1), **fields)
    second = UsageRecord.objects.create(subject="g1", node="n1", start=at(1), **fields)
    (lost,) = held(device("g0", e.Phase.LOST, "", at(12)))
    write_plan(UsagePlan(close=(first.pk, second.pk), open=(lost,), ends=(at(12), None)), 7, at(15))
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.end, second.end, first.closed_by_pass) == (at(12), at(15), 7)
    (opened_,) = UsageRecord.objects.filter(end__isnull=True)
    assert (opened_.subject, opened_.phase, opened_.start, opened_.opened_by_pass) == ("g0", "Lost", at(12), 7)

"""The pure state machine: stateful property tests of the engine's passes, usage records and webhook decisions.

Two hypothesis rule-based state machines change a cluster one step at a time (nodes come
and go, fail and recover, allocatable shrinks and grows, nodes are drained, cordoned and
relabelled; sets are ordered, grown and deleted, devices edited in place (class, VM) and,
in the database machine, whole namespaces deleted; budgets and classes change; VMIs are
admitted by the webhook, start, migrate and end; raw pods and pods with forged owner
references appear and finish; full passes, answer passes and full passes whose writes
partly fail interleave), with the clock moving on at every step. After every step:

- no node is over-booked by devices: strictly after a complete full pass, and no step
  other than a full pass grows the device units of a node that is over its allocatable
  (allocatable shrinks under held sets between passes; the next full pass moves them);
- every set is whole (its Bound and Lost members share one phase and one node), except
  between a change that splits it from outside the binder (a partly failed write, a
  device's vmName edited into another set) and the next complete full pass;
- no pass pushed a tenant over budget: for every tenant and every key, usage after a pass
  is within the limit, unless it was already over before the pass (limits shrink and raw
  or forged pods appear between passes), and then it did not grow;
- usage records: after each full pass the open records are exactly what is held (one per
  Bound or Lost device, one per pod and resource with raw usage, none for anything
  else), computed independently by the test from the devices, pods and VMIs with the one
  launcher rule; no step but a full pass changes any record; a closed record never changes
  again; an unchanged holding keeps its record (no close-and-reopen churn);
- GPU-hours from the records equal the integral of held units that the test keeps itself,
  per tenant and key, to the unit-second.

Why some invariants are stated "after a full pass": usage records are written by full passes
only (an answer pass writes none), so a device an answer pass
binds, or a device deleted between passes, gets or loses its open record at the next full
pass (an answer pass that places a set asks for one). The test therefore integrates the
units held *as the last full pass saw them*: that is what the records can know, and what
tenants are billed for. A simulated full pass whose status writes partly fail (cluster
mode: ``binder.runtime.cluster.write_status`` drops refused writes from the result) may leave sets
split and nodes over-booked; wholeness and the strict capacity check then wait for the
next complete full pass, which restores them. The GPU feature switch stays
on: with it off a pass places nothing, so a deleted class's devices stay Bound while their
records close, and "an open record while Bound or Lost" does not apply then.

(a) ``EngineMachine`` is pure: engine dataclasses (built from the real captures through
harness/shapes.py), ``binder.engine.placement``, ``binder.engine.usage`` and
``webhooks.admission.decide``/``conclude``; usage records are an in-memory list of immutable
tuples, kept only through the engine's ``reconcile_usage`` plans (closing a record replaces
its tuple with one that has an end). The invariant helpers that tests/engine/test_properties.py
uses (harness/engine_invariants.py: the ``World``, the independent accounting and the
per-pass checks) are reused.
``ENGINE_EXAMPLES`` x ``ENGINE_STEPS`` = 120 x 110 = 13,200 steps at most; hypothesis also
tries some shorter runs, so 11,300 to 12,200 steps run in practice (about 5 s on 2 cores).
``test_engine_machine`` counts the steps that ran (``STEPS``), prints the count and fails
below 10,000. A full pass also runs by itself when ``RESYNC_STEPS`` steps went without one
(the periodic resync), so every example checks its usage records.

The shared constants, strategies and expectations: harness/stateful.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from binder.engine.fit import refuses_new
from binder.engine.placement import answer_pass, full_pass
from binder.engine.types import (
    DefaultBudget,
    Device,
    PassResult,
    Phase,
    Pod,
    Vmi,
)
from binder.engine.types import Settings as EngineSettings
from binder.engine.usage import OpenRecord, UsageHolding, holdings, reconcile_usage
from harness import shapes
from harness.engine_invariants import (
    POOL_LABEL,
    Step,
    World,
    check_answer_pass,
    check_answers,
    check_bound_on_existing_nodes,
    check_budgets,
    check_capacity_on_placement,
    check_missing_classes,
    check_over_booking,
    check_pending_reasons,
    check_result_contract,
    check_whole_sets,
    class_for,
    limit_of,
    node_ref,
    pick,
    set_ref,
    tenant_usage,
)
from harness.stateful import (
    CLASS,
    DT,
    ENGINE_MIN_STEPS,
    ENGINE_SETTINGS,
    IDX,
    LIMIT,
    NODE,
    POOL,
    RESOURCES,
    RESYNC_STEPS,
    SET,
    STEPS,
    TENANTS,
    UNITS,
    Call,
    SetKey,
    admission_review,
    budget_problems,
    engine_classes,
    expected_devices,
    expected_holdings,
    grown_over_allocatable,
    held_of,
    launcher_pod_obj,
    new_vmi,
    patched,
    split_sets,
    stamp,
    units_by_record_key,
    vmi_devices,
    whole_bound_node,
)
from webhooks.admission import Action, MirrorView, Verdict, conclude, decide, parse_review

# --------------------------------------------------------------------------------------
# (a) The pure machine
# --------------------------------------------------------------------------------------


class Record(NamedTuple):
    """One usage record, immutable: closing it replaces the tuple by one with an ``end``."""

    id: int
    holding: UsageHolding
    start: datetime
    end: datetime | None


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        classes = engine_classes()
        self.world = World(
            now=shapes.NOW,
            catalogue=dict(classes),
            classes=dict(classes),
            nodes={},
            devices={},
            budgets={},
            vmis={},
            pods={},
            tenants=TENANTS,
            settings=EngineSettings(),
        )
        self.records: list[Record] = []
        self.closed: dict[int, Record] = {}
        #: Units per (namespace, kind, key) held as the last full pass saw them (see the docstring).
        self.held: Counter[tuple[str, str, str]] = Counter()
        #: Their integral over time, in unit-seconds, kept by the test.
        self.integral: Counter[tuple[str, str, str]] = Counter()
        self.calls: dict[SetKey, Call] = {}
        self.migrations: dict[SetKey, tuple[str, str, str]] = {}  # set -> (source uid, target uid, target node)
        self.split = False  # a full pass's writes partly failed; the next complete one restores sets
        self.since_full = 0  # steps since the last complete full pass
        self.kind = ""  # the current step: "full", "partial", "answer" or "" (a change)
        self.before: dict[SetKey, Device] = {}
        self.records_before: list[Record] = []

    # -- the step protocol ---------------------------------------------------------------

    def begin(self, dt: int) -> None:
        """Every rule starts here: count the step and move the clock on by ``dt`` seconds."""
        STEPS["engine"] += 1
        for key, units in self.held.items():
            self.integral[key] += units * dt
        self.world.now += timedelta(seconds=dt)
        self.before = dict(self.world.devices)
        self.since_full += 1
        if self.since_full > RESYNC_STEPS:
            self.run_full_pass(None)  # the periodic resync pass
            self.before = dict(self.world.devices)
        self.records_before = list(self.records)
        self.kind = ""

    def find_vmi(self, namespace: str, name: str) -> Vmi | None:
        return self.world.vmis.get((namespace, name))

    # -- setup ---------------------------------------------------------------------------

    @initialize(
        nodes=st.lists(st.tuples(st.tuples(UNITS, UNITS), st.booleans()), min_size=2, max_size=4),
        orders=st.lists(st.tuples(IDX, CLASS, st.integers(1, 3)), min_size=1, max_size=5),
        budgets=st.lists(st.tuples(IDX, IDX, LIMIT), max_size=3),
        deny=st.sampled_from([False] * 9 + [True]),
    )
    def setup(self, nodes: list[Any], orders: list[Any], budgets: list[Any], deny: bool) -> None:
        self.begin(0)
        if deny:
            self.world.settings = EngineSettings(default_budget=DefaultBudget.DENY)
        for alloc, pooled in nodes:
            self.add_node(alloc, pooled)
        for t, c, size in orders:
            self.order(t, c, size, None)
        for t, k, limit in budgets:
            self.set_limit(t, 0, k, limit)

    def add_node(self, alloc: tuple[int, int], pooled: bool) -> None:
        name = self.world.fresh("node-")
        self.world.nodes[name] = shapes.node(
            name, dict(zip(RESOURCES, alloc, strict=True)), labels=dict(POOL) if pooled else {},
            transition=stamp(self.world.now),
        )  # fmt: skip

    def add_device(self, namespace: str, vm: str, class_name: str) -> None:
        name = self.world.fresh(f"{vm}-gpu")
        self.world.devices[(namespace, name)] = shapes.gpu(
            namespace, name, class_name, vm, created=stamp(self.world.now)
        )

    def order(self, t: int, c: int, size: int, odd: int | None) -> SetKey:
        namespace, vm = pick(TENANTS, t), self.world.fresh("vm-")
        classes = [class_for(self.world, c)] * size
        if odd is not None:
            classes[-1] = class_for(self.world, odd)
        for class_name in classes:
            self.add_device(namespace, vm, class_name)
        return (namespace, vm)

    def set_limit(self, t: int, b: int, k: int, limit: int | None) -> None:
        namespace, name = pick(TENANTS, t), f"budget-{b}"
        key = pick(sorted(self.world.catalogue) + list(RESOURCES), k)
        old = self.world.budgets.get((namespace, name))
        limits = dict(old.limits) if old else {}
        if limit is None:
            limits.pop(key, None)
        else:
            limits[key] = limit
        self.world.budgets[(namespace, name)] = shapes.budget(namespace, limits, name=name)

    # -- nodes ---------------------------------------------------------------------------

    @rule(dt=DT, alloc=st.tuples(UNITS, UNITS), pooled=st.booleans())
    def node_added(self, dt: int, alloc: tuple[int, int], pooled: bool) -> None:
        self.begin(dt)
        self.add_node(alloc, pooled)

    @rule(dt=DT, i=NODE)
    def node_deleted(self, dt: int, i: int) -> None:
        self.begin(dt)
        name = node_ref(self.world, i)
        if name:
            del self.world.nodes[name]

    @rule(dt=DT, i=NODE, long_ago=st.booleans())
    def node_not_ready(self, dt: int, i: int, long_ago: bool) -> None:
        self.begin(dt)
        name = node_ref(self.world, i)
        if name:
            since = self.world.now - (timedelta(hours=2) if long_ago else timedelta(0))
            self.world.nodes[name] = dataclasses.replace(self.world.nodes[name], ready=False, ready_since=since)

    @rule(dt=DT, i=NODE)
    def node_ready(self, dt: int, i: int) -> None:
        self.begin(dt)
        name = node_ref(self.world, i)
        if name and not self.world.nodes[name].ready:
            self.world.nodes[name] = dataclasses.replace(self.world.nodes[name], ready=True, ready_since=self.world.now)

    def resize(self, i: int, r: int, delta: int) -> None:
        name = node_ref(self.world, i)
        if name:
            alloc = dict(self.world.nodes[name].allocatable)
            resource = RESOURCES[r % len(RESOURCES)]
            alloc[resource] = max(0, alloc.get(resource, 0) + delta)
            self.world.nodes[name] = dataclasses.replace(self.world.nodes[name], allocatable=alloc)

    @rule(dt=DT, i=NODE, r=IDX, delta=st.sampled_from([-1, -2, -4, 1, 2, 4]))
    def allocatable_changed(self, dt: int, i: int, r: int, delta: int) -> None:
        self.begin(dt)
        self.resize(i, r, delta)

    @rule(dt=DT, i=NODE, r=IDX, delta=st.sampled_from([-1, -1, -2, -8]))
    def allocatable_shrank(self, dt: int, i: int, r: int, delta: int) -> None:
        self.begin(dt)
        self.resize(i, r, delta)

    @rule(dt=DT, i=NODE, what=st.sampled_from(["drain", "undrain", "cordon", "uncordon", "pool", "unpool"]))
    def node_labelled(self, dt: int, i: int, what: str) -> None:
        self.begin(dt)
        name = node_ref(self.world, i)
        if not name:
            return
        node = self.world.nodes[name]
        labels = dict(node.labels)
        if what in ("drain", "undrain"):
            labels.pop("gpuplane.io/drain", None)
            labels.update({"gpuplane.io/drain": "true"} if what == "drain" else {})
        elif what in ("pool", "unpool"):
            labels.pop(POOL_LABEL, None)
            labels.update(POOL if what == "pool" else {})
        self.world.nodes[name] = dataclasses.replace(
            node, labels=labels, unschedulable={"cordon": True, "uncordon": False}.get(what, node.unschedulable)
        )

    # -- sets, budgets, classes ----------------------------------------------------------

    @rule(dt=DT, t=IDX, c=CLASS, size=st.integers(1, 4), odd=st.sampled_from([None] * 4 + [0, 1, 2, -1]))
    def set_ordered(self, dt: int, t: int, c: int, size: int, odd: int | None) -> None:
        self.begin(dt)
        self.order(t, c, size, odd)

    @rule(dt=DT, t=IDX, c=CLASS, size=st.integers(1, 3))
    def vm_ordered_and_created(self, dt: int, t: int, c: int, size: int) -> None:
        """The usual flow: a tenant orders the GPUs of a VM and creates its VMI right away."""
        self.begin(dt)
        self.create_vmi(self.order(t, c, size, None), "whole")

    @rule(dt=DT, s=SET, choices=st.lists(CLASS, min_size=1, max_size=2))
    def set_grown(self, dt: int, s: int, choices: list[int]) -> None:
        self.begin(dt)
        key = set_ref(self.world, s)
        if key:
            for c in choices:
                self.add_device(key[0], key[1], class_for(self.world, c))

    @rule(dt=DT, s=SET)
    def set_deleted(self, dt: int, s: int) -> None:
        self.begin(dt)
        key = set_ref(self.world, s)
        if key:
            for device in self.world.members(key):
                del self.world.devices[device.key]

    @rule(dt=DT, s=SET, m=IDX)
    def device_deleted(self, dt: int, s: int, m: int) -> None:
        self.begin(dt)
        key = set_ref(self.world, s)
        if key:
            del self.world.devices[pick(self.world.members(key), m).key]

    @rule(dt=DT, s=SET, m=IDX, c=CLASS, to=st.none() | SET)
    def device_edited(self, dt: int, s: int, m: int, c: int, to: int | None) -> None:
        """``spec.className`` or ``spec.vmName`` edited in place (the CRD allows it): the device
        changes units, or joins another set of its namespace, which may be split until the
        next full pass gathers it ("members added later")."""
        self.begin(dt)
        w = self.world
        key = set_ref(w, s)
        if key is None:
            return
        device = pick(w.members(key), m)
        if to is None:
            edited = dataclasses.replace(device, class_name=class_for(w, c))
        else:
            other = set_ref(w, to)
            if other is None or other[0] != key[0]:
                return
            edited = dataclasses.replace(device, vm_name=other[1])
        w.devices[device.key] = edited
        self.before[device.key] = edited  # an edit, not a placement: node growth counts from here
        self.split = self.split or bool(split_sets(w.devices.values()))

    @rule(dt=DT, t=IDX, b=st.integers(0, 1), k=IDX, limit=LIMIT)
    def budget_changed(self, dt: int, t: int, b: int, k: int, limit: int | None) -> None:
        self.begin(dt)
        self.set_limit(t, b, k, limit)

    @rule(dt=DT, t=IDX, b=st.integers(0, 1))
    def budget_deleted(self, dt: int, t: int, b: int) -> None:
        self.begin(dt)
        self.world.budgets.pop((pick(TENANTS, t), f"budget-{b}"), None)

    @rule(dt=DT, c=IDX, what=st.sampled_from(["delete", "restore", "restore", "units", "units"]))
    def class_changed(self, dt: int, c: int, what: str) -> None:
        self.begin(dt)
        name = pick(sorted(self.world.catalogue), c)
        if what == "delete":
            self.world.classes.pop(name, None)
        elif what == "restore":
            self.world.classes[name] = self.world.catalogue[name]
        else:  # unitsPerDevice edited: records of held devices close and reopen with the new units
            cls = self.world.catalogue[name]
            cls = dataclasses.replace(cls, units_per_device=3 - cls.units_per_device)
            self.world.catalogue[name] = cls
            if name in self.world.classes:
                self.world.classes[name] = cls

    # -- pods ----------------------------------------------------------------------------

    def add_pod(self, obj: dict[str, Any]) -> Pod:
        pod: Pod = shapes.engine(obj)
        self.world.pods[(pod.namespace, pod.name)] = pod
        return pod

    @rule(dt=DT, s=SET, n=NODE, r=IDX, units=st.integers(1, 4))
    def forged_pod(self, dt: int, s: int, n: int, r: int, units: int) -> None:
        """A pod whose owner reference and labels name a VMI, which never listed it."""
        self.begin(dt)
        key = set_ref(self.world, s)
        if key:
            owner = shapes.vmi_obj(key[0], key[1], [], {}, "")
            node = node_ref(self.world, n) or ""
            self.add_pod(shapes.launcher_obj(owner, RESOURCES[r % 2], units, node, uid=shapes.new_uid()))

    @rule(dt=DT, t=IDX, n=st.integers(-1, 5), r=IDX, units=st.integers(1, 4))
    def raw_pod(self, dt: int, t: int, n: int, r: int, units: int) -> None:
        self.begin(dt)
        node = "" if n < 0 else (pick(sorted(self.world.nodes), n) or "")
        name = self.world.fresh("trainer-")
        self.add_pod(shapes.plain_pod_obj(pick(TENANTS, t), name, RESOURCES[r % 2], units, node))

    @rule(dt=DT, p=IDX, delete=st.booleans())
    def pod_finished(self, dt: int, p: int, delete: bool) -> None:
        self.begin(dt)
        key = pick(sorted(self.world.pods), p)
        if key is None:
            return
        if delete:
            del self.world.pods[key]
        else:
            self.world.pods[key] = dataclasses.replace(self.world.pods[key], phase="Succeeded")

    # -- VMIs and the webhook ------------------------------------------------------------

    def mirror_view(self, namespace: str) -> MirrorView:
        w = self.world
        return MirrorView(
            namespace=namespace,
            devices=tuple(d for d in w.cluster().devices if d.namespace == namespace),
            classes=tuple(w.classes[k] for k in sorted(w.classes)),
            nodes=tuple(w.nodes[k] for k in sorted(w.nodes)),
            budgets=tuple(b for k, b in sorted(w.budgets.items()) if b.namespace == namespace),
            pods=tuple(p for k, p in sorted(w.pods.items()) if p.namespace == namespace),
            vmis=tuple(v for k, v in sorted(w.vmis.items()) if v.namespace == namespace),
            default_budget=w.settings.default_budget,
        )

    def advisory_over_budget(self, key: SetKey) -> bool:
        """Would binding the set's Pending members take a key of its tenant over its limit?"""
        w = self.world
        devices = list(w.devices.values())
        candidate = [
            dataclasses.replace(d, phase=Phase.BOUND, node="-") if d.set_key == key and d.phase is Phase.PENDING else d
            for d in devices
        ]
        before = tenant_usage(devices, w.classes, w.pods.values(), w.vmis)[key[0]]
        after = tenant_usage(candidate, w.classes, w.pods.values(), w.vmis)[key[0]]
        return any(
            (cap := limit_of(w, key[0], k)) is not None and after[k] > before[k] and after[k] > cap for k in after
        )

    @rule(dt=DT, s=SET, variant=st.sampled_from(["whole", "whole", "whole", "whole", "partial", "foreign", "dry"]))
    def vmi_created(self, dt: int, s: int, variant: str) -> None:
        """The webhook decides a VMI CREATE; a Bound set's VMI starts at once."""
        self.begin(dt)
        key = set_ref(self.world, s)
        if key is not None:
            self.create_vmi(key, variant)

    def names_in_vmi(self, key: SetKey, members: list[Device], variant: str) -> list[str]:
        """The devices a VMI of ``variant`` names: its whole set, the set but its first member
        ("partial"), or the set and a device of another VM in the namespace ("foreign")."""
        namespace, vm = key
        names = [d.name for d in members]
        if variant == "partial":
            return names[1:]
        if variant == "foreign":
            others = sorted(d.name for d in self.world.devices.values() if d.namespace == namespace and d.vm_name != vm)
            names.append(pick(others, len(names)) or names[0])
        return names

    def takes_nothing_new(self, node: str, members: Any) -> bool:
        w = self.world
        return node in w.nodes and refuses_new(w.nodes[node], [w.classes[d.class_name] for d in members]) is not None

    def create_vmi(self, key: SetKey, variant: str) -> None:  # noqa: C901 - one branch per kind of VMI
        w = self.world
        if key in w.vmis or key in self.calls:
            return
        namespace, vm = key
        members = w.members(key)
        names = self.names_in_vmi(key, members, variant)
        vmi = new_vmi(namespace, vm, names)
        uid = w.fresh("request-")
        view = self.mirror_view(namespace)
        verdict = decide(admission_review(vmi, uid, dry_run=variant == "dry"), view)
        assert verdict.uid == uid
        missing = [d.name for d in members if d.class_name not in w.classes]
        node = whole_bound_node(members)
        if not names:  # a one-device set named partly: the VMI names no gpuplane.io device
            assert verdict.action is Action.ALLOW and not verdict.patch, verdict
        elif variant == "partial":
            assert verdict.action is Action.DENY and "names only part of its set" in verdict.message, verdict
        elif variant == "foreign" and len(set(names)) < len(names):
            assert verdict.action is Action.DENY and "more than once" in verdict.message, verdict
        elif variant == "foreign":
            assert verdict.action is Action.DENY and "belongs to VM" in verdict.message, verdict
        elif missing:
            assert verdict.action is Action.DENY and "does not exist" in verdict.message, verdict
        elif node is not None and self.takes_nothing_new(node, members):
            # A node taking nothing new (NotReady, cordoned, draining, ...) would not start the launcher.
            assert verdict.action is Action.DENY and f"its GPUs are held on node {node}" in verdict.message, verdict
        elif node is not None:
            assert verdict.action is Action.PATCH and verdict.node == node, verdict
            assert patched(vmi, verdict) == (node, expected_devices(members, w.classes))
            if variant != "dry":
                self.start_vmi(key, vmi, verdict)
        elif self.advisory_over_budget(key):
            assert verdict.action is Action.DENY and verdict.message.startswith("over budget"), verdict
        elif variant == "dry":
            assert verdict.action is Action.ALLOW and verdict.warnings, verdict
        else:
            assert verdict.action is Action.BIND and sorted(verdict.bind) == sorted(names), verdict
            # What the webhook writes: the bind-request annotation on every device of the set.
            for name in names:
                w.devices[(namespace, name)] = dataclasses.replace(w.devices[(namespace, name)], bind_request=uid)
            review = parse_review(admission_review(vmi, uid))
            self.calls[key] = Call(review, tuple(names), uid, view, vmi)

    @rule(dt=DT, s=IDX)
    def webhook_gave_up(self, dt: int, s: int) -> None:
        """A waiting webhook call timed out ("try again"); its requests stay on the devices."""
        self.begin(dt)
        key = pick(sorted(self.calls), s)
        if key:
            del self.calls[key]

    def start_vmi(self, key: SetKey, vmi: dict[str, Any], verdict: Verdict) -> None:
        """The VMI runs where the patch pinned it, its launcher pod requesting the patched gpus."""
        node, requests = patched(vmi, verdict)
        names = [n.removeprefix("gpuplane.io/") for n in vmi_devices(vmi)]
        uid = shapes.new_uid()
        running = shapes.vmi_obj(key[0], key[1], names, {uid: node}, node)
        self.world.vmis[key] = shapes.engine(running)
        self.add_pod(launcher_pod_obj(running, requests, node, uid))

    def conclude_calls(self, complete: bool) -> None:
        """Webhooks waiting for answers wake after the pass that wrote them."""
        w = self.world
        for key, call in sorted(self.calls.items()):
            named = [w.devices.get((key[0], n)) for n in call.names]
            if any(d is None for d in named):
                del self.calls[key]  # a device was deleted: the webhook denies, "try again"
                continue
            devices = [d for d in named if d is not None]
            if any(d.answered_request != call.request for d in devices):
                continue
            verdict = conclude(call.review, call.view, {d.name: d.answer for d in devices})
            del self.calls[key]
            members = w.members(key)
            # The answers are about the set each device belongs to now. A device whose vmName was
            # edited during the wait was answered for its new set (the webhook reads answers by
            # device name): only the named devices' placement can be judged then.
            still_members = all(d.vm_name == key[1] for d in devices)
            if verdict.action is Action.PATCH:
                assert whole_bound_node(devices) == verdict.node, (verdict, devices)
                if complete and still_members:
                    assert whole_bound_node(members) == verdict.node, (verdict, members)
                if key not in w.vmis:
                    self.start_vmi(key, call.vmi, verdict)
            else:
                assert verdict.action is Action.DENY, verdict
                answered_now = all(self.before[d.key].answered_request != call.request for d in devices)
                node = whole_bound_node(members)
                # Bound, but on a node that took nothing new when the webhook concluded (its view of
                # the nodes): the webhook refuses the pin rather than strand the VMI there.
                stuck = node is not None and f"its GPUs are held on node {node}, which" in verdict.message
                if complete and answered_now and still_members and not stuck:
                    assert node is None, (verdict, members)

    @rule(dt=DT, s=IDX, n=IDX)
    def vmi_migrating(self, dt: int, s: int, n: int) -> None:
        """A live migration starts: a target launcher pod, both pods in activePods."""
        self.begin(dt)
        w = self.world
        key = pick(sorted(w.vmis), s)
        if key is None or key in self.migrations or len(w.vmis[key].active_pods) != 1:
            return
        vmi = w.vmis[key]
        ((source_uid, source_node),) = vmi.active_pods.items()
        source = next((p for p in w.pods.values() if p.uid == source_uid), None)
        target_node = pick([name for name in sorted(w.nodes) if name != source_node], n)
        if source is None or target_node is None or not source.requests:
            return
        uid = shapes.new_uid()
        owner = shapes.vmi_obj(key[0], key[1], [], {}, source_node)
        self.add_pod(launcher_pod_obj(owner, source.requests, target_node, uid))
        w.vmis[key] = dataclasses.replace(vmi, active_pods={**vmi.active_pods, uid: target_node})
        self.migrations[key] = (source_uid, uid, target_node)

    @rule(dt=DT, s=IDX, keep_source=st.booleans())
    def vmi_migrated(self, dt: int, s: int, keep_source: bool) -> None:
        """The migration completes; KubeVirt may keep the finished source pod in activePods."""
        self.begin(dt)
        w = self.world
        key = pick(sorted(self.migrations), s)
        if key is None:
            return
        source_uid, target_uid, target_node = self.migrations.pop(key)
        for pod_key, pod in list(w.pods.items()):
            if pod.uid == source_uid:
                w.pods[pod_key] = dataclasses.replace(pod, phase="Succeeded")
        vmi = w.vmis.get(key)
        if vmi is not None:
            active = {u: n for u, n in vmi.active_pods.items() if u == target_uid or (keep_source and u == source_uid)}
            w.vmis[key] = dataclasses.replace(vmi, active_pods=active, node=target_node)

    @rule(dt=DT, s=IDX)
    def vmi_ended(self, dt: int, s: int) -> None:
        """The VMI is gone; its launcher pods finish (they may linger, Succeeded)."""
        self.begin(dt)
        w = self.world
        key = pick(sorted(w.vmis), s)
        if key is None:
            return
        vmi = w.vmis.pop(key)
        self.migrations.pop(key, None)
        for pod_key, pod in list(w.pods.items()):
            if pod.uid in vmi.active_pods:
                w.pods[pod_key] = dataclasses.replace(pod, phase="Succeeded")

    # -- passes --------------------------------------------------------------------------

    @rule(dt=DT)
    def full_pass_on_event(self, dt: int) -> None:
        self.begin(dt)
        self.run_full_pass(None)

    @rule(dt=DT)
    def full_pass_on_resync(self, dt: int) -> None:
        self.begin(dt)
        self.run_full_pass(None)

    @rule(dt=DT)
    def full_pass_on_staff_action(self, dt: int) -> None:
        self.begin(dt)
        self.run_full_pass(None)

    @rule(dt=DT, mask=st.integers(0, 2**16 - 1))
    def full_pass_some_writes_fail(self, dt: int, mask: int) -> None:
        self.begin(dt)
        self.run_full_pass(mask)

    @rule(dt=DT)
    def answer_pass_for_webhook(self, dt: int) -> None:
        self.begin(dt)
        self.run_answer_pass()

    @rule(dt=DT)
    def answer_pass_queued_again(self, dt: int) -> None:
        self.begin(dt)
        self.run_answer_pass()

    @rule(dt=DT)
    def time_passes(self, dt: int) -> None:
        self.begin(dt)

    def run_full_pass(self, mask: int | None) -> None:
        w = self.world
        cluster = w.cluster()
        result = full_pass(cluster)
        complete = True
        if mask is not None:
            result, complete = written_only(result, mask)
        step = Step.of(w, cluster, result)
        problems = check_budgets(step) + self.budget_problems(step)
        if complete:
            for check in (
                check_result_contract,
                check_over_booking,
                check_capacity_on_placement,
                check_whole_sets,
                check_pending_reasons,
                check_bound_on_existing_nodes,
                check_missing_classes,
                check_answers,
            ):
                problems += check(step)
            held_classless = [d.key for d in step.after.values() if d.held and d.class_name not in w.classes]
            problems += [f"held device {k} of a missing class after a full pass" for k in held_classless]
        assert not problems, "\n".join(problems)
        w.devices = step.after
        self.kind = "full" if complete else "partial"
        self.split = not complete
        if complete:
            self.since_full = 0
        self.write_usage()
        self.conclude_calls(complete)

    def run_answer_pass(self) -> None:
        w = self.world
        cluster = w.cluster()
        problems = check_answer_pass(w, cluster)  # touches only requested sets, moves nothing held, ...
        step = Step.of(w, cluster, answer_pass(cluster))
        problems += self.budget_problems(step)
        assert not problems, "\n".join(problems)
        w.devices = step.after
        self.kind = "answer"
        self.conclude_calls(True)

    def budget_problems(self, step: Step) -> list[str]:
        w = self.world
        before = tenant_usage(step.before.values(), w.classes, step.cluster.pods, w.vmis)
        after = tenant_usage(step.after.values(), w.classes, step.cluster.pods, w.vmis)
        return budget_problems(w.tenants, before, after, lambda ns, key: limit_of(w, ns, key))

    def write_usage(self) -> None:
        """Apply the engine's plan to the record list, then check it against the test's own view."""
        w = self.world
        found = holdings(w.devices.values(), w.pods.values(), w.classes, self.find_vmi)
        plan = reconcile_usage((OpenRecord(r.id, r.holding) for r in self.records if r.end is None), found)
        closed_now, opened_now = [], []
        for record_id in plan.close:
            record = self.records[record_id - 1]
            assert record.id == record_id and record.end is None, f"plan closes record {record} that is not open"
            self.records[record_id - 1] = record._replace(end=w.now)
            closed_now.append(held_of(record.holding))
        for holding in plan.open:
            self.records.append(Record(len(self.records) + 1, holding, w.now, None))
            opened_now.append(held_of(holding))
        expected = expected_holdings(w.devices.values(), w.classes, w.pods.values(), w.vmis)
        got = Counter(held_of(r.holding) for r in self.records if r.end is None)
        assert got == expected, f"open records differ from holdings: extra {got - expected}, missing {expected - got}"
        churn = set(closed_now) & set(opened_now)
        assert not churn, f"records closed and reopened unchanged: {sorted(churn)}"
        self.held = units_by_record_key(expected)

    # -- invariants after every step -----------------------------------------------------

    @invariant()
    def records_are_append_only(self) -> None:
        for record_id, record in self.closed.items():
            assert self.records[record_id - 1] == record, f"closed record {record_id} changed"
        for record in self.records:
            if record.end is not None:
                assert record.start <= record.end
                self.closed.setdefault(record.id, record)
        if self.kind not in ("full", "partial"):
            assert self.records == self.records_before, f"a {self.kind or 'change'} step changed usage records"

    @invariant()
    def sets_are_whole(self) -> None:
        if not self.split:
            problems = split_sets(self.world.devices.values())
            assert not problems, problems

    @invariant()
    def no_node_newly_over_booked(self) -> None:
        if self.kind != "partial":
            w = self.world
            allocatable = {name: node.allocatable for name, node in w.nodes.items()}
            problems = grown_over_allocatable(self.before.values(), w.devices.values(), w.classes, allocatable)
            assert not problems, problems

    @invariant()
    def gpu_hours_are_the_integral_of_held_units(self) -> None:
        recorded: Counter[tuple[str, str, str]] = Counter()
        for r in self.records:
            seconds = ((r.end or self.world.now) - r.start).total_seconds()
            recorded[(r.holding.namespace, r.holding.subject_kind.value, r.holding.key)] += int(
                r.holding.units * seconds
            )
        assert +recorded == +self.integral, f"records {dict(+recorded)} != held units integrated {dict(+self.integral)}"


def written_only(result: PassResult, mask: int) -> tuple[PassResult, bool]:
    """The pass's result as ``binder.runtime.cluster.write_status`` narrows it when some status writes
    fail: bit i of ``mask`` (mod 16) says whether the i-th changed device was written."""
    written = tuple(d for i, d in enumerate(result.devices) if mask >> (i % 16) & 1)
    keys = {d.key for d in written}
    narrowed = dataclasses.replace(
        result,
        devices=written,
        changes=tuple(c for c in result.changes if (c.namespace, c.name) in keys),
        answered=tuple(k for k in result.answered if k in keys),
    )
    return narrowed, len(written) == len(result.devices)


@pytest.mark.slow
def test_engine_machine() -> None:
    STEPS["engine"] = 0
    started = time.perf_counter()
    run_state_machine_as_test(EngineMachine, settings=ENGINE_SETTINGS)
    elapsed = time.perf_counter() - started
    print(f"EngineMachine: {STEPS['engine']} steps in {elapsed:.1f} s")
    assert STEPS["engine"] >= ENGINE_MIN_STEPS, f"only {STEPS['engine']} steps ran"

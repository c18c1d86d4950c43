"""Stateful property tests across the binder, usage records and webhook decisions.

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
tests/shapes.py), ``binder.engine.placement``, ``binder.engine.usage`` and
``webhooks.admission.decide``/``conclude``; usage records are an in-memory list of immutable
tuples, kept only through the engine's ``reconcile_usage`` plans (closing a record replaces
its tuple with one that has an end). The invariant helpers that tests/test_properties.py
uses (tests/engine_invariants.py: the ``World``, the independent accounting and the
per-pass checks) are reused.
``ENGINE_EXAMPLES`` x ``ENGINE_STEPS`` = 120 x 110 = 13,200 steps at most; hypothesis also
tries some shorter runs, so 11,300 to 12,200 steps run in practice (about 5 s on 2 cores).
``test_engine_machine`` counts the steps that ran (``STEPS``), prints the count and fails
below 10,000. A full pass also runs by itself when ``RESYNC_STEPS`` steps went without one
(the periodic resync), so every example checks its usage records.

(b) ``DatabaseMachine`` drives the real thing: objects loaded with ``load_objects`` and
changed through the models, ``binder.runtime.passes.run_pass`` (full and answer), the webhook's
own ``mirror_view``/``decide`` and bind-request write, usage records in the database and
GPU-hours from ``usage.queries.gpu_hours`` (and, after each full pass, the tenant usage
API's ``current_usage`` against the test's own accounting). Each example runs inside a savepoint that is
rolled back (usage records can be neither deleted nor updated once closed).
Passes run on two workers, each with its in-memory state, that take turns
(``workers_take_turns``); the feed is reset (``feed_reset``) and devices are deleted and
created again under the same name (``device_recreated``). Side by side with every pass,
the from-scratch engine runs on a fresh read of the same database: the pass must write
exactly its devices and decisions, the worker's records and ledger must equal a rebuild,
and every other pass also runs the worker's own verification, which must find nothing.
``DB_EXAMPLES`` x ``DB_STEPS`` = 20 x 25 = 500 steps at most (440 to 530 counted in practice:
initialisation counts too), 7 to 9 s on SQLite and on PostgreSQL; fails below 300.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import jsonpatch
import pytest
from django.db import connection, transaction
from django.test import override_settings
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from binder import models
from binder.engine.accounting import Ledger
from binder.engine.launcher import launcher_of, raw_usage
from binder.engine.placement import answer_pass, full_pass
from binder.engine.types import (
    HELD_PHASES,
    Budget,
    Cluster,
    DefaultBudget,
    Device,
    GpuClass,
    PassResult,
    Phase,
    Pod,
    Vmi,
)
from binder.engine.types import Settings as EngineSettings
from binder.engine.usage import OpenRecord, UsageHolding, holdings, reconcile_usage
from binder.kube import client as kube_client
from binder.mirror.read import read_cluster
from binder.mirror.snapshot import SnapshotError, load_objects
from binder.mirror.write import MODELS as MIRROR_MODELS
from binder.mirror.write import mirror_event
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from binder.runtime.usage_records import HOLDING_COLUMNS
from binder.runtime.verify import compare_records
from tests import shapes
from tests.clock import Clock
from tests.engine_invariants import (
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
    device_units_on_nodes,
    limit_of,
    node_ref,
    pick,
    set_ref,
    tenant_usage,
)
from usage import queries
from usage.models import UsageRecord
from webhooks import binding
from webhooks.admission import Action, MirrorView, Review, Verdict, conclude, decide, parse_review

H100, A10 = shapes.H100, shapes.A10
RESOURCES = (H100, A10)
TENANTS = ("team-a", "team-b", "team-c")
POOL = {POOL_LABEL: "fast"}
SetKey = tuple[str, str]

#: Steps run per machine, counted by the rules themselves (see the module docstring).
STEPS: Counter[str] = Counter()

ENGINE_EXAMPLES, ENGINE_STEPS = 120, 110
ENGINE_MIN_STEPS = 10_000
#: ``GPUPLANE_DB_EXAMPLES=200`` searches deeper locally (CI keeps the default).
DB_EXAMPLES, DB_STEPS = int(os.environ.get("GPUPLANE_DB_EXAMPLES", "20")), 25
DB_MIN_STEPS = 300
#: A full pass runs at the start of a step when this many steps ran without one (the resync,
#: ``GPUPLANE_RESYNC_SECONDS``): hypothesis turns rules off per example (swarm testing), and an
#: example without its full-pass rules would otherwise never check the usage records.
RESYNC_STEPS = 8

_COMMON = {
    "deadline": None,
    "database": None,  # every CI run searches afresh
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}
ENGINE_SETTINGS = settings(max_examples=ENGINE_EXAMPLES, stateful_step_count=ENGINE_STEPS, **_COMMON)
DB_SETTINGS = settings(max_examples=DB_EXAMPLES, stateful_step_count=DB_STEPS, **_COMMON)

# Strategies. Seconds the clock moves at a step straddle the 300 s node grace period.
DT = st.sampled_from([0, 1, 30, 120, 299, 301, 900, 3600])
IDX = st.integers(0, 7)
NODE = st.integers(-3, 5)  # negative: the node of a Bound set (engine_invariants.node_ref)
SET = st.integers(-4, 7)  # negative: a Bound set (engine_invariants.set_ref)
UNITS = st.sampled_from([0, 1, 2, 4, 4, 8, 8])
CLASS = st.sampled_from([0, 0, 0, 1, 1, 1, 2, 2, 2, -1])  # -1: a class that never exists
LIMIT = st.none() | st.integers(0, 8)


def stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------
# Independent expectations (no engine Ledger, no binder.engine.usage): the launcher rule
# itself is called, never re-implemented.
# --------------------------------------------------------------------------------------

#: What an open record says is held: kind, namespace, subject, subject uid, key, resource,
#: units, node, phase, vm name.
Held = tuple[str, str, str, str, str, str, int, str, str, str]


def held_of(h: UsageHolding) -> Held:
    return (
        h.subject_kind.value,
        h.namespace,
        h.subject,
        h.subject_uid,
        h.key,
        h.resource_name,
        h.units,
        h.node,
        h.phase.value,
        h.vm_name,
    )


def expected_holdings(
    devices: Iterable[Device], classes: Mapping[str, GpuClass], pods: Iterable[Pod], vmis: Mapping[SetKey, Vmi]
) -> Counter[Held]:
    """What must have an open record: each Bound or Lost device of an existing class
    (a device whose class is gone holds nothing), and each pod's raw
    usage for budgets per resource."""
    devices = list(devices)
    sets: dict[SetKey, list[Device]] = defaultdict(list)
    for device in devices:
        sets[device.set_key].append(device)
    found: Counter[Held] = Counter()
    for d in devices:
        cls = classes.get(d.class_name)
        if d.phase in HELD_PHASES and cls is not None:
            node = d.node if d.phase is Phase.BOUND else ""
            found[("GPU", d.namespace, d.name, "", cls.name, cls.resource_name, cls.units_per_device, node,
                   d.phase.value, d.vm_name)] += 1  # fmt: skip
    for pod in pods:
        launcher = launcher_of(pod, lambda ns, name: vmis.get((ns, name)))
        members = sets.get((launcher.namespace, launcher.name), []) if launcher else []
        for resource, units in raw_usage(pod, launcher, members, classes).budget.items():
            if units > 0:
                found[("Pod", pod.namespace, pod.name, pod.uid, resource, resource, units, pod.node, "Raw", "")] += 1
    return found


def units_by_record_key(held: Counter[Held]) -> Counter[tuple[str, str, str]]:
    """Units held per (namespace, subject kind, record key)."""
    out: Counter[tuple[str, str, str]] = Counter()
    for (kind, ns, _, _, key, _, units, _, _, _), n in held.items():
        out[(ns, kind, key)] += units * n
    return out


def units_by_budget_key(held: Counter[Held]) -> Counter[tuple[str, str]]:
    """Units held per (namespace, budget key): a device counts under its class and its
    resource, a pod under its resource (how ``queries.gpu_hours`` keys hours)."""
    out: Counter[tuple[str, str]] = Counter()
    for (kind, ns, _, _, key, resource, units, _, _, _), n in held.items():
        out[(ns, key)] += units * n
        if kind == "GPU":
            out[(ns, resource)] += units * n
    return out


def split_sets(devices: Iterable[Device]) -> list[str]:
    """Sets whose held members do not share one phase and node."""
    sets: dict[SetKey, set[tuple[Phase, str]]] = defaultdict(set)
    for d in devices:
        if d.phase in HELD_PHASES:
            sets[d.set_key].add((d.phase, d.node if d.phase is Phase.BOUND else ""))
    return [f"split set {key}: {sorted(places)}" for key, places in sorted(sets.items()) if len(places) > 1]


def grown_over_allocatable(
    before: Iterable[Device], after: Iterable[Device], classes: Mapping[str, GpuClass], allocatable: Mapping[str, Any]
) -> list[str]:
    """Nodes over their allocatable whose device units grew (both counted with today's classes)."""
    was = device_units_on_nodes(before, classes)
    now = device_units_on_nodes(after, classes)
    problems = []
    for node, per_resource in sorted(now.items()):
        if node not in allocatable:
            continue
        for resource, units in sorted(per_resource.items()):
            limit = allocatable[node].get(resource, 0)
            if units > limit and units > was[node][resource]:
                problems.append(f"node {node} {resource}: devices {was[node][resource]} -> {units} > {limit}")
    return problems


def budget_problems(
    tenants: Iterable[str],
    before: Mapping[str, Counter[str]],
    after: Mapping[str, Counter[str]],
    limit: Any,
) -> list[str]:
    """A key over its limit after a pass was over before it, and did not grow
    (the binder refuses any bind that adds units to a key beyond its limit)."""
    problems = []
    for ns in sorted(tenants):
        was, now = before.get(ns, Counter()), after.get(ns, Counter())
        for key in sorted(set(was) | set(now)):
            cap = limit(ns, key)
            if cap is None or now[key] <= cap:
                continue
            if was[key] <= cap or now[key] > was[key]:
                problems.append(f"budget: {ns} key {key} went {was[key]} -> {now[key]}, limit {cap}")
    return problems


def whole_bound_node(devices: Iterable[Device]) -> str | None:
    """The node when every device is Bound there, else None."""
    devices = list(devices)
    nodes = {d.node for d in devices}
    if devices and all(d.phase is Phase.BOUND for d in devices) and len(nodes) == 1:
        return nodes.pop()
    return None


# --------------------------------------------------------------------------------------
# Webhook requests, from the captured AdmissionReview and VMI
# --------------------------------------------------------------------------------------


def new_vmi(namespace: str, name: str, devices: list[str]) -> dict[str, Any]:
    """A VMI as the webhook sees it on CREATE: the captured fedora06 naming ``devices``."""
    obj = shapes.vmi_obj(namespace, name, devices, {}, "")
    for key in ("uid", "resourceVersion", "generation", "finalizers"):
        obj["metadata"].pop(key, None)
    obj["metadata"]["creationTimestamp"] = None
    obj["status"] = {}
    return obj


def admission_review(vmi: dict[str, Any], uid: str, *, dry_run: bool = False) -> dict[str, Any]:
    """The captured AdmissionReview request turned into a VMI CREATE of ``vmi``."""
    body = shapes.real("admissionreview-v1-request-pod-create.json")
    kind = {"group": "kubevirt.io", "version": "v1", "kind": "VirtualMachineInstance"}
    resource = {"group": "kubevirt.io", "version": "v1", "resource": "virtualmachineinstances"}
    body["request"].update(
        uid=uid,
        kind=kind,
        requestKind=dict(kind),
        resource=resource,
        requestResource=dict(resource),
        namespace=vmi["metadata"]["namespace"],
        object=vmi,
        dryRun=dry_run,
    )
    return body


def patched(vmi: dict[str, Any], verdict: Verdict) -> tuple[str, Counter[str]]:
    """Apply the webhook's patch: the node the VMI is pinned to and its gpus per deviceName."""
    result = jsonpatch.apply_patch(vmi, [dict(op) for op in verdict.patch])
    # The hostname label (equal to the name on these nodes), or, for a node the view did
    # not hold, the required node affinity on metadata.name.
    node = result["spec"].get("nodeSelector", {}).get("kubernetes.io/hostname")
    if node is None:
        terms = result["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        (node,) = {f["values"][0] for t in terms["nodeSelectorTerms"] for f in t["matchFields"]}
    return node, Counter(g["deviceName"] for g in result["spec"]["domain"]["devices"]["gpus"])


def expected_devices(members: Iterable[Device], classes: Mapping[str, GpuClass]) -> Counter[str]:
    """One gpus entry per unit of each device, named by its class's raw resource."""
    want: Counter[str] = Counter()
    for d in members:
        want[classes[d.class_name].resource_name] += classes[d.class_name].units_per_device
    return want


def launcher_pod_obj(
    vmi: dict[str, Any], requests: Mapping[str, int], node: str, uid: str, phase: str = "Running"
) -> dict[str, Any]:
    """The captured virt-launcher pod requesting ``requests`` (KubeVirt: 1 per gpus entry)."""
    first, *rest = sorted(requests)
    obj = shapes.launcher_obj(vmi, first, requests[first], node, uid=uid, phase=phase)
    resources = obj["spec"]["containers"][0]["resources"]
    for resource in rest:
        for section in ("limits", "requests"):
            resources[section][resource] = str(requests[resource])
    return obj


class Call(NamedTuple):
    """A webhook call waiting for the binder's answers to its bind request."""

    review: Review
    names: tuple[str, ...]
    request: str
    view: MirrorView
    vmi: dict[str, Any]


def engine_classes() -> dict[str, GpuClass]:
    return {
        "h100": shapes.gpu_class("h100", H100),
        "h100-pair": shapes.gpu_class("h100-pair", H100, units=2, selector=dict(POOL)),
        "a10": shapes.gpu_class("a10", A10),
    }


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

    def create_vmi(self, key: SetKey, variant: str) -> None:
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
                if complete and answered_now and still_members:
                    assert whole_bound_node(members) is None, (verdict, members)

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


def vmi_devices(vmi: Mapping[str, Any]) -> list[str]:
    return [g["deviceName"] for g in vmi["spec"]["domain"]["devices"]["gpus"]]


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


# --------------------------------------------------------------------------------------
# (b) The database machine: run_pass, usage records and the webhook's reads and writes
# --------------------------------------------------------------------------------------

DB_CLASSES = {"h100": (H100, 1, {}), "h100-pair": (H100, 2, dict(POOL)), "a10": (A10, 1, {})}
DB_TENANTS = ("team-a", "team-b")
#: The mirrored kinds the database machine injects a malformed object of (MALFORMED below).
MALFORMED_KINDS = ("GPU", "GPUBudget", "GPUClass", "Namespace", "Node", "Pod", "VirtualMachineInstance")


class DatabaseMachine(RuleBasedStateMachine):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        clock.now = shapes.NOW
        self.savepoint = transaction.savepoint_create()
        self.counter = 0
        self.nodes: dict[str, dict[str, Any]] = {}
        self.limits: dict[str, dict[str, int]] = {}
        self.held: Counter[tuple[str, str]] = Counter()
        self.integral: Counter[tuple[str, str]] = Counter()  # unit-seconds per (namespace, budget key)
        #: The holdings the last full pass recorded (None: no full pass yet). A device an
        #: answer pass binds is billed from that pass (its ``since``) once a full pass has
        #: recorded the cluster; whatever stopped holding meanwhile (a deleted device, a
        #: pod's raw usage) stays billed until the next full pass, which closes it at its time.
        self.recorded: Counter[Held] | None = None
        #: Records are written by full passes only, so until the next one the open records
        #: bill what the last full pass recorded (``billed``); the next full pass then dates
        #: the changes in between back to when they happened. ``integral`` holds the true
        #: unit-seconds up to the last full pass; since then both are integrated apart.
        self.billed: Counter[tuple[str, str]] = Counter()
        self.full_time = shapes.NOW  # when the last full pass ran (read once ``recorded`` is set)
        self.answer_changed = False  # an answer pass changed holdings since the last full pass
        self.held_since_full: Counter[tuple[str, str]] = Counter()
        self.billed_since_full: Counter[tuple[str, str]] = Counter()
        self.closed: dict[int, dict[str, Any]] = {}
        self.rows_before: list[dict[str, Any]] = []
        self.kind = ""
        self.before: tuple[Device, ...] = ()
        self.calls: dict[SetKey, Call] = {}
        self.running: dict[SetKey, tuple[str, str]] = {}  # set -> (launcher uid, node)
        self.since_full = 0  # steps since the last full pass
        self.split = False  # an edit moved a device into another set; the next full pass gathers it
        # Two pass workers, each with its in-memory state, taking turns; every
        # other pass of a worker also runs its verification (from scratch, compared).
        self.workers = (ClusterState(), ClusterState())
        self.turn = 0
        self.passes = 0
        objects: list[dict[str, Any]] = [shapes.namespace_obj(ns) for ns in DB_TENANTS]
        objects += [shapes.class_obj(name, r, u, s) for name, (r, u, s) in DB_CLASSES.items()]
        load_objects(objects)
        for alloc, pooled in (({H100: 4, A10: 2}, True), ({H100: 4}, False), ({A10: 2}, False)):
            self.node_spec(self.fresh("node-"), allocatable=alloc, labels=dict(POOL) if pooled else {})
        self.limits["team-a"] = {"h100": 4, H100: 6}
        load_objects([shapes.budget_obj("team-a", self.limits["team-a"])])
        # A snapshot of a live cluster: one set already Bound (no record until the first full
        # pass, which opens it at its own time), and one order waiting.
        self.add_devices("team-b", "vm-0", ["a10"], phase="Bound", node="node-1")
        self.add_devices("team-a", self.fresh("vm-"), ["h100", "h100"])

    def teardown(self) -> None:
        transaction.savepoint_rollback(self.savepoint)

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def begin(self, dt: int) -> None:
        STEPS["db"] += 1
        for key, units in self.held.items():
            self.held_since_full[key] += units * dt
        for key, units in self.billed.items():
            self.billed_since_full[key] += units * dt
        self.clock.advance(seconds=dt)
        self.since_full += 1
        if self.since_full > RESYNC_STEPS:
            self.before = self.cluster().devices
            self.run(models.PassKind.FULL)  # the periodic resync pass
        self.rows_before = records()
        self.before = self.cluster().devices
        self.kind = ""

    def cluster(self) -> Cluster:
        return read_cluster(self.clock.now)[0]

    def node_spec(self, name: str, **changes: Any) -> None:
        spec = self.nodes.setdefault(name, {"allocatable": {}, "labels": {}})
        spec.update(changes)
        load_objects([shapes.node_obj(name, **spec)])

    def set_keys(self) -> list[SetKey]:
        return sorted(set(models.GpuDevice.objects.values_list("namespace__name", "vm_name")))

    def node_names(self) -> list[str]:
        return sorted(models.Node.objects.values_list("name", flat=True))

    # -- changes -------------------------------------------------------------------------

    @rule(dt=DT, alloc=st.tuples(UNITS, UNITS))
    def node_added(self, dt: int, alloc: tuple[int, int]) -> None:
        self.begin(dt)
        self.node_spec(self.fresh("node-"), allocatable=dict(zip(RESOURCES, alloc, strict=True)))

    @rule(dt=DT, i=IDX)
    def node_deleted(self, dt: int, i: int) -> None:
        self.begin(dt)
        name = pick(self.node_names(), i)
        if name:
            models.Node.objects.filter(name=name).delete()
            self.nodes.pop(name, None)

    @rule(
        dt=DT,
        i=IDX,
        what=st.sampled_from(["shrink", "shrink", "grow", "not-ready", "long-not-ready", "ready", "drain", "cordon"]),
    )
    def node_changed(self, dt: int, i: int, what: str) -> None:
        self.begin(dt)
        name = pick(sorted(self.nodes), i)
        if not name:
            return
        spec = self.nodes[name]
        if what in ("shrink", "grow"):
            step = -1 if what == "shrink" else 2
            alloc = {r: max(0, n + step) for r, n in spec["allocatable"].items()}
            self.node_spec(name, allocatable=alloc)
        elif what in ("not-ready", "long-not-ready"):
            since = self.clock.now - timedelta(hours=2 if what == "long-not-ready" else 0)
            self.node_spec(name, ready=False, transition=stamp(since))
        elif what == "ready":
            self.node_spec(name, ready=True, transition=stamp(self.clock.now))
        elif what == "drain":
            labels = dict(spec["labels"])
            labels["gpuplane.io/drain"] = "false" if labels.get("gpuplane.io/drain") == "true" else "true"
            self.node_spec(name, labels=labels)
        else:
            self.node_spec(name, unschedulable=not spec.get("unschedulable", False))

    def add_devices(self, namespace: str, vm: str, classes: Iterable[str], **status: Any) -> None:
        now = stamp(self.clock.now)
        objects = []
        for class_name in classes:
            name = self.fresh(f"{vm}-gpu")
            objects.append(shapes.gpu_obj(namespace, name, class_name, vm, created=now, since=now, **status))
        load_objects(objects)

    @rule(dt=DT, t=IDX, c=IDX, size=st.integers(1, 3))
    def set_ordered(self, dt: int, t: int, c: int, size: int) -> None:
        self.begin(dt)
        self.add_devices(pick(DB_TENANTS, t), self.fresh("vm-"), [pick(sorted(DB_CLASSES), c)] * size)

    @rule(dt=DT, t=IDX, c=IDX, size=st.integers(1, 3))
    def vm_ordered_and_created(self, dt: int, t: int, c: int, size: int) -> None:
        """The usual flow: a tenant orders the GPUs of a VM and creates its VMI right away."""
        self.begin(dt)
        key = (pick(DB_TENANTS, t), self.fresh("vm-"))
        self.add_devices(*key, [pick(sorted(DB_CLASSES), c)] * size)
        self.create_vmi(key)

    @rule(dt=DT, s=IDX, c=IDX)
    def set_grown(self, dt: int, s: int, c: int) -> None:
        self.begin(dt)
        key = pick(self.set_keys(), s)
        if key:
            self.add_devices(key[0], key[1], [pick(sorted(DB_CLASSES), c)])

    @rule(dt=DT, s=IDX, whole=st.booleans())
    def set_deleted(self, dt: int, s: int, whole: bool) -> None:
        self.begin(dt)
        key = pick(self.set_keys(), s)
        if key:
            devices = models.GpuDevice.objects.filter(namespace__name=key[0], vm_name=key[1]).order_by("name")
            if whole:
                devices.delete()
            else:
                devices.first().delete()  # type: ignore[union-attr]

    @rule(dt=DT, s=IDX, m=IDX, c=IDX, to=st.none() | IDX)
    def device_edited(self, dt: int, s: int, m: int, c: int, to: int | None) -> None:
        """``spec.className`` or ``spec.vmName`` edited in place (see EngineMachine.device_edited)."""
        self.begin(dt)
        keys = self.set_keys()
        key = pick(keys, s)
        if key is None:
            return
        device = pick(list(models.GpuDevice.objects.filter(namespace__name=key[0], vm_name=key[1]).order_by("name")), m)
        if to is None:
            device.class_name = pick(sorted(DB_CLASSES), c)
        else:
            other = pick([k for k in keys if k[0] == key[0]], to)
            device.vm_name = other[1]
        device.save()
        self.before = self.cluster().devices  # an edit, not a placement: node growth counts from here
        self.split = self.split or bool(split_sets(self.before))

    @rule(dt=DT, t=IDX)
    def namespace_deleted(self, dt: int, t: int) -> None:
        """A tenant's namespace is deleted with everything in it; its records close at
        the next full pass. Objects loaded into it later create it again."""
        self.begin(dt)
        namespace = pick(DB_TENANTS, t)
        models.Namespace.objects.filter(name=namespace).delete()
        self.limits.pop(namespace, None)
        for mapping in (self.running, self.calls):
            for key in [k for k in mapping if k[0] == namespace]:
                del mapping[key]

    @rule(dt=DT, t=IDX, k=IDX, limit=LIMIT)
    def budget_changed(self, dt: int, t: int, k: int, limit: int | None) -> None:
        self.begin(dt)
        namespace = pick(DB_TENANTS, t)
        key = pick(sorted(DB_CLASSES) + list(RESOURCES), k)
        limits = self.limits.setdefault(namespace, {})
        if limit is None:
            limits.pop(key, None)
        else:
            limits[key] = limit
        load_objects([shapes.budget_obj(namespace, limits)])

    @rule(dt=DT, c=IDX, what=st.sampled_from(["delete", "restore", "units"]))
    def class_changed(self, dt: int, c: int, what: str) -> None:
        self.begin(dt)
        name = pick(sorted(DB_CLASSES), c)
        if what == "delete":
            models.GpuClass.objects.filter(name=name).delete()
        elif what == "restore" and not models.GpuClass.objects.filter(name=name).exists():
            resource, units, selector = DB_CLASSES[name]
            load_objects([shapes.class_obj(name, resource, units, selector)])
        elif what == "units":
            for cls in models.GpuClass.objects.filter(name=name):
                cls.units_per_device = 3 - cls.units_per_device
                cls.save()

    @rule(dt=DT, s=IDX, n=IDX, r=IDX, units=st.integers(1, 3))
    def forged_pod(self, dt: int, s: int, n: int, r: int, units: int) -> None:
        self.begin(dt)
        key = pick(self.set_keys(), s)
        node = pick(self.node_names(), n) or ""
        if key:
            owner = shapes.vmi_obj(key[0], key[1], [], {}, "")
            load_objects([shapes.launcher_obj(owner, RESOURCES[r % 2], units, node, uid=shapes.new_uid())])

    @rule(dt=DT, t=IDX, n=IDX, r=IDX, units=st.integers(1, 3))
    def raw_pod(self, dt: int, t: int, n: int, r: int, units: int) -> None:
        self.begin(dt)
        node = pick(self.node_names(), n) or ""
        name = self.fresh("trainer-")
        load_objects([shapes.plain_pod_obj(pick(DB_TENANTS, t), name, RESOURCES[r % 2], units, node)])

    @rule(dt=DT, p=IDX, delete=st.booleans())
    def pod_finished(self, dt: int, p: int, delete: bool) -> None:
        self.begin(dt)
        pods = models.Pod.objects.order_by("namespace__name", "name")
        pod = pick(list(pods), p)
        if pod is None:
            return
        if delete:
            pod.delete()
        else:
            models.Pod.objects.filter(pk=pod.pk).update(phase="Succeeded")

    # -- VMIs through the webhook's own reads and writes ---------------------------------

    @rule(dt=DT, s=IDX)
    def vmi_created(self, dt: int, s: int) -> None:
        self.begin(dt)
        key = pick(self.set_keys(), s)
        if key is not None:
            self.create_vmi(key)

    def create_vmi(self, key: SetKey) -> None:
        """The webhook's decision on the mirror, and its bind-request write (``bind_and_wait``)."""
        if key in self.running or key in self.calls:
            return
        namespace, vm = key
        names = sorted(
            models.GpuDevice.objects.filter(namespace__name=namespace, vm_name=vm).values_list("name", flat=True)
        )
        vmi = new_vmi(namespace, vm, names)
        uid = self.fresh("request-")
        body = admission_review(vmi, uid)
        view = binding.mirror_view(namespace)
        verdict = decide(body, view)
        members = [d for d in view.devices if d.vm_name == vm]
        node = whole_bound_node(members)
        if node is not None and all(d.class_name in {c.name for c in view.classes} for d in members):
            assert verdict.action is Action.PATCH and verdict.node == node, verdict
            self.start_vmi(key, vmi, verdict)
        elif verdict.action is Action.BIND:
            # What bind_and_wait writes before it waits for the answer pass.
            written = models.GpuDevice.objects.filter(namespace__name=namespace, vm_name=vm, name__in=names).update(
                bind_request=uid, bind_requested_at=self.clock.now
            )
            assert written == len(names)
            self.calls[key] = Call(parse_review(body), tuple(names), uid, view, vmi)
        else:
            assert verdict.action is Action.DENY, verdict

    def start_vmi(self, key: SetKey, vmi: dict[str, Any], verdict: Verdict) -> None:
        node, requests = patched(vmi, verdict)
        uid = shapes.new_uid()
        names = [n.removeprefix("gpuplane.io/") for n in vmi_devices(vmi)]
        running = shapes.vmi_obj(key[0], key[1], names, {uid: node}, node)
        load_objects([running, launcher_pod_obj(running, requests, node, uid)])
        self.running[key] = (uid, node)

    def conclude_calls(self) -> None:
        for key, call in sorted(self.calls.items()):
            answers = binding.answers_of(call.review, call.names, call.request)
            if answers is None:
                continue
            del self.calls[key]
            if isinstance(answers, Verdict):
                continue  # a device was deleted: denied, "try again"
            verdict = conclude(call.review, call.view, answers)
            devices = [d for d in self.cluster().devices if d.set_key == key and d.name in call.names]
            if verdict.action is Action.PATCH:
                assert whole_bound_node(devices) == verdict.node, (verdict, devices)
                self.start_vmi(key, call.vmi, verdict)
            else:
                assert verdict.action is Action.DENY, verdict

    @rule(dt=DT, s=IDX, n=IDX)
    def vmi_migrating(self, dt: int, s: int, n: int) -> None:
        self.begin(dt)
        key = pick(sorted(self.running), s)
        if key is None:
            return
        source_uid, source_node = self.running[key]
        target = pick([name for name in self.node_names() if name != source_node], n)
        source = models.Pod.objects.filter(uid=source_uid).first()
        vmi = models.VirtualMachineInstance.objects.filter(namespace__name=key[0], name=key[1]).first()
        if target is None or source is None or vmi is None or len(vmi.active_pods) != 1 or not source.gpu_requests:
            return
        uid = shapes.new_uid()
        obj = shapes.vmi_obj(key[0], key[1], [], {source_uid: source_node, uid: target}, source_node)
        obj["spec"]["domain"]["devices"]["gpus"] = [{"deviceName": n, "name": f"gpu{i}"}
                                                    for i, n in enumerate(vmi.device_names)]  # fmt: skip
        load_objects([obj, launcher_pod_obj(obj, source.gpu_requests, target, uid)])
        self.running[key] = (uid, target)

    @rule(dt=DT, s=IDX)
    def vmi_ended(self, dt: int, s: int) -> None:
        self.begin(dt)
        key = pick(sorted(self.running), s)
        if key is None:
            return
        del self.running[key]
        vmi = models.VirtualMachineInstance.objects.filter(namespace__name=key[0], name=key[1]).first()
        if vmi is not None:
            models.Pod.objects.filter(uid__in=list(vmi.active_pods)).update(phase="Succeeded")
            vmi.delete()

    # -- passes --------------------------------------------------------------------------

    @rule(dt=DT, kind=st.sampled_from(MALFORMED_KINDS), i=IDX, via_snapshot=st.booleans())
    def malformed_object_arrives(self, dt: int, kind: str, i: int, via_snapshot: bool) -> None:
        """A hostile tenant's (or a broken controller's) object of each kind that does not
        parse (a NUL, a lone surrogate, a count past the columns, a bind request over 128
        characters), for an object the mirror has or a new one. From the cluster
        (a watch event) it is refused and its row keeps its last good state, marked; in a
        snapshot the whole file is refused. Either way the mirror's state is unchanged, and
        the full pass after it runs and keeps every invariant."""
        self.begin(dt)
        STEPS["malformed"] += 1
        obj = MALFORMED[kind](self, i)
        state = unordered(self.cluster())
        if via_snapshot:
            with pytest.raises(SnapshotError):
                load_objects([obj])
        else:
            applied = mirror_event(kind, "MODIFIED", obj)
            assert applied.invalid == 1 and not applied.changed, applied
            rows = MIRROR_MODELS[kind].objects.filter(name=obj["metadata"]["name"])
            if kube_client.RESOURCES[kind].namespaced:
                rows = rows.filter(namespace__name=obj["metadata"]["namespace"])
            if rows.exists():
                assert rows.exclude(parse_error="").exists()  # kept, marked
        assert unordered(self.cluster()) == state  # row order may change (PostgreSQL's UPDATE), nothing else
        self.run(models.PassKind.FULL)

    @rule(dt=DT)
    def full_pass_on_event(self, dt: int) -> None:
        self.begin(dt)
        self.run(models.PassKind.FULL)

    @rule(dt=DT)
    def full_pass_on_resync(self, dt: int) -> None:
        self.begin(dt)
        self.run(models.PassKind.FULL)

    @rule(dt=DT)
    def answer_pass_for_webhook(self, dt: int) -> None:
        self.begin(dt)
        self.run(models.PassKind.ANSWER)

    # -- the incremental worker's own steps --------------------------------------

    @rule(dt=DT)
    def workers_take_turns(self, dt: int) -> None:
        """The other worker runs the next pass: it must rebuild, and so must this one after it."""
        self.begin(dt)
        self.turn ^= 1

    @rule(dt=DT)
    def feed_reset(self, dt: int) -> None:
        """The change feed starts again from position 1: every worker must read everything again."""
        self.begin(dt)
        models.Change.objects.all().delete()
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("ALTER SEQUENCE binder_change_position_seq RESTART WITH 1")
            else:
                cursor.execute("UPDATE sqlite_sequence SET seq = 0 WHERE name = 'binder_change'")

    @rule(dt=DT, s=IDX, m=IDX, c=IDX, vm=st.booleans())
    def device_recreated(self, dt: int, s: int, m: int, c: int, vm: bool) -> None:
        """A device deleted and created again under the same name (a new row), maybe for a
        new VM or class: the worker must not confuse the new object with the old one."""
        self.begin(dt)
        key = pick(self.set_keys(), s)
        if key is None:
            return
        device = pick(list(models.GpuDevice.objects.filter(namespace__name=key[0], vm_name=key[1]).order_by("name")), m)
        device.delete()
        now = stamp(self.clock.now)
        vm_name = self.fresh("vm-") if vm else key[1]
        load_objects([shapes.gpu_obj(key[0], device.name, pick(sorted(DB_CLASSES), c), vm_name, created=now)])

    def run(self, kind: str) -> None:
        before = self.cluster()
        # The from-scratch path, side by side: the engine on a fresh read of the same database.
        scratch = (full_pass if kind == models.PassKind.FULL else answer_pass)(before)
        worker = self.workers[self.turn]
        self.passes += 1
        with override_settings(GPUPLANE_VERIFY_SECONDS=0 if self.passes % 2 else 10**9):
            pass_run = run_pass(kind, worker)
        after = self.cluster()
        problems = self.side_by_side(worker, pass_run, before, after, scratch)
        assert not problems, "\n".join(problems)
        self.kind = kind
        if kind == models.PassKind.FULL:
            self.since_full = 0
            self.split = False
        classes = {c.name: c for c in after.classes}
        vmis = {(v.namespace, v.name): v for v in after.vmis}
        used_before = tenant_usage(before.devices, classes, before.pods, vmis)
        used_after = tenant_usage(after.devices, classes, after.pods, vmis)
        problems = budget_problems(DB_TENANTS, used_before, used_after, limits_of(after))
        allocatable = {n.name: n.allocatable for n in after.nodes}
        if kind == models.PassKind.FULL:
            booked = device_units_on_nodes(after.devices, classes)
            problems += [
                f"node {node} {r}: devices {units} > allocatable {allocatable[node].get(r, 0)}"
                for node, per in sorted(booked.items())
                for r, units in sorted(per.items())
                if node in allocatable and units > allocatable[node].get(r, 0)
            ]
            problems += [f"device {d.key} Bound on missing node {d.node}" for d in after.devices
                         if d.phase is Phase.BOUND and d.node not in allocatable]  # fmt: skip
            problems += [f"held device {d.key} of missing class" for d in after.devices
                         if d.held and d.class_name not in classes]  # fmt: skip
            expected = expected_holdings(after.devices, classes, after.pods, vmis)
            got = Counter(holding_of_row(r) for r in records() if r["end"] is None)
            if got != expected:
                problems.append(f"open records differ from holdings: extra {got - expected}, missing {expected - got}")
            self.held = self.billed = units_by_budget_key(expected)
            self.recorded, self.full_time = expected, self.clock.now
            self.integral += self.held_since_full
            self.held_since_full, self.billed_since_full = Counter(), Counter()
            if self.answer_changed:
                # Answer passes changed holdings since the last full pass: this pass dated
                # them back (a set's ``since``); start integrating afresh from what the
                # records now say, exactly as before while no answer pass changes anything.
                self.integral = Counter(
                    {
                        (namespace, key): hours * 3600
                        for namespace in DB_TENANTS
                        for key, hours in queries.gpu_hours(
                            namespace, shapes.NOW - timedelta(days=1), self.clock.now, self.clock.now
                        ).per_key.items()
                    }
                )
                self.answer_changed = False
            for namespace in DB_TENANTS:  # the tenant usage API's current usage agrees
                api_usage = queries.current_usage(namespace)[0]
                if Counter(api_usage) != +used_after[namespace]:
                    problems.append(f"usage API {namespace}: {api_usage} != {dict(+used_after[namespace])}")
        else:
            problems += grown_over_allocatable(before.devices, after.devices, classes, allocatable)
            if self.recorded is not None:
                # Changes dated by their ``since`` (set by a pass since the last full pass)
                # replace the device's recorded holding from then; others (a class edited
                # under a device that stood still) wait for the next full pass's time.
                dated = [d for d in after.devices if d.since is not None and d.since >= self.full_time]
                new = expected_holdings(dated, classes, (), vmis) - self.recorded
                replaced = {(h[1], h[2]) for h in new if h[0] == "GPU"}
                kept = Counter(
                    {h: n for h, n in self.recorded.items() if h[0] != "GPU" or (h[1], h[2]) not in replaced}
                )
                self.held = units_by_budget_key(kept + new)
                # The dated changes' own rules are tested in test_pending_usage_since; here
                # the model only follows what the records bill until the next full pass.
                self.answer_changed = self.answer_changed or bool(new)
        assert not problems, "\n".join(problems)
        self.conclude_calls()

    def side_by_side(
        self, worker: ClusterState, pass_run: models.PassRun, before: Cluster, after: Cluster, scratch: PassResult
    ) -> list[str]:
        """The incremental pass decided exactly what the from-scratch engine did, and the
        worker's state (records and ledger) is exactly a rebuild of the database's."""
        problems = []
        if pass_run.verify_mismatches:
            problems.append(f"verification found {pass_run.verify_mismatches} differences")
        want = {d.key: d for d in before.devices} | {d.key: d for d in scratch.devices}
        got = {d.key: d for d in after.devices}
        problems += [f"device {k}: pass {got.get(k)} != from scratch {want.get(k)}"
                     for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]  # fmt: skip
        decisions = Counter(
            models.Decision.objects.filter(pass_run=pass_run).values_list(
                "namespace", "device_name", "vm_name", "from_phase", "from_node", "to_phase", "to_node", "reason"
            )
        )
        expected = Counter((c.namespace, c.name, c.vm_name, c.from_phase.value, c.from_node, c.to_phase.value,
                            c.to_node, c.reason) for c in scratch.changes)  # fmt: skip
        if decisions != expected:
            problems.append(f"decisions: pass {decisions} != from scratch {expected}")
        rebuilt = ClusterState()
        rebuilt.rebuild("side by side")
        problems += compare_records(worker, rebuilt)
        if ledger_view(worker.ledger()) != ledger_view(rebuilt.ledger()):
            problems.append(f"ledger: worker {ledger_view(worker.ledger())} != rebuilt {ledger_view(rebuilt.ledger())}")
        return problems

    # -- invariants after every step -----------------------------------------------------

    @invariant()
    def records_are_append_only(self) -> None:
        rows = {r["id"]: r for r in records()}
        for record_id, row in self.closed.items():
            assert rows.get(record_id) == row, f"closed record {record_id} changed: {row} -> {rows.get(record_id)}"
        self.closed.update((r["id"], r) for r in rows.values() if r["end"] is not None)
        if self.kind != models.PassKind.FULL:
            assert list(rows.values()) == self.rows_before, f"a {self.kind or 'change'} step changed usage records"
        for r in rows.values():
            if r["subject_kind"] == "GPU" and r["end"] is None:
                same = [o for o in rows.values() if o["end"] is None and o["subject_kind"] == "GPU"
                        and (o["namespace"], o["subject"]) == (r["namespace"], r["subject"])]  # fmt: skip
                assert len(same) == 1, f"{len(same)} open records for device {r['namespace']}/{r['subject']}"

    @invariant()
    def sets_are_whole(self) -> None:
        if not self.split:
            problems = split_sets(self.cluster().devices)
            assert not problems, problems

    @invariant()
    def no_node_newly_over_booked(self) -> None:
        if self.kind != models.PassKind.FULL:  # a full pass is checked strictly in ``run``
            cluster = self.cluster()
            classes = {c.name: c for c in cluster.classes}
            allocatable = {n.name: n.allocatable for n in cluster.nodes}
            problems = grown_over_allocatable(self.before, cluster.devices, classes, allocatable)
            assert not problems, problems

    @invariant()
    def gpu_hours_are_the_integral_of_held_units(self) -> None:
        now = self.clock.now
        for namespace in DB_TENANTS:
            hours = queries.gpu_hours(namespace, shapes.NOW - timedelta(days=1), now, now).per_key
            if self.answer_changed:
                return  # dated back by the next full pass, which the model follows from there
            billed = self.integral + self.billed_since_full
            want = {k: units / 3600 for (ns, k), units in billed.items() if ns == namespace and units}
            got = {k: h for k, h in hours.items() if h > 1e-9}
            assert got == pytest.approx(want, rel=1e-9, abs=1e-6), (namespace, got, want)


def records() -> list[dict[str, Any]]:
    return list(UsageRecord.objects.order_by("id").values())


def ledger_view(ledger: Ledger) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Booked units per node and used units per tenant, zero entries dropped."""
    booked = {n: {r: u for r, u in sorted(c.items()) if u} for n, c in sorted(ledger.booked.items())}
    used = {ns: {k: u for k, u in sorted(c.items()) if u} for ns, c in sorted(ledger.used.items())}
    return ({n: c for n, c in booked.items() if c}, {ns: c for ns, c in used.items() if c})


def holding_of_row(row: Mapping[str, Any]) -> Held:
    ns, kind, subject, uid, key, resource, units, node, phase, vm, borrowed = (row[c] for c in HOLDING_COLUMNS)
    assert not borrowed, row  # no budget of this machine lends: nothing is ever borrowed
    return (kind, ns, subject, uid, key, resource, units, node, phase, vm)


def limits_of(cluster: Cluster) -> Any:
    budgets: dict[str, list[Budget]] = defaultdict(list)
    for budget in cluster.budgets:
        budgets[budget.namespace].append(budget)

    def limit(namespace: str, key: str) -> int | None:
        values = [b.limits[key] for b in budgets.get(namespace, []) if key in b.limits]
        if not budgets.get(namespace):
            return 0 if cluster.settings.default_budget is DefaultBudget.DENY else None
        return min(values) if values else None

    return limit


def unordered(cluster: Cluster) -> dict[str, Any]:
    """The cluster's fields, each collection as a sorted list (reads have no ORDER BY)."""
    return {
        f.name: sorted(value, key=repr) if isinstance(value := getattr(cluster, f.name), tuple | list) else value
        for f in dataclasses.fields(cluster)
    }


def _existing(model: Any, i: int, fields: tuple[str, ...]) -> tuple[Any, ...] | None:
    rows = sorted(model.objects.values_list(*fields))
    return pick(rows, i)


def _bad_namespace(m: DatabaseMachine, i: int) -> dict[str, Any]:
    return shapes.namespace_obj(pick(DB_TENANTS, i), labels={"team": "a\x00b"})


def _bad_node(m: DatabaseMachine, i: int) -> dict[str, Any]:
    obj = shapes.node_obj(pick(m.node_names(), i) or m.fresh("node-"), {H100: 1})
    obj["status"]["allocatable"][H100] = "1e5000"
    return obj


def _bad_class(m: DatabaseMachine, i: int) -> dict[str, Any]:
    obj = shapes.class_obj(pick(sorted(DB_CLASSES), i), H100)
    obj["spec"]["unitsPerDevice"] = "3e9"
    return obj


def _bad_gpu(m: DatabaseMachine, i: int) -> dict[str, Any]:
    row = _existing(models.GpuDevice, i, ("namespace__name", "name", "class_name", "vm_name"))
    ns, name, cls, vm = row or ("team-a", m.fresh("gpu-"), "h100", m.fresh("vm-"))
    obj = shapes.gpu_obj(ns, name, cls, vm)
    if i % 2:
        obj["spec"]["vmName"] = "x\x00y"
    else:
        obj["metadata"].setdefault("annotations", {})["gpuplane.io/bind-request"] = "r" * 129
    return obj


def _bad_budget(m: DatabaseMachine, i: int) -> dict[str, Any]:
    obj = shapes.budget_obj(pick(DB_TENANTS, i), {})
    obj["spec"]["limits"] = {"h100": "1e30"}
    return obj


def _bad_vmi(m: DatabaseMachine, i: int) -> dict[str, Any]:
    row = _existing(models.VirtualMachineInstance, i, ("namespace__name", "name"))
    ns, name = row or ("team-b", m.fresh("vm-"))
    return shapes.vmi_obj(ns, name, [], {"uid-1": "node-\ud800"}, "")


def _bad_pod(m: DatabaseMachine, i: int) -> dict[str, Any]:
    row = _existing(models.Pod, i, ("namespace__name", "name"))
    ns, name = row or ("team-b", m.fresh("pod-"))
    return shapes.plain_pod_obj(ns, name, A10, 1, "node-\x001")


#: One malformed object per mirrored kind, for the database machine's injection rule.
MALFORMED = {
    "Namespace": _bad_namespace,
    "Node": _bad_node,
    "GPUClass": _bad_class,
    "GPU": _bad_gpu,
    "GPUBudget": _bad_budget,
    "VirtualMachineInstance": _bad_vmi,
    "Pod": _bad_pod,
}
assert sorted(MALFORMED) == sorted(MALFORMED_KINDS)


@pytest.mark.slow
@pytest.mark.django_db
def test_database_machine(clock: Clock) -> None:
    STEPS["db"] = STEPS["malformed"] = 0
    started = time.perf_counter()
    run_state_machine_as_test(lambda: DatabaseMachine(clock), settings=DB_SETTINGS)
    elapsed = time.perf_counter() - started
    print(f"DatabaseMachine: {STEPS['db']} steps in {elapsed:.1f} s ({STEPS['malformed']} malformed objects)")
    assert STEPS["db"] >= DB_MIN_STEPS, f"only {STEPS['db']} steps ran"


def run_steps(machine: RuleBasedStateMachine, steps: list[tuple[str, dict[str, Any]]]) -> None:
    """Replay ``steps`` (rule name, arguments) on ``machine`` as hypothesis would, checking
    every invariant after each step, then tear it down."""
    checks = [getattr(machine, name) for name in ("records_are_append_only", "sets_are_whole",
              "no_node_newly_over_booked", "gpu_hours_are_the_integral_of_held_units")]  # fmt: skip
    try:
        for name, arguments in steps:
            getattr(machine, name)(**arguments)
            for check in checks:
                check()
    finally:
        machine.teardown()


@pytest.mark.django_db
def test_database_machine_raw_pod_recorded_by_one_worker_then_its_namespace_deleted(clock: Clock) -> None:
    """Seed 190912718520696747806031684246212754773's failure, shortened: worker 0 opens a
    team-b raw pod's record, team-b is deleted with its pods, and worker 1, whose last
    pass was before the pod existed, runs the next full pass: the record must close."""
    run_steps(
        DatabaseMachine(clock),
        [
            ("workers_take_turns", {"dt": 0}),
            ("full_pass_on_event", {"dt": 30}),  # worker 1's last pass before the pod
            ("workers_take_turns", {"dt": 0}),
            ("raw_pod", {"dt": 30, "t": 1, "n": 0, "r": 0, "units": 1}),
            ("full_pass_on_event", {"dt": 30}),  # worker 0 opens the pod's Raw record
            ("namespace_deleted", {"dt": 301, "t": 1}),
            ("workers_take_turns", {"dt": 0}),
            ("full_pass_on_event", {"dt": 30}),  # worker 1 follows the feed: the pod's row is gone
        ],
    )

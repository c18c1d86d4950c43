"""The database state machine: stateful property tests of run_pass, usage records and the webhook's reads and writes.

Two hypothesis rule-based state machines (this one and tests/system/test_stateful_engine.py)
change a cluster one step at a time (nodes come
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

The shared constants, strategies and expectations: harness/stateful.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from binder import models
from binder.engine.accounting import Ledger
from binder.engine.fit import refuses_new
from binder.engine.placement import answer_pass, full_pass
from binder.engine.types import (
    Budget,
    Cluster,
    DefaultBudget,
    Device,
    PassResult,
    Phase,
)
from binder.kube import client as kube_client
from binder.mirror.read import read_cluster
from binder.mirror.snapshot import SnapshotError, load_objects
from binder.mirror.write import MODELS as MIRROR_MODELS
from binder.mirror.write import mirror_event
from binder.runtime.passes import run_pass
from binder.runtime.state import ClusterState
from binder.runtime.usage_records import HOLDING_COLUMNS
from binder.runtime.verify import compare_records
from harness import shapes
from harness.clock import Clock
from harness.engine_invariants import (
    device_units_on_nodes,
    pick,
    tenant_usage,
)
from harness.stateful import (
    A10,
    DB_MIN_STEPS,
    DB_SETTINGS,
    DT,
    H100,
    IDX,
    LIMIT,
    POOL,
    RESOURCES,
    RESYNC_STEPS,
    STEPS,
    UNITS,
    Call,
    Held,
    SetKey,
    admission_review,
    budget_problems,
    expected_holdings,
    grown_over_allocatable,
    launcher_pod_obj,
    new_vmi,
    patched,
    split_sets,
    stamp,
    units_by_budget_key,
    vmi_devices,
    whole_bound_node,
)
from usage import queries
from usage.models import UsageRecord
from webhooks import binding
from webhooks.admission import Action, Verdict, conclude, decide, parse_review

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
        classes = {c.name: c for c in view.classes}
        found = view.index().nodes.get(node) if node is not None else None
        if node is not None and all(d.class_name in classes for d in members):
            if found is not None and refuses_new(found, [classes[d.class_name] for d in members]) is not None:
                # A node taking nothing new (NotReady past its grace, cordoned, ...) would not start the
                # launcher: refused, saying so (the engine machine checks the rule itself).
                assert verdict.action is Action.DENY and f"its GPUs are held on node {node}" in verdict.message
                return
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


@pytest.mark.django_db
@pytest.mark.parametrize("bound_by", ["full pass", "answer pass"])
def test_database_machine_device_bound_back_then_its_class_edited(clock: Clock, bound_by: str) -> None:
    """Seed 211871003203245138119602686894022728104's failure, shortened: team-b's a10
    device is deleted and created again under its name, and bound back to node-1, where
    its open record says it is (the record stays open, the device's ``since`` is the
    binding). An hour later the a10 class goes to 2 units per device: the next full pass
    must bill the new units from its own time, not from the binding an hour before."""
    bind: list[tuple[str, dict[str, Any]]] = (
        [("full_pass_on_event", {"dt": 30})]
        if bound_by == "full pass"
        else [("vmi_created", {"dt": 30, "s": 1}), ("answer_pass_for_webhook", {"dt": 30})]
    )
    run_steps(
        DatabaseMachine(clock),
        [
            ("full_pass_on_event", {"dt": 30}),  # opens team-b vm-0's record on node-1
            ("device_recreated", {"dt": 30, "s": 1, "m": 0, "c": 0, "vm": False}),
            *bind,  # back on node-1: the same holding, its record stays open
            ("class_changed", {"dt": 3600, "c": 0, "what": "units"}),  # a10: 1 -> 2 units per device
            ("full_pass_on_event", {"dt": 30}),
        ],
    )

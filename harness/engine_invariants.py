"""The pure engine's world and its invariants, computed independently.

tests/engine/test_properties.py drives random worlds through passes and tests/system/test_stateful_engine.py
runs its state machines over them; both check every pass with the functions here. The
accounting is written out again on purpose, with no engine Ledger: only ``launcher_of`` /
``raw_usage`` for the launcher rule (it has exactly one implementation). The
invariants, numbered as in tests/engine/test_properties.py, are one function each, so one engine
bug cannot hide another. Standard library and the engine only: no Django.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from binder.engine.accounting import ledger_for
from binder.engine.fit import NodeCache, is_settled
from binder.engine.launcher import launcher_of, raw_usage
from binder.engine.placement import answer_pass, full_pass
from binder.engine.types import (
    Budget,
    Cluster,
    DefaultBudget,
    Device,
    GpuClass,
    Node,
    PassResult,
    Phase,
    Pod,
    Settings,
    Vmi,
)

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
DRAIN = "gpuplane.io/drain"
RESOURCES = ("nvidia.com/GA100", "nvidia.com/GH100")
POOL_LABEL = "gpuplane.test/pool"
GHOST = "ghost"  # a class name that never exists
HELD = (Phase.BOUND, Phase.LOST)


# --------------------------------------------------------------------------------------
# The world the test mutates between passes
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class World:
    now: datetime
    catalogue: dict[str, GpuClass]  # every class ever defined (to restore deleted ones)
    classes: dict[str, GpuClass]  # classes that currently exist
    nodes: dict[str, Node]
    devices: dict[tuple[str, str], Device]
    budgets: dict[tuple[str, str], Budget]
    vmis: dict[tuple[str, str], Vmi]
    pods: dict[tuple[str, str], Pod]
    tenants: tuple[str, ...]
    settings: Settings
    counter: int = 0

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def cluster(self) -> Cluster:
        return Cluster(
            now=self.now,
            classes=tuple(self.classes[k] for k in sorted(self.classes)),
            nodes=tuple(self.nodes[k] for k in sorted(self.nodes)),
            devices=tuple(self.devices[k] for k in sorted(self.devices)),
            budgets=tuple(self.budgets[k] for k in sorted(self.budgets)),
            vmis=tuple(self.vmis[k] for k in sorted(self.vmis)),
            pods=tuple(self.pods[k] for k in sorted(self.pods)),
            settings=self.settings,
        )

    # -- views ---------------------------------------------------------------------------

    def set_keys(self) -> list[tuple[str, str]]:
        return sorted({d.set_key for d in self.devices.values()})

    def members(self, key: tuple[str, str]) -> list[Device]:
        return sorted((d for d in self.devices.values() if d.set_key == key), key=lambda d: d.name)

    def bound_sets(self) -> list[tuple[tuple[str, str], str]]:
        """Sets whose members are all Bound on one node, with that node."""
        out = []
        for key in self.set_keys():
            members = self.members(key)
            nodes = {d.node for d in members}
            if all(d.phase is Phase.BOUND for d in members) and len(nodes) == 1:
                out.append((key, nodes.pop()))
        return out


def pick(seq: list[Any] | tuple[Any, ...], index: int) -> Any:
    return seq[index % len(seq)] if seq else None


def merge(devices: Iterable[Device], result: PassResult) -> dict[tuple[str, str], Device]:
    """The state after a pass: the changed devices merged over the input by (namespace, name)."""
    state = {d.key: d for d in devices}
    for device in result.devices:
        assert device.key in state, f"pass returned a device that was not in its input: {device.key}"
        state[device.key] = device
    return state


# --------------------------------------------------------------------------------------
# Applying one change
# --------------------------------------------------------------------------------------


def class_for(world: World, choice: int) -> str:
    """Choice -1 is a class that does not exist; otherwise an index into the catalogue."""
    if choice < 0:
        return GHOST
    return pick(sorted(world.catalogue), choice)


def node_ref(world: World, ref: int) -> str | None:
    """A node by index, or (ref < 0) the node holding Bound set number -ref-1: changes aimed at
    the nodes that hold something find the interesting cases far more often."""
    if ref < 0:
        chosen = pick(world.bound_sets(), -ref - 1)
        if chosen and chosen[1] in world.nodes:
            return chosen[1]
    return pick(sorted(world.nodes), ref)


def set_ref(world: World, ref: int) -> tuple[str, str] | None:
    """A set by index, or (ref < 0) Bound set number -ref-1."""
    if ref < 0:
        chosen = pick(world.bound_sets(), -ref - 1)
        if chosen:
            return chosen[0]
    return pick(world.set_keys(), ref)


def add_devices(world: World, namespace: str, vm: str, classes: list[str]) -> None:
    for class_name in classes:
        name = world.fresh("g")
        world.devices[(namespace, name)] = Device(
            namespace=namespace,
            name=name,
            class_name=class_name,
            vm_name=vm,
            created=world.now + timedelta(microseconds=world.counter),
        )


def apply_op(world: World, op: tuple[Any, ...]) -> None:  # noqa: C901 - one branch per kind of change
    kind = op[0]
    node_names = sorted(world.nodes)
    if kind == "fail_node":
        _, i, long_ago = op
        name = node_ref(world, i)
        if name:
            since = world.now - timedelta(hours=2) if long_ago else world.now
            world.nodes[name] = dataclasses.replace(world.nodes[name], ready=False, ready_since=since)
    elif kind == "recover_node":
        name = node_ref(world, op[1])
        if name:
            world.nodes[name] = dataclasses.replace(world.nodes[name], ready=True, ready_since=world.now)
    elif kind == "delete_node":
        name = node_ref(world, op[1])
        if name:
            del world.nodes[name]
    elif kind == "add_node":
        _, alloc, pooled = op
        name = world.fresh("n")
        world.nodes[name] = Node(
            name=name,
            allocatable=dict(zip(RESOURCES, alloc, strict=True)),
            labels={POOL_LABEL: "fast"} if pooled else {},
        )
    elif kind == "allocatable":
        _, i, r, delta = op
        name = node_ref(world, i)
        if name:
            alloc = dict(world.nodes[name].allocatable)
            resource = RESOURCES[r % len(RESOURCES)]
            alloc[resource] = max(0, alloc.get(resource, 0) + delta)
            world.nodes[name] = dataclasses.replace(world.nodes[name], allocatable=alloc)
    elif kind == "drain":
        _, i, on = op
        name = node_ref(world, i)
        if name:
            labels = dict(world.nodes[name].labels)
            if on:
                labels[DRAIN] = "true"
            else:
                labels.pop(DRAIN, None)
            world.nodes[name] = dataclasses.replace(world.nodes[name], labels=labels)
    elif kind == "relabel":
        _, i, pooled = op
        name = node_ref(world, i)
        if name:
            labels = dict(world.nodes[name].labels)
            if pooled:
                labels[POOL_LABEL] = "fast"
            else:
                labels.pop(POOL_LABEL, None)
            world.nodes[name] = dataclasses.replace(world.nodes[name], labels=labels)
    elif kind == "cordon":
        _, i, on = op
        name = node_ref(world, i)
        if name:
            world.nodes[name] = dataclasses.replace(world.nodes[name], unschedulable=on)
    elif kind == "add_set":
        _, t, main, size, odd = op
        namespace = pick(world.tenants, t)
        classes = [class_for(world, main)] * size
        for position, choice in odd:
            classes[position % size] = class_for(world, choice)
        add_devices(world, namespace, world.fresh("vm"), classes)
    elif kind == "add_members":
        _, s, choices = op
        key = set_ref(world, s)
        if key:
            add_devices(world, key[0], key[1], [class_for(world, c) for c in choices])
    elif kind == "delete_set":
        key = pick(world.set_keys(), op[1])
        if key:
            for device in world.members(key):
                del world.devices[device.key]
    elif kind == "budget":
        _, t, b, key_choice, limit = op
        namespace = pick(world.tenants, t)
        keys = sorted(world.catalogue) + list(RESOURCES)
        budget_key = pick(keys, key_choice)
        name = f"b{b}"
        old = world.budgets.get((namespace, name))
        limits = dict(old.limits) if old else {}
        if limit is None:
            limits.pop(budget_key, None)
        else:
            limits[budget_key] = limit
        world.budgets[(namespace, name)] = Budget(namespace=namespace, name=name, limits=limits)
    elif kind == "drop_budget":
        _, t, b = op
        world.budgets.pop((pick(world.tenants, t), f"b{b}"), None)
    elif kind == "raw_pod":
        _, t, n, r, units, finished = op
        namespace = pick(world.tenants, t)
        node = "" if n < 0 else (pick(node_names, n) or "")
        name = world.fresh("raw")
        world.pods[(namespace, name)] = Pod(
            namespace=namespace,
            name=name,
            uid=f"uid-{name}",
            node=node,
            phase="Succeeded" if finished else "Running",
            requests={RESOURCES[r % len(RESOURCES)]: units},
        )
    elif kind == "launcher_pod":
        _, s, extra = op
        chosen = pick(world.bound_sets(), s)
        if chosen:
            (namespace, vm), node = chosen
            units: Counter[str] = Counter()
            for device in world.members((namespace, vm)):
                cls = world.classes.get(device.class_name)
                if cls:
                    units[cls.resource_name] += cls.units_per_device
            if units:
                first = sorted(units)[0]
                units[first] = max(0, units[first] + extra)
                name = world.fresh(f"virt-launcher-{vm}-")
                uid = f"uid-{name}"
                old = world.vmis.get((namespace, vm))
                world.vmis[(namespace, vm)] = Vmi(
                    namespace=namespace,
                    name=vm,
                    uid=old.uid if old else f"vmi-{vm}",
                    active_pods={uid: node},
                    node=node,
                    phase="Running",
                )
                world.pods[(namespace, name)] = Pod(
                    namespace=namespace,
                    name=name,
                    uid=uid,
                    node=node,
                    requests=dict(units),
                    owner_vmi=vm,
                )
    elif kind == "forged_pod":
        _, s, n, r, units = op
        key = pick(world.set_keys(), s)
        if key:
            namespace, vm = key
            if (namespace, vm) not in world.vmis:
                world.vmis[(namespace, vm)] = Vmi(namespace=namespace, name=vm, uid=f"vmi-{vm}", phase="Scheduling")
            name = world.fresh(f"forged-{vm}-")
            world.pods[(namespace, name)] = Pod(
                namespace=namespace,
                name=name,
                uid=f"uid-{name}",
                node=pick(node_names, n) or "",
                requests={RESOURCES[r % len(RESOURCES)]: units},
                owner_vmi=vm,
            )
    elif kind == "end_pod":
        _, p, delete = op
        key = pick(sorted(world.pods), p)
        if key:
            if delete:
                del world.pods[key]
            else:
                world.pods[key] = dataclasses.replace(world.pods[key], phase="Succeeded")
    elif kind == "half_fail":
        _, s, mask, to_node = op
        chosen = pick([c for c in world.bound_sets()], s)
        if chosen:
            key, node = chosen
            members = world.members(key)
            flip = [d for i, d in enumerate(members) if mask >> (i % 8) & 1] or members[:1]
            others = [n for n in node_names if n != node]
            dest = pick(others, to_node) if to_node is not None else None
            for device in flip:
                if dest:
                    moved = dataclasses.replace(device, phase=Phase.BOUND, node=dest, since=world.now)
                else:
                    moved = dataclasses.replace(device, phase=Phase.LOST, node="", since=world.now)
                world.devices[device.key] = moved
    elif kind == "bind_request":
        key = pick(world.set_keys(), op[1])
        if key:
            request = world.fresh("req-")
            for device in world.members(key):
                world.devices[device.key] = dataclasses.replace(device, bind_request=request)
    elif kind == "delete_class":
        name = pick(sorted(world.classes), op[1])
        if name:
            del world.classes[name]
    elif kind == "restore_class":
        missing = sorted(set(world.catalogue) - set(world.classes))
        name = pick(missing, op[1])
        if name:
            world.classes[name] = world.catalogue[name]
    else:  # pragma: no cover - strategy and switch disagree
        raise AssertionError(f"unknown op {kind}")


# --------------------------------------------------------------------------------------
# Independent accounting, written out here on purpose
# --------------------------------------------------------------------------------------


def tenant_usage(
    devices: Iterable[Device],
    classes: Mapping[str, GpuClass],
    pods: Iterable[Pod],
    vmis: Mapping[tuple[str, str], Vmi],
) -> dict[str, Counter[str]]:
    devices = list(devices)
    sets: dict[tuple[str, str], list[Device]] = defaultdict(list)
    for device in devices:
        sets[device.set_key].append(device)
    usage: dict[str, Counter[str]] = defaultdict(Counter)
    for device in devices:
        cls = classes.get(device.class_name)
        if cls is not None and device.phase in HELD:
            usage[device.namespace][cls.name] += cls.units_per_device
            usage[device.namespace][cls.resource_name] += cls.units_per_device
    for pod in pods:
        launcher = launcher_of(pod, lambda ns, name: vmis.get((ns, name)))
        members = sets.get((launcher.namespace, launcher.name), []) if launcher else []
        for resource, units in raw_usage(pod, launcher, members, classes).budget.items():
            usage[pod.namespace][resource] += units
    return usage


def limit_of(world: World, namespace: str, key: str) -> int | None:
    budgets = [b for b in world.budgets.values() if b.namespace == namespace]
    if not budgets:
        return 0 if world.settings.default_budget is DefaultBudget.DENY else None
    values = [b.limits[key] for b in budgets if key in b.limits]
    return min(values) if values else None


def device_units_on_nodes(devices: Iterable[Device], classes: Mapping[str, GpuClass]) -> dict[str, Counter[str]]:
    booked: dict[str, Counter[str]] = defaultdict(Counter)
    for device in devices:
        cls = classes.get(device.class_name)
        if cls is not None and device.phase is Phase.BOUND:
            booked[device.node][cls.resource_name] += cls.units_per_device
    return booked


# --------------------------------------------------------------------------------------
# The invariants, one function each (so one engine bug cannot hide another)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """One pass as the checks see it: the world, the input, the result, the next state."""

    world: World
    cluster: Cluster
    result: PassResult
    before: dict[tuple[str, str], Device]
    after: dict[tuple[str, str], Device]

    @classmethod
    def of(cls, world: World, cluster: Cluster, result: PassResult) -> Step:
        return cls(world, cluster, result, {d.key: d for d in cluster.devices}, merge(cluster.devices, result))

    def sets(self) -> dict[tuple[str, str], list[Device]]:
        sets: dict[tuple[str, str], list[Device]] = defaultdict(list)
        for device in self.after.values():
            sets[device.set_key].append(device)
        return dict(sorted(sets.items()))


def reordered(cluster: Cluster) -> Cluster:
    """The same state with every input tuple in reverse order."""
    return dataclasses.replace(
        cluster,
        classes=cluster.classes[::-1],
        nodes=cluster.nodes[::-1],
        devices=cluster.devices[::-1],
        budgets=cluster.budgets[::-1],
        vmis=cluster.vmis[::-1],
        pods=cluster.pods[::-1],
    )


def check_result_contract(step: Step) -> list[str]:
    """PassResult.devices holds only devices that changed, and only devices of the input."""
    return [
        f"contract: unchanged device {d.key} returned in PassResult.devices"
        for d in step.result.devices
        if d == step.before[d.key]
    ]


def check_over_booking(step: Step, only_grown: bool = False) -> list[str]:
    """1. For each existing node and resource, units of devices Bound there <= allocatable.

    ``only_grown`` (answer passes, which never move held sets): only nodes whose device
    units grew in the pass must fit.
    """
    classes = step.world.classes
    booked = device_units_on_nodes(step.after.values(), classes)
    earlier = device_units_on_nodes(step.before.values(), classes)
    launched_here: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for pod in step.cluster.pods:
        vmi = launcher_of(pod, lambda ns, name: step.world.vmis.get((ns, name)))
        if vmi is not None and not pod.finished:
            launched_here[pod.node].add((vmi.namespace, vmi.name))
    problems = []
    for node_name, per_resource in sorted(booked.items()):
        node = step.world.nodes.get(node_name)
        if node is None:
            continue  # check_bound_on_existing_nodes
        for resource, units in sorted(per_resource.items()):
            allocatable = node.allocatable.get(resource, 0)
            if units <= allocatable or (only_grown and units <= earlier[node_name][resource]):
                continue
            holders = sorted(
                {
                    d.vm_name + (" [its launcher pod runs here]" if d.set_key in launched_here[node_name] else "")
                    for d in step.after.values()
                    if d.phase is Phase.BOUND and d.node == node_name and d.class_name in classes
                }
            )
            problems.append(
                f"1 over-booked: node {node_name} {resource}: devices {units} > allocatable {allocatable} "
                f"(sets {holders})"
            )
    return problems


def node_booked(
    devices: Iterable[Device],
    classes: Mapping[str, GpuClass],
    pods: Iterable[Pod],
    vmis: Mapping[tuple[str, str], Vmi],
) -> dict[str, Counter[str]]:
    """A node's booked units: devices Bound there plus its pods' raw usage for capacity."""
    devices = list(devices)
    booked = device_units_on_nodes(devices, classes)
    sets: dict[tuple[str, str], list[Device]] = defaultdict(list)
    for device in devices:
        sets[device.set_key].append(device)
    for pod in pods:
        launcher = launcher_of(pod, lambda ns, name: vmis.get((ns, name)))
        members = sets.get((launcher.namespace, launcher.name), []) if launcher else []
        for resource, units in raw_usage(pod, launcher, members, classes).capacity.items():
            booked[pod.node][resource] += units
    return booked


def check_capacity_on_placement(step: Step) -> list[str]:
    """1b. Where a pass put more device units on a node, that node's booked units (devices and
    pods) fit its allocatable, unless its booked units did not grow (the
    binder re-checks capacity at bind time, pods included, forged launchers in full)."""
    world, classes, pods = step.world, step.world.classes, step.cluster.pods
    devices_before = device_units_on_nodes(step.before.values(), classes)
    devices_after = device_units_on_nodes(step.after.values(), classes)
    booked_before = node_booked(step.before.values(), classes, pods, world.vmis)
    booked_after = node_booked(step.after.values(), classes, pods, world.vmis)
    problems = []
    for node_name, per_resource in sorted(devices_after.items()):
        node = world.nodes.get(node_name)
        if node is None:
            continue
        for resource, units in sorted(per_resource.items()):
            booked, allocatable = booked_after[node_name][resource], node.allocatable.get(resource, 0)
            grown = units > devices_before[node_name][resource]
            if grown and booked > allocatable and booked > booked_before[node_name][resource]:
                problems.append(
                    f"1b placed onto a full node: {node_name} {resource} booked "
                    f"{booked_before[node_name][resource]} -> {booked} (devices "
                    f"{devices_before[node_name][resource]} -> {units}) > allocatable {allocatable}"
                )
    return problems


def check_whole_sets(step: Step) -> list[str]:
    """2a. The held members (Bound or Lost) of a set share one phase and, if Bound, one node."""
    problems = []
    for key, members in step.sets().items():
        held = [d for d in members if d.phase in HELD]
        if len({(d.phase, d.node if d.phase is Phase.BOUND else "") for d in held}) > 1:
            problems.append(f"2 split set {key}: {sorted((d.name, str(d.phase), d.node) for d in held)}")
    return problems


def check_pending_reasons(step: Step) -> list[str]:
    """2b. Pending members next to held ones carry a reason."""
    problems = []
    for key, members in step.sets().items():
        if any(d.phase in HELD for d in members):
            for device in members:
                if device.phase is Phase.PENDING and not device.reason:
                    missing = " [its class does not exist]" if device.class_name not in step.world.classes else ""
                    problems.append(f"2 Pending member {device.key}{missing} of held set {key} has no reason")
    return problems


def check_budgets(step: Step) -> list[str]:
    """3. A set bound in this pass did not take its tenant over a budget key whose usage grew."""
    world, classes, pods = step.world, step.world.classes, step.cluster.pods
    use_before = tenant_usage(step.before.values(), classes, pods, world.vmis)
    use_after = tenant_usage(step.after.values(), classes, pods, world.vmis)
    problems = []
    for key, members in step.sets().items():
        if not any(step.before[d.key].phase is Phase.PENDING and d.phase is Phase.BOUND for d in members):
            continue
        namespace = key[0]
        touched: set[str] = set()
        for device in members:
            cls = classes.get(device.class_name)
            if cls is not None:
                touched |= {cls.name, cls.resource_name}
        for budget_key in sorted(touched):
            limit = limit_of(world, namespace, budget_key)
            now_used, was_used = use_after[namespace][budget_key], use_before[namespace][budget_key]
            if limit is not None and now_used > limit and now_used > was_used:
                problems.append(
                    f"3 over budget: binding set {key} took {namespace} key {budget_key} "
                    f"from {was_used} to {now_used}, limit {limit}"
                )
    return problems


def check_determinism(step: Step) -> list[str]:
    """4. The same input gives the same PassResult; so does the same state in another order."""
    problems = []
    if full_pass(step.cluster) != step.result:
        problems.append("4 determinism: a second full_pass on the same input gave a different PassResult")
    if full_pass(reordered(step.cluster)) != step.result:
        problems.append("4 determinism: the same state with its inputs in another order gave another PassResult")
    return problems


def check_scoped_pass(step: Step) -> list[str]:
    """4b. A pass given only the sets that are not settled (``is_settled``, what a worker
    keeps between passes) decides exactly what a pass over every set decides."""
    cluster = step.cluster
    nodes = {n.name: n for n in cluster.nodes}
    classes = {c.name: c for c in cluster.classes}
    sets: dict[tuple[str, str], list[Device]] = defaultdict(list)
    for device in sorted(cluster.devices, key=lambda d: d.key):
        sets[device.set_key].append(device)
    scope = [key for key, members in sets.items() if not is_settled(members, nodes, classes)]
    scoped = full_pass(cluster, ledger_for(cluster), NodeCache(), scope=scope)
    if scoped == step.result:
        return []
    ours, theirs = {d.key: d for d in scoped.devices}, {d.key: d for d in step.result.devices}
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    return [
        f"4b scoped pass over {len(scope)} of {len(sets)} sets differs from the pass over all: "
        f"devices {[(k, ours.get(k), theirs.get(k)) for k in differ]!r}, "
        f"counts {scoped.counts!r} vs {step.result.counts!r}"
    ]


def check_bound_on_existing_nodes(step: Step) -> list[str]:
    """5a. Bound devices are only on nodes that exist."""
    return [
        f"5 device {d.key} Bound on missing node {d.node!r}"
        for d in step.after.values()
        if d.phase is Phase.BOUND and d.node not in step.world.nodes
    ]


def check_missing_classes(step: Step) -> list[str]:
    """5b. A device whose class does not exist is Pending, its reason saying the class does not exist."""
    return [
        f"5 device {d.key} of missing class {d.class_name}: phase {d.phase}, reason {d.reason!r}"
        for d in step.after.values()
        if d.class_name not in step.world.classes and (d.phase is not Phase.PENDING or "does not exist" not in d.reason)
    ]


def check_steady_state(step: Step) -> list[str]:
    """6. A second full pass right after (same now, nothing changed) moves no device."""
    again = full_pass(dataclasses.replace(step.cluster, devices=tuple(step.after[k] for k in sorted(step.after))))
    return [
        f"6 not steady: a second pass moved {(c.namespace, c.name)} of set {c.vm_name} "
        f"{c.from_phase}/{c.from_node or '-'} -> {c.to_phase}/{c.to_node or '-'} ({c.reason!r}); "
        f"after the first pass its reason was {step.after[(c.namespace, c.name)].reason!r}"
        for c in again.changes
    ]


def check_lost_before_orders(step: Step) -> list[str]:
    """8. Lost sets are rebound before any new order: no order bound in this
    pass sits on a node where a set still Lost would fit if that order were not there.

    Only sets without a launcher pod are judged (a launcher pod changes what a node can
    take for its set); "fits" is what step 4 asks of a node: Ready, schedulable, not
    draining, matching every class's nodeSelector, free units (devices and pods) for all."""
    world, classes = step.world, step.world.classes
    booked = node_booked(step.after.values(), classes, step.cluster.pods, world.vmis)
    launched = set()
    for pod in step.cluster.pods:
        vmi = launcher_of(pod, lambda ns, name: world.vmis.get((ns, name)))
        if vmi is not None:
            launched.add((vmi.namespace, vmi.name))
    problems = []
    sets = step.sets()
    for lost_key, lost_members in sets.items():
        held = [d for d in lost_members if d.phase in HELD and d.class_name in classes]
        if not held or any(d.phase is not Phase.LOST for d in held) or lost_key in launched:
            continue
        need: Counter[str] = Counter()
        for device in held:
            need[classes[device.class_name].resource_name] += classes[device.class_name].units_per_device
        for order_key, order_members in sets.items():
            if order_key in launched or not all(step.before[d.key].phase is Phase.PENDING for d in order_members):
                continue
            nodes = {d.node for d in order_members if d.phase is Phase.BOUND}
            if len(nodes) != 1:
                continue
            node = world.nodes.get(nodes.pop())
            if node is None or not node.ready or node.unschedulable or node.draining:
                continue
            if any(
                node.labels.get(label) != value
                for d in held
                for label, value in classes[d.class_name].node_selector.items()
            ):
                continue
            freed = device_units_on_nodes(order_members, classes)[node.name]
            if all(node.allocatable.get(r, 0) - booked[node.name][r] + freed[r] >= n for r, n in need.items()):
                problems.append(
                    f"8 order {order_key} was bound on {node.name} where Lost set {lost_key} "
                    f"({dict(need)}) would fit without it"
                )
    return problems


def check_answers(step: Step) -> list[str]:
    """7. After a full pass no bind request is unanswered, and each answer matches the set."""
    problems = []
    for key, members in step.sets().items():
        nodes = {d.node for d in members}
        whole = all(d.phase is Phase.BOUND for d in members) and len(nodes) == 1
        for device in members:
            if device.wants_answer:
                problems.append(f"7 bind request of {device.key} left unanswered")
            elif device.bind_request and device.answered_request != step.before[device.key].answered_request:
                if whole and device.answer != f"bound:{device.node}":
                    problems.append(f"7 {device.key} of Bound set {key} answered {device.answer!r}")
                if not whole and (not device.answer.startswith("refused:") or not device.answer[8:].strip()):
                    problems.append(f"7 {device.key} of unplaced set {key} answered {device.answer!r}")
    return problems


FULL_PASS_CHECKS = {
    "result_contract": check_result_contract,
    "over_booking": check_over_booking,
    "capacity_on_placement": check_capacity_on_placement,
    "whole_sets": check_whole_sets,
    "pending_reasons": check_pending_reasons,
    "budgets": check_budgets,
    "determinism": check_determinism,
    "scoped_pass": check_scoped_pass,
    "bound_on_existing_nodes": check_bound_on_existing_nodes,
    "missing_classes": check_missing_classes,
    "steady_state": check_steady_state,
    "answers": check_answers,
    "lost_before_orders": check_lost_before_orders,
}


def check_answer_pass(world: World, cluster: Cluster) -> list[str]:
    """The answer pass on the same input: it touches only requested sets, moves no held set,
    books no node beyond its devices' allocatable, keeps budgets and answers every request."""
    result = answer_pass(cluster)
    step = Step.of(world, cluster, result)
    problems = []
    if answer_pass(cluster) != result:
        problems.append("A determinism: answer_pass gave two results for one input")
    requested = {d.set_key for d in cluster.devices if d.wants_answer}
    for device in result.devices:
        old = step.before[device.key]
        if device.set_key not in requested:
            problems.append(f"A answer pass changed {device.key} of a set nobody asked about")
        if old.phase is Phase.BOUND and (device.phase, device.node) != (old.phase, old.node):
            problems.append(f"A answer pass moved Bound {device.key} {old.node} -> {device.phase}/{device.node}")
    problems += check_result_contract(step)
    problems += check_over_booking(step, only_grown=True)
    problems += check_capacity_on_placement(step)
    problems += check_budgets(step)
    problems += check_answers(step)
    return problems

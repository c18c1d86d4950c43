"""The compact engine records and ledger (issue 24, a 1M-device worker).

Records are built through ``quick_records``' ``__new__`` instead of the frozen
dataclass ``__init__``, and the ledger keeps each set's contribution as shared tuples
and builds itself in one loop per set: these tests hold both to what they replace.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import pickletools
import random
import zlib
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from binder.engine import types as e
from binder.engine.accounting import Ledger
from binder.engine.fit import is_settled
from binder.engine.launcher import RawUsage
from binder.engine.ledger_records import Holding
from binder.engine.limits import Limits
from binder.engine.types import Device, GpuClass, Node, Phase, Pod, Vmi

T0 = datetime(2026, 1, 1, tzinfo=UTC)

QUICK = (
    e.Taint,
    e.Toleration,
    e.GpuClass,
    e.Node,
    e.Device,
    e.Budget,
    e.Vmi,
    e.Pod,
    e.Change,
    Holding,
    Limits,
    RawUsage,
)


def _sample(cls: type, seed: int) -> dict[str, Any]:
    """Field values for ``cls`` that differ from its defaults (every field set)."""
    rng = random.Random(seed)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, Phase) or f.name in ("from_phase", "to_phase"):
            values[f.name] = Phase.LOST
        elif isinstance(default, bool):
            values[f.name] = not default
        elif f.name in ("since", "created", "ready_since"):
            values[f.name] = T0 + timedelta(seconds=rng.randrange(1000))
        elif f.name in ("units_per_device", "units", "toleration_seconds", "allocatable", "bound", "lost"):
            values[f.name] = rng.randrange(1, 9)
        elif f.name in ("device", "pod", "launcher", "taints", "tolerations"):
            values[f.name] = None if f.name in ("device", "pod", "launcher") else ()
        elif f.name == "choices" or f.name == "device_names":
            values[f.name] = (f"x{rng.randrange(99)}",)
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = {f"k{rng.randrange(99)}": rng.randrange(1, 9)}
        else:
            values[f.name] = f"v{rng.randrange(10_000)}"
    return values


@pytest.mark.parametrize("cls", QUICK, ids=lambda c: c.__name__)
def test_quick_records_construct_compare_and_pickle_as_the_dataclass(cls: type) -> None:
    values = _sample(cls, 1)
    record = cls(**values)
    positional = cls(*values.values())
    assert type(record) is cls
    assert {f.name: getattr(record, f.name) for f in dataclasses.fields(cls)} == values
    assert record == positional
    assert record != cls(**_sample(cls, 2))
    for twin in (pickle.loads(pickle.dumps(record)), copy.copy(record), copy.deepcopy(record)):  # noqa: S301
        assert type(twin) is cls
        assert twin == record
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, dataclasses.fields(cls)[0].name, "changed")
    replaced = dataclasses.replace(
        record, **{dataclasses.fields(cls)[-1].name: values[dataclasses.fields(cls)[-1].name]}
    )
    assert replaced == record


def test_quick_records_defaults_are_the_dataclass_defaults() -> None:
    device = Device("t1", "g1", "a10", "vm1")
    assert (device.phase, device.node, device.since, device.choices) == (Phase.PENDING, "", None, ())
    # A default factory gives each record its own value, as the dataclass did.
    assert device.bind_node_selector == {}
    assert device.bind_node_selector is not Device("t1", "g2", "a10", "vm1").bind_node_selector
    assert Device(namespace="t1", name="g1", class_name="a10", vm_name="vm1", node="n1").node == "n1"
    assert e.Toleration() == e.Toleration("", "Equal", "", "", None)


def test_quick_records_refuse_bad_arguments_as_a_constructor_does() -> None:
    with pytest.raises(TypeError, match="vm_name"):
        Device("t1", "g1", "a10")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="colour"):
        Device("t1", "g1", "a10", "vm1", colour="red")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        e.quick_records(Ledger)  # not a dataclass


def _cluster(
    seed: int,
) -> tuple[dict[str, GpuClass], dict[str, Node], dict[Any, tuple[Device, ...]], list[Pod], dict[Any, Vmi]]:
    """A random cluster with every case the ledger counts: Bound (on known, unknown and
    no nodes), Lost and Pending devices, an unknown class, launcher pods (finished too)
    and plain pods."""
    rng = random.Random(seed)
    classes = {
        c.name: c
        for c in (
            GpuClass("a10", "nvidia.com/a10", 1),
            GpuClass("a10x2", "nvidia.com/a10", 2),
            GpuClass("h100", "nvidia.com/h100", 1),
        )
    }
    nodes = {
        f"n{i}": Node(f"n{i}", {"nvidia.com/a10": rng.randrange(0, 9), "nvidia.com/h100": rng.randrange(0, 5)})
        for i in range(8)
    }
    places = [*nodes, "gone", ""]
    sets: dict[Any, tuple[Device, ...]] = {}
    vmis: dict[Any, Vmi] = {}
    pods: list[Pod] = []
    for s in range(60):
        ns, vm = f"t{s % 5}", f"vm{s}"
        members = []
        for d in range(rng.randrange(1, 5)):
            phase = rng.choice([Phase.BOUND, Phase.BOUND, Phase.LOST, Phase.PENDING])
            node = rng.choice(places) if phase is Phase.BOUND else ""
            cls = rng.choice([*classes, "nosuch"])
            members.append(Device(ns, f"{vm}-g{d}", cls, vm, phase, node, T0))
        sets[(ns, vm)] = tuple(sorted(members, key=lambda d: d.key))
        if rng.random() < 0.4:
            uid = f"uid-{s}"
            node = rng.choice(places)
            vmis[(ns, vm)] = Vmi(ns, vm, f"vmi-{s}", {uid: node}, node)
            requests = {"nvidia.com/a10": rng.randrange(0, 4), "nvidia.com/h100": rng.randrange(0, 2)}
            phase = rng.choice(["Running", "Running", "Succeeded"])
            pods.append(Pod(ns, f"virt-launcher-{vm}", uid, node, phase, requests, vm))
    for p in range(15):
        node = rng.choice(places)
        pods.append(Pod(f"t{p % 5}", f"plain-{p}", f"p-{p}", node, "Running", {"nvidia.com/a10": rng.randrange(1, 3)}))
    # A launcher whose set has no devices at all.
    vmis[("t0", "empty")] = Vmi("t0", "empty", "vmi-e", {"uid-e": "n1"}, "n1")
    pods.append(Pod("t0", "virt-launcher-empty", "uid-e", "n1", "Running", {"nvidia.com/h100": 1}, "empty"))
    return classes, nodes, sets, pods, vmis


def _contents(ledger: Ledger) -> dict[str, Any]:
    """What a ledger holds, comparable between two ledgers."""

    def counters(of: dict[Any, Counter[Any]]) -> dict[Any, dict[Any, int]]:
        # A commit leaves zero counts behind (as it always did): they read as zero.
        nonzero = {k: {r: n for r, n in v.items() if n} for k, v in of.items()}
        return {k: v for k, v in nonzero.items() if v}

    return {
        "booked": counters(ledger.booked),
        "device_booked": counters(ledger.device_booked),
        "used": counters(ledger.used),
        "class_held": counters(ledger.class_held),  # type: ignore[arg-type]
        "sets_on": {k: set(v) for k, v in ledger.sets_on.items() if v},
        "by_free": {r: {f: list(n) for f, n in b.items() if n} for r, b in ledger.by_free.items()},
        "contrib": {k: (dict(b), dict(u)) for k, (b, u) in ledger._contrib.items()},
        "devices": dict(ledger._devices),
        "over_booked": ledger.over_booked_nodes(),
        "holdings": ledger.holdings(),
    }


@pytest.mark.parametrize("seed", range(12))
def test_a_built_ledger_holds_what_committing_each_set_holds(seed: int) -> None:
    classes, nodes, sets, pods, vmis = _cluster(seed)
    built = Ledger(classes, nodes, sets, pods, vmis)
    # The same cluster committed set by set into a ledger that starts without devices.
    grown = Ledger(classes, nodes, {}, pods, vmis)
    for key in sorted(sets):
        grown.commit(key, sets[key])
    assert _contents(built) == _contents(grown)
    for key, members in sets.items():
        kept = built.contribution(key, members)
        assert (dict(built._contrib[key][0]), dict(built._contrib[key][1])) == (kept.booked, kept.used)


@pytest.mark.parametrize("seed", range(6))
def test_ledger_commits_and_deltas_match_a_fresh_build(seed: int) -> None:
    classes, nodes, sets, pods, vmis = _cluster(seed)
    ledger = Ledger(classes, nodes, sets, pods, vmis)
    rng = random.Random(seed)
    current = dict(sets)
    for _ in range(40):
        key = rng.choice(sorted(current))
        moved = tuple(
            dataclasses.replace(d, phase=Phase.BOUND, node=rng.choice([*nodes, ""]))
            if rng.random() < 0.5
            else dataclasses.replace(d, phase=rng.choice([Phase.LOST, Phase.PENDING]), node="")
            for d in current[key]
        )
        fresh = Ledger(classes, nodes, current, pods, vmis)
        delta = ledger.delta(key, moved)
        new, old = fresh.contribution(key, moved), fresh.contribution(key, current[key])
        want_booked = Counter(new.booked)
        want_booked.subtract(old.booked)
        want_used = Counter(new.used)
        want_used.subtract(old.used)
        assert delta.booked == want_booked
        assert delta.used == want_used
        assert ledger.used_delta(key, moved) == {k: v for k, v in want_used.items() if k in new.used or k in old.used}
        ledger.commit(key, moved)
        current[key] = moved
        assert _contents(ledger) == _contents(Ledger(classes, nodes, current, pods, vmis))
    assert _contents(ledger.copy()) == _contents(ledger)


def test_sets_of_the_same_shape_share_their_kept_usage() -> None:
    classes, nodes, _, _, _ = _cluster(0)
    sets = {("t1", f"vm{i}"): (Device("t1", f"g{i}", "a10", f"vm{i}", Phase.BOUND, f"n{i % 3}"),) for i in range(30)}
    ledger = Ledger(classes, nodes, sets, [], {})
    kept = [ledger._contrib[key] for key in sorted(sets)]
    assert len({id(used) for _, used in kept}) == 1
    assert len({id(slot) for booked, _ in kept for slot, _ in booked}) == 3
    assert sum(dict(booked).get(("n0", "nvidia.com/a10"), 0) for booked, _ in kept) == 10
    assert defaultdict(int, ledger.used["t1"]) == {"a10": 30, "nvidia.com/a10": 30}


def test_converted_devices_share_equal_neighbouring_times_only() -> None:
    from binder.mirror.convert import device_from

    def row(name: str, since: datetime | None, created: datetime | None) -> Device:
        return device_from("t1", name, "a10", "vm1", "Bound", "n1", since, "", "", "", "", created)

    first = row("g1", datetime(2026, 1, 1, 12, tzinfo=UTC), datetime(2026, 1, 1, 11, tzinfo=UTC))
    second = row("g2", datetime(2026, 1, 1, 12, tzinfo=UTC), datetime(2026, 1, 1, 11, tzinfo=UTC))
    assert second.since is first.since
    assert second.created is first.created
    # The same instant in another zone is equal but kept as given (it prints differently).
    other_zone = datetime(2026, 1, 1, 13, tzinfo=timezone(timedelta(hours=1)))
    third = row("g3", other_zone, None)
    assert third.since is other_zone
    assert third.created is None
    later = row("g4", T0, T0 + timedelta(seconds=1))
    assert (later.since, later.created) == (T0, T0 + timedelta(seconds=1))


@pytest.mark.parametrize("seed", range(6))
def test_settledness_does_not_depend_on_the_members_order(seed: int) -> None:
    # The worker's state asks it of each set's members unsorted.
    classes, nodes, sets, _, _ = _cluster(seed)
    rng = random.Random(seed)
    on_one = {
        key: tuple(dataclasses.replace(d, phase=Phase.BOUND, node=members[0].node or "n1") for d in members)
        for key, members in sets.items()
    }
    # Some nodes not Ready, draining or without a class's labels: each way of not keeping a set.
    nodes = {
        **nodes,
        "n1": dataclasses.replace(nodes["n1"], ready=False),
        "n2": dataclasses.replace(nodes["n2"], labels={"gpuplane.io/drain": "true"}),
    }
    classes = {**classes, "h100": dataclasses.replace(classes["h100"], node_selector={"gpu": "h100"})}
    nodes["n3"] = dataclasses.replace(nodes["n3"], labels={"gpu": "h100"})
    # Every node with every class, one class a set and two (in both orders).
    each = [
        tuple(Device("t1", f"{node}-{c}-{i}", c, f"{node}-{c}", Phase.BOUND, node) for i, c in enumerate(names))
        for node in [*nodes, "gone"]
        for names in ([c] * 2 for c in classes)
    ] + [
        (
            Device("t1", f"{node}-x", "a10", f"{node}-m-{c}", Phase.BOUND, node),
            Device("t1", f"{node}-y", c, f"{node}-m-{c}", Phase.BOUND, node),
        )
        for node in nodes
        for c in ("h100", "a10x2")
    ]
    keeps: dict[tuple[str, str], bool] = {}
    for members in [*sets.values(), *on_one.values(), *each, *on_one.values()]:
        shuffled = list(members)
        rng.shuffle(shuffled)
        settled = is_settled(members, nodes, classes)
        assert is_settled(shuffled, nodes, classes) == settled
        assert is_settled(shuffled, nodes, classes, keeps) == settled
    assert keeps
    settled_on = {members[0].vm_name for members in each if is_settled(members, nodes, classes, keeps)}
    assert {"n0-a10", "n0-a10x2", "n3-h100", "n3-a10", "n0-m-a10x2", "n3-m-h100"} <= settled_on
    assert not {"n0-h100", "n1-a10", "n2-a10", "gone-a10", "n0-m-h100", "n2-m-a10x2"} & settled_on
    assert any(is_settled(members, nodes, classes) for members in on_one.values())


def test_a_checkpoint_payload_keeps_its_records_shared_and_whole() -> None:
    from binder.runtime import checkpoint_payload

    classes, nodes, sets, pods, vmis = _cluster(3)
    devices = {i: d for i, d in enumerate(d for members in sets.values() for d in members)}
    # A device only the ledger knows (not among the records) is saved the ordinary way.
    stray = Device("t9", "stray", "a10", "vm9", Phase.BOUND, "n1", T0)
    ledger = Ledger(classes, nodes, {**sets, ("t9", "vm9"): (stray,)}, pods, vmis)
    payload = {
        "records": {
            "GPU": devices,
            "Node": dict(enumerate(nodes.values())),
            "Pod": dict(enumerate(pods)),
            "VirtualMachineInstance": dict(enumerate(vmis.values())),
            "GPUClass": dict(enumerate(classes.values())),
        },
        "members": {key: {d.name: d for d in members} for key, members in sets.items()},
        "ledger": ledger,
    }
    data = checkpoint_payload.dumps(payload)
    loaded = checkpoint_payload.loads(data)
    # The records are a table read by ``map``, referred to by row number: not a
    # constructor call each (whose argument tuples the unpickler's memo kept).
    stream = io.BytesIO(zlib.decompress(data))
    ops = Counter(op.name for _ in range(2) for op, _, _ in pickletools.genops(stream))
    assert ops["BINPERSID"] >= len(devices) + len(nodes)
    assert len(devices) > 100
    assert ops["REDUCE"] < len(devices) // 2  # the classes, Counters and the stray device
    assert loaded["records"] == payload["records"]
    assert _contents(loaded["ledger"]) == _contents(ledger)
    again = loaded["records"]["GPU"]
    for key, members in loaded["members"].items():
        for device in members.values():
            assert any(device is d for d in again.values())
        in_order = sorted(members.values(), key=lambda d: d.key)
        assert loaded["ledger"].devices(key) == tuple(in_order)
        assert all(a is b for a, b in zip(loaded["ledger"].devices(key), in_order, strict=True))
    assert loaded["ledger"].devices(("t9", "vm9")) == (stray,)
    by_name = {n.name: n for n in loaded["records"]["Node"].values()}
    assert all(loaded["ledger"].nodes[name] is node for name, node in by_name.items())
    # The table and the rest share their strings, as the saved objects did.
    assert all(d.namespace is key[0] for key, members in loaded["members"].items() for d in members.values())


def test_converted_nodes_and_pods_share_equal_unit_maps() -> None:
    from binder.mirror.convert import node_from, pod_from

    one = node_from("", "n1", {"nvidia.com/a10": "8"}, {}, False, True, None)
    two = node_from("", "n2", {"nvidia.com/a10": 8}, {}, False, True, None)
    other = node_from("", "n3", {"nvidia.com/a10": 4}, {}, False, True, None)
    assert one.allocatable == {"nvidia.com/a10": 8}
    assert two.allocatable is one.allocatable
    assert other.allocatable == {"nvidia.com/a10": 4}
    assert other.allocatable is not one.allocatable
    pods = [pod_from("t1", f"p{i}", f"u{i}", "n1", "Running", {"nvidia.com/a10": 2}, "") for i in range(3)]
    assert pods[0].requests == {"nvidia.com/a10": 2}
    assert pods[1].requests is pods[0].requests is pods[2].requests
    assert pod_from("t1", "p9", "u9", "n1", "Running", None, "").requests == {}

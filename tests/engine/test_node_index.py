"""The node index against the plain scan: the binder finds the fullest node with room for
a set through the ledger's free-units index and the node cache's eligible sets (kept
current as units are booked and freed and as nodes change), and must choose exactly the
node a sweep over every node would: among Ready, schedulable, undrained nodes matching
every class selector and the request's nodeSelector, tolerating the classes' taints and
with room for every resource, the one with the fewest free units left, ties by name.

Random clusters get random bookings, frees and node changes; after each, a random set is
placed both ways. The index is also compared with one built from scratch.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from binder.engine.accounting import build_ledger
from binder.engine.fit import NodeCache, refuses_new, requested_selector_mismatch
from binder.engine.placement import _Pass
from binder.engine.types import Cluster, Device, GpuClass, Node, Phase, Taint, Toleration

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RESOURCES = ("vendor.com/a", "vendor.com/b")
CLASSES = (
    GpuClass("small", RESOURCES[0], 1),
    GpuClass("big", RESOURCES[0], 2, node_selector={"pool": "x"}),
    GpuClass("other", RESOURCES[1], 1, tolerations=(Toleration(key="gpu", operator="Exists"),)),
)
CLASS_NAMES = tuple(c.name for c in CLASSES)

node_spec = st.fixed_dictionaries(
    {
        "a": st.integers(0, 6),
        "b": st.integers(0, 4),
        "pool": st.sampled_from(["x", "y", ""]),
        "ready": st.booleans() | st.just(True),
        "cordon": st.booleans().map(lambda b: b and False) | st.booleans(),
        "drain": st.sampled_from([False, False, False, True]),
        "taint": st.sampled_from([False, False, True]),
    }
)


def make_node(name: str, spec: dict[str, object]) -> Node:
    labels = {"pool": str(spec["pool"])} if spec["pool"] else {}
    if spec["drain"]:
        labels["gpuplane.io/drain"] = "true"
    allocatable = {r: int(spec[k]) for r, k in zip(RESOURCES, ("a", "b"), strict=True) if spec[k]}  # type: ignore[call-overload]
    return Node(
        name=name,
        allocatable=allocatable,
        labels=labels,
        unschedulable=bool(spec["cordon"]),
        ready=bool(spec["ready"]),
        ready_since=T0,
        taints=(Taint("gpu"),) if spec["taint"] else (),
    )


op = st.one_of(
    # book: a set of 1-3 devices Bound on a node (may over-book it)
    st.tuples(
        st.just("book"), st.integers(0, 11), st.integers(0, 9), st.lists(st.integers(0, 2), min_size=1, max_size=3)
    ),
    st.tuples(st.just("free"), st.integers(0, 11)),
    st.tuples(st.just("node"), st.integers(0, 11), node_spec),
    st.tuples(st.just("delete_node"), st.integers(0, 11)),
    st.tuples(
        st.just("place"),
        st.lists(st.integers(0, 2), min_size=1, max_size=3),
        st.sampled_from([{}, {}, {"pool": "x"}, {"pool": "y"}]),
    ),
)


def devices_of(
    key: tuple[str, str], classes: list[int], phase: Phase, node: str, selector: dict[str, str]
) -> tuple[Device, ...]:
    return tuple(
        Device(
            namespace=key[0],
            name=f"{key[1]}-{i}",
            class_name=CLASS_NAMES[c],
            vm_name=key[1],
            phase=phase,
            node=node,
            bind_request="req" if selector else "",
            bind_node_selector=selector,
        )
        for i, c in enumerate(classes)
    )


def plain_scan(
    nodes: dict[str, Node], sets: dict[tuple[str, str], tuple[Device, ...]], moving: tuple[Device, ...]
) -> str | None:
    """The rule read literally: every node, free units counted from every booking."""
    classes = {c.name: c for c in CLASSES}
    booked: Counter[tuple[str, str]] = Counter()
    for devices in sets.values():
        for d in devices:
            if d.phase is Phase.BOUND:
                booked[(d.node, classes[d.class_name].resource_name)] += classes[d.class_name].units_per_device
    need: Counter[str] = Counter()
    for d in moving:
        need[classes[d.class_name].resource_name] += classes[d.class_name].units_per_device
    used = [classes[n] for n in sorted({d.class_name for d in moving})]
    best: tuple[int, str] | None = None
    for name in sorted(nodes):
        node = nodes[name]
        if refuses_new(node, used) or requested_selector_mismatch(node, moving):
            continue
        left = 0
        for resource, units in need.items():
            after = node.allocatable.get(resource, 0) - booked[(name, resource)] - units
            if after < 0:
                break
            left += after
        else:
            if best is None or (left, name) < best:
                best = (left, name)
    return best[1] if best else None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(node_spec, min_size=1, max_size=10), st.lists(op, max_size=40))
def test_index_chooses_the_plain_scans_node(specs: list[dict[str, object]], ops: list[tuple]) -> None:  # type: ignore[type-arg]
    nodes = {f"n{i:02d}": make_node(f"n{i:02d}", spec) for i, spec in enumerate(specs)}
    sets: dict[tuple[str, str], tuple[Device, ...]] = {}
    ledger = build_ledger(classes=CLASSES, nodes=nodes.values(), devices=(), pods=(), vmis=())
    cache = NodeCache()
    placed = 0

    def engine() -> _Pass:
        cluster = Cluster(now=T0, classes=CLASSES, nodes=tuple(nodes.values()))
        return _Pass(cluster, ledger, cache, scope=())

    engine().place(("t", "warm"), devices_of(("t", "warm"), [0], Phase.PENDING, "", {}))
    for step in ops:
        if step[0] == "book":
            _, s, n, classes = step
            key = ("t", f"s{s}")
            sets[key] = devices_of(key, classes, Phase.BOUND, f"n{n:02d}", {})
            ledger.commit(key, sets[key])
        elif step[0] == "free":
            key = ("t", f"s{step[1]}")
            if key in sets:
                sets[key] = tuple(d for d in sets[key] if False)
                ledger.commit(key, ())
        elif step[0] in ("node", "delete_node"):
            name = f"n{step[1]:02d}"
            node = make_node(name, step[2]) if step[0] == "node" else None
            if node is None:
                nodes.pop(name, None)
            else:
                nodes[name] = node
            cache.node_changed(name, node)
            ledger.set_node(name, node)
        else:
            _, classes, selector = step
            placed += 1
            key = ("t", f"new{placed}")
            moving = devices_of(key, classes, Phase.PENDING, "", selector)
            assert engine().place(key, moving) == plain_scan(nodes, sets, moving), (moving, nodes)
    # The maintained index equals one built from scratch.
    fresh = build_ledger(
        classes=CLASSES, nodes=nodes.values(), devices=[d for ds in sets.values() for d in ds], pods=(), vmis=()
    )
    for resource in RESOURCES:
        # (A node freed back to nothing of a resource it lacks may keep an empty bucket 0.)
        ours = {f: names for f, names in ledger.by_free[resource].items() if f}
        assert ours == {f: names for f, names in fresh.by_free[resource].items() if f}
    cluster = Cluster(now=T0, classes=CLASSES, nodes=tuple(nodes.values()))
    fresh_cache = NodeCache()
    fresh_pass = _Pass(cluster, fresh, fresh_cache, scope=())
    for key, found in cache.eligible.items():
        assert found == fresh_cache.eligible_for(key, fresh_pass.classes)
    assert cache.node_names == sorted(nodes)

"""Property tests of making room (SPEC §4 "Making room") against plain sums.

Random clusters of one GPU class on nodes in two zones: held sets, each with or without a
VirtualMachine (its template maybe asking for a zone), a VMI (its VM runs), the keep-node
annotation or a recent admission; then orders of up to a whole node. One full pass, checked
with plain sums over the devices, no engine ledger or rule:

1. no set whose VM has a VMI moves, and no kept, recently admitted or VM-less set moves either;
2. no set is sent to Lost or Pending: every held device stays held, every moved one Bound;
3. usage and budgets are unchanged by a move: each held device keeps its class, and every
   tenant's usage of its devices held before the pass is what it was;
4. every waiting set a plan was made for is Bound after the pass, and the sets moved are
   exactly the plans' sets, within ``GPUPLANE_MOVES_PER_PASS``;
5. every destination satisfies the moved VM's template (its zone), and no node is over-booked;
6. the pass is deterministic.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from binder.engine import Cluster, full_pass
from binder.engine import types as e
from binder.engine.reasons import Code
from binder.engine.types import Requirement, Term
from harness.shapes import A10, NOW, gpu_class

A10_CLASS = gpu_class("a10", A10)

nodes_st = st.lists(st.tuples(st.sampled_from([4, 8, 8]), st.sampled_from(["a", "a", "b"])), min_size=2, max_size=5)
#: (size, node index, age in hours, VirtualMachine template: None, "" any zone, "a" or "b";
#: runs, keep-node, admitted minutes ago or None, zone by affinity instead of nodeSelector)
held_st = st.lists(
    st.tuples(
        st.integers(1, 4),
        st.integers(0, 4),
        st.integers(0, 50),
        st.sampled_from([None, "", "", "", "a", "b"]),
        st.sampled_from([False, False, False, True]),
        st.sampled_from([False, False, False, False, False, True]),
        st.sampled_from([None, None, None, 1, 10]),
        st.booleans(),
    ),
    max_size=14,
)
orders_st = st.lists(st.tuples(st.integers(2, 8), st.integers(0, 50)), min_size=1, max_size=4)


def build(
    node_specs: list[tuple[int, str]],
    held_specs: list[tuple[int, int, int, str | None, bool, bool, int | None, bool]],
    order_specs: list[tuple[int, int]],
    limit: int,
    budget: int | None,
) -> Cluster:
    nodes = tuple(e.Node(f"n{i}", {A10: units}, {"zone": zone}) for i, (units, zone) in enumerate(node_specs))
    free = {n.name: n.allocatable[A10] for n in nodes}
    devices: list[e.Device] = []
    vms: list[e.VirtualMachine] = []
    vmis: list[e.Vmi] = []
    for i, (size, at, age, zone, runs, keep, admitted, by_affinity) in enumerate(held_specs):
        name = nodes[at % len(nodes)].name
        if free[name] < size:
            continue
        free[name] -= size
        vm = f"vm{i}"
        since = NOW - timedelta(hours=age)
        when = NOW - timedelta(minutes=admitted) if admitted is not None else None
        devices += [
            e.Device("t1", f"{vm}-g{j}", "a10", vm, e.Phase.BOUND, name, since, "bound", keep_node=keep,
                     admitted=when if j == 0 else None)
            for j in range(size)
        ]  # fmt: skip
        if zone is not None:
            if zone and by_affinity:
                term = Term((Requirement("zone", "In", (zone,)),))
                vms.append(e.VirtualMachine("t1", vm, affinity=(term,)))
            else:
                vms.append(e.VirtualMachine("t1", vm, {"zone": zone} if zone else {}))
        if runs:
            vmis.append(e.Vmi("t1", vm, f"uid-{vm}", {}, name, "Running"))
    for i, (size, age) in enumerate(order_specs):
        created = NOW - timedelta(hours=age)
        devices += [e.Device("t2", f"o{i}-g{j}", "a10", f"o{i}", created=created) for j in range(size)]
    budgets = (e.Budget("t2", "b", {"a10": budget}),) if budget is not None else ()
    return Cluster(
        now=NOW, classes=(A10_CLASS,), nodes=nodes, devices=tuple(devices), budgets=budgets, vmis=tuple(vmis),
        virtual_machines=tuple(vms), settings=e.Settings(moves_per_pass=limit),
    )  # fmt: skip


def usage(devices: list[e.Device]) -> Counter[str]:
    used: Counter[str] = Counter()
    for d in devices:
        if d.held:
            used[d.namespace] += 1
    return used


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes_st, held_st, orders_st, st.integers(1, 6), st.sampled_from([None, None, 4, 12]))
def test_making_room_moves_only_stopped_movable_sets_where_their_template_allows(
    node_specs: list[tuple[int, str]],
    held_specs: list[tuple[int, int, int, str | None, bool, bool, int | None, bool]],
    order_specs: list[tuple[int, int]],
    limit: int,
    budget: int | None,
) -> None:
    check(build(node_specs, held_specs, order_specs, limit, budget))


#: Fragmented clusters: nodes of 8 each holding small sets, mostly stopped VMs, then big orders.
fragmented_held = st.lists(
    st.tuples(
        st.integers(1, 3),
        st.integers(0, 4),
        st.integers(0, 50),
        st.sampled_from(["", "", "a"]),
        st.sampled_from([False, False, False, True]),
        st.just(False),
        st.sampled_from([None, None, None, 1]),
        st.booleans(),
    ),
    min_size=4,
    max_size=14,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.just(8), st.sampled_from(["a", "a", "b"])), min_size=3, max_size=5),
    fragmented_held,
    st.lists(st.tuples(st.integers(5, 8), st.integers(0, 50)), min_size=1, max_size=3),
    st.integers(1, 8),
)
def test_making_room_in_fragmented_clusters(
    node_specs: list[tuple[int, str]],
    held_specs: list[tuple[int, int, int, str | None, bool, bool, int | None, bool]],
    order_specs: list[tuple[int, int]],
    limit: int,
) -> None:
    check(build(node_specs, held_specs, order_specs, limit, None))


def check(c: Cluster) -> None:
    result = full_pass(c)
    assert full_pass(c) == result  # 6
    before = {d.key: d for d in c.devices}
    after = dict(before)
    after.update({d.key: d for d in result.devices})
    vms = {vm.key: vm for vm in c.virtual_machines}
    vmis = {(v.namespace, v.name) for v in c.vmis}
    nodes = {n.name: n for n in c.nodes}
    moved_sets = {d.set_key for d in after.values() if d.held and before[d.key].held and d.node != before[d.key].node}
    for key in moved_sets:
        members = [d for d in after.values() if d.set_key == key]
        was = [before[d.key] for d in members]
        # 1: only stopped, movable sets move
        assert key not in vmis and key in vms
        assert not any(d.keep_node for d in was)
        assert not any(d.admitted is not None and NOW - d.admitted < timedelta(seconds=120) for d in was)
        # 2: moved whole, Bound, saying so
        assert {(d.phase, d.reason_code) for d in members} == {(e.Phase.BOUND, Code.MADE_ROOM)}
        assert len({d.node for d in members}) == 1
        # 5: the destination satisfies the template
        vm, node = vms[key], nodes[members[0].node]
        assert all(node.labels.get(k) == v for k, v in vm.node_selector.items())
        for term in vm.affinity or ():
            assert all(node.labels.get(r.key) in r.values for r in term.expressions)
    # 2: nothing held before is Pending or Lost now
    assert all(after[k].phase is e.Phase.BOUND for k, d in before.items() if d.held)
    # 3: classes and usage of what was held are unchanged
    assert all(after[k].class_name == d.class_name for k, d in before.items())
    assert usage([after[k] for k, d in before.items() if d.held]) == usage(list(c.devices))
    for (ns, _), used in result.budget_used.items():
        assert used.get("a10", 0) == usage(list(after.values()))[ns]
    # 4: plans: their sets are the moved ones, their waiting sets placed, within the limit
    planned = {k for ks in result.room_plans.values() for k in ks}
    assert planned == moved_sets and len(planned) <= c.settings.moves_per_pass
    event(f"sets moved: {min(len(planned), 3)}{'+' if len(planned) > 3 else ''}")
    event(f"plans refused by the limit: {bool(result.counts.get('room_refused'))}")
    assert result.counts.get("made_room", 0) == len(planned)
    for waiting in result.room_plans:
        assert {d.phase for d in after.values() if d.set_key == waiting} == {e.Phase.BOUND}
    # 5: no node over-booked
    booked: Counter[str] = Counter(d.node for d in after.values() if d.phase is e.Phase.BOUND)
    assert all(booked[n.name] <= n.allocatable[A10] for n in c.nodes)

"""Property tests of lending against a plain model.

Random clusters of one GPU class: tenants with limits and borrowing order sets, some borrow;
then a random half of the held VMs run (a launcher pod the VMI's activePods names) and a
burst of entitled orders arrives. Full passes run until one changes nothing. Checked with
plain sums over the devices, no engine ledger or rule:

1. a running VM's set is never released (nor moved) by a pass;
2. every tenant's usage equals the units its devices hold, and its borrowed units those of
   its borrowed devices (the ledger and the budget status alike);
3. once passes settle, no marked set's VM is stopped, and no entitled set (an order within
   its budget) without marks waits while some node would have room for it by releasing
   borrowed sets taken youngest first, every one of them with its VM stopped (one with
   marks waits for the VMs it marked, on the node that releases the fewest units);
4. passes settle: a few passes after the burst, a pass changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from datetime import timedelta

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from binder.engine import Cluster, full_pass
from binder.engine import types as e
from binder.engine.accounting import ledger_for
from harness.shapes import A10, NOW, gpu_class

A10_CLASS = gpu_class("a10", A10)
MAX_PASSES = 12

tenants = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.booleans()), min_size=2, max_size=4)
nodes = st.lists(st.integers(1, 8), min_size=1, max_size=4)
orders = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=10)


def make_order(ns: str, vm: str, size: int, created: int) -> list[e.Device]:
    when = NOW - timedelta(hours=100 - created)
    return [e.Device(ns, f"{vm}-g{i}", "a10", vm, created=when) for i in range(size)]


def apply(cluster: Cluster, result: e.PassResult, minutes: int = 5) -> Cluster:
    merged = {d.key: d for d in cluster.devices}
    merged.update({d.key: d for d in result.devices})
    return dataclasses.replace(cluster, devices=tuple(merged.values()), now=cluster.now + timedelta(minutes=minutes))


def sets_of(cluster: Cluster) -> dict[tuple[str, str], list[e.Device]]:
    out: dict[tuple[str, str], list[e.Device]] = {}
    for d in cluster.devices:
        out.setdefault(d.set_key, []).append(d)
    return out


def with_launchers(cluster: Cluster, running: list[bool]) -> Cluster:
    """A running launcher pod (named in its VMI's activePods) for some held sets."""
    vmis, pods = [], []
    held = [(k, m) for k, m in sorted(sets_of(cluster).items()) if all(d.phase is e.Phase.BOUND for d in m)]
    for (key, members), runs in zip(held, running, strict=False):
        if not runs:
            continue
        node = members[0].node
        uid = f"pod-{key[0]}-{key[1]}"
        vmis.append(
            e.Vmi(key[0], key[1], f"vmi-{key[1]}", {uid: node}, node, "Running", tuple(d.name for d in members))
        )
        pods.append(e.Pod(key[0], f"virt-launcher-{key[1]}", uid, node, "Running", {A10: len(members)}, key[1]))
    return dataclasses.replace(cluster, vmis=tuple(vmis), pods=tuple(pods))


def vm_runs(cluster: Cluster, key: tuple[str, str]) -> bool:
    """Plainly: a VMI of that name lists a pod of its namespace that has not finished."""
    pods = {(p.namespace, p.uid): p for p in cluster.pods}
    for vmi in cluster.vmis:
        if (vmi.namespace, vmi.name) == key:
            return any((p := pods.get((vmi.namespace, uid))) is not None and not p.finished for uid in vmi.active_pods)
    return False


def limit_of(cluster: Cluster, ns: str) -> int | None:
    limits = [b.limits["a10"] for b in cluster.budgets if b.namespace == ns and "a10" in b.limits]
    return min(limits) if limits else None


def check_accounting(cluster: Cluster, result: e.PassResult) -> None:
    ledger = ledger_for(cluster)
    used: Counter[str] = Counter()
    lent: Counter[str] = Counter()
    for d in cluster.devices:
        if d.held:
            used[d.namespace] += 1
            if d.borrowed:
                lent[d.namespace] += 1
    for ns in {d.namespace for d in cluster.devices}:
        assert ledger.used[ns]["a10"] == used[ns] == ledger.used[ns][A10]
        assert ledger.borrowed[ns]["a10"] == lent[ns]
    for (ns, _), borrowed in result.budget_borrowed.items():
        assert borrowed.get("a10", 0) == lent[ns]


def check_marks(cluster: Cluster, sets: dict[tuple[str, str], list[e.Device]]) -> set[str]:
    """A marked set is held only while its VM runs (one that stopped is released); returns
    the sets the marks are for."""
    marked_for = set()
    for key, members in sets.items():
        if members[0].reclaim_for:
            marked_for.add(members[0].reclaim_for)
            assert vm_runs(cluster, key), f"{key} is marked for {members[0].reclaim_for} but its VM stopped"
    return marked_for


def check_no_stopped_borrower_blocks(cluster: Cluster) -> None:
    sets = sets_of(cluster)
    free: Counter[str] = Counter({n.name: n.allocatable.get(A10, 0) for n in cluster.nodes})
    used: Counter[str] = Counter()
    lent_on: dict[str, list[tuple[float, tuple[str, str]]]] = {}
    for key, members in sets.items():
        if all(d.phase is e.Phase.BOUND for d in members):
            free[members[0].node] -= len(members)
        if any(d.held for d in members):
            used[key[0]] += len(members)
        if members[0].borrowed:
            since = max(d.since or NOW for d in members).timestamp()
            lent_on.setdefault(members[0].node, []).append((-since, key))
    marked_for = check_marks(cluster, sets)
    for key, members in sets.items():
        if not all(d.phase is e.Phase.PENDING for d in members):
            continue
        if f"{key[0]}/{key[1]}" in marked_for:
            continue  # it waits for the running VMs it marked (the node that releases fewest units)
        need, limit = len(members), limit_of(cluster, key[0])
        if limit is not None and used[key[0]] + need > limit:
            continue  # not entitled: over its budget
        for node, lent in lent_on.items():
            room, stopped_only = free[node], True
            for _, other in sorted(lent):
                if room >= need:
                    break
                room += len(sets[other])
                stopped_only = stopped_only and not vm_runs(cluster, other)
            assert not (free[node] < need <= room and stopped_only), (
                f"{key} waits while releasing stopped borrowers on {node} would make room"
            )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tenants, nodes, orders, st.lists(st.booleans(), max_size=10), orders)
def test_lending_passes_keep_running_vms_and_the_accounts_and_leave_no_stopped_borrower_in_the_way(
    tenant_specs: list[tuple[int, int, bool]],
    node_sizes: list[int],
    first: list[tuple[int, int]],
    running: list[bool],
    burst: list[tuple[int, int]],
) -> None:
    budgets = tuple(
        e.Budget(f"t{i}", "b", {"a10": limit}, {"a10": borrow})
        for i, (limit, borrow, has) in enumerate(tenant_specs)
        if has
    )
    devices = [
        d for i, (t, size) in enumerate(first) for d in make_order(f"t{t % len(tenant_specs)}", f"a{i}", size, i)
    ]
    cluster = Cluster(
        now=NOW,
        classes=(A10_CLASS,),
        nodes=tuple(e.Node(f"n{i}", {A10: size}) for i, size in enumerate(node_sizes)),
        devices=tuple(devices),
        budgets=budgets,
    )
    cluster = apply(cluster, full_pass(cluster))
    cluster = with_launchers(cluster, running)
    later = [
        d for i, (t, size) in enumerate(burst) for d in make_order(f"t{t % len(tenant_specs)}", f"b{i}", size, 50 + i)
    ]
    cluster = dataclasses.replace(cluster, devices=(*cluster.devices, *later))
    for _ in range(MAX_PASSES):
        result = full_pass(cluster)
        before = sets_of(cluster)
        cluster = apply(cluster, result)
        after = sets_of(cluster)
        for key, members in before.items():
            if vm_runs(cluster, key) and all(d.phase is e.Phase.BOUND for d in members):
                assert {(d.phase, d.node) for d in after[key]} == {(e.Phase.BOUND, members[0].node)}
        check_accounting(cluster, result)
        if not result.devices:
            break
    else:
        raise AssertionError(f"passes did not settle in {MAX_PASSES}")
    note(f"tenants={tenant_specs} nodes={node_sizes} first={first} running={running} burst={burst}")
    check_no_stopped_borrower_blocks(cluster)


#: Between two passes: a tenant's budget changes (limit, borrowing), a set is deleted, or an
#: order arrives; (kind, tenant or set index, value, value).
steps = st.lists(
    st.tuples(st.sampled_from(["budget", "delete", "order", "none"]), st.integers(0, 9), st.integers(0, 6),
              st.integers(0, 6)),
    min_size=1,
    max_size=8,
)  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tenants, nodes, orders, st.lists(st.booleans(), max_size=10), steps)
def test_a_kept_ledger_repays_and_marks_as_a_ledger_built_from_scratch(
    tenant_specs: list[tuple[int, int, bool]],
    node_sizes: list[int],
    first: list[tuple[int, int]],
    running: list[bool],
    changes: list[tuple[str, int, int, int]],
) -> None:
    """A worker keeps its ledger between passes, and with it the borrowed sets by tenant
    and by node and repay's memo of the tenants it need not judge again: passes on it
    decide exactly as passes on a ledger built from scratch, whatever changed between them
    (budgets, sets deleted, new orders), and its indexes equal a fresh ledger's."""
    budgets = tuple(
        e.Budget(f"t{i}", "b", {"a10": limit}, {"a10": borrow})
        for i, (limit, borrow, has) in enumerate(tenant_specs)
        if has
    )
    devices = [
        d for i, (t, size) in enumerate(first) for d in make_order(f"t{t % len(tenant_specs)}", f"a{i}", size, i)
    ]
    cluster = Cluster(
        now=NOW,
        classes=(A10_CLASS,),
        nodes=tuple(e.Node(f"n{i}", {A10: size}) for i, size in enumerate(node_sizes)),
        devices=tuple(devices),
        budgets=budgets,
    )
    cluster = apply(cluster, full_pass(cluster))
    # Every held set starts borrowed, as a worker may find them (cluster_bench does the same).
    lent = tuple(dataclasses.replace(d, borrowed=d.held) for d in cluster.devices)
    cluster = dataclasses.replace(cluster, devices=lent)
    cluster = with_launchers(cluster, running)
    kept = ledger_for(cluster)
    for n, (kind, index, a, b) in enumerate([("none", 0, 0, 0), *changes]):
        sets = sets_of(cluster)
        touched: list[tuple[str, str]] = []
        if kind == "budget":
            ns = f"t{index % len(tenant_specs)}"
            others = tuple(x for x in cluster.budgets if x.namespace != ns)
            cluster = dataclasses.replace(cluster, budgets=(*others, e.Budget(ns, "b", {"a10": a}, {"a10": b})))
        elif kind == "delete" and sets:
            key = sorted(sets)[index % len(sets)]
            cluster = dataclasses.replace(cluster, devices=tuple(d for d in cluster.devices if d.set_key != key))
            touched.append(key)
        elif kind == "order":
            new = make_order(f"t{index % len(tenant_specs)}", f"c{n}", 1 + a % 4, 60 + n)
            cluster = dataclasses.replace(cluster, devices=(*cluster.devices, *new))
            touched.append(new[0].set_key)
        members = sets_of(cluster)
        for key in touched:
            kept.commit(key, tuple(sorted(members.get(key, ()), key=lambda d: d.key)))
        mine, theirs = full_pass(cluster, kept), full_pass(cluster)
        assert sorted(mine.devices, key=lambda d: d.key) == sorted(theirs.devices, key=lambda d: d.key)
        assert Counter(mine.changes) == Counter(theirs.changes) and mine.counts == theirs.counts
        cluster = apply(cluster, theirs)
        assert kept.lending_index() == ledger_for(cluster).lending_index()

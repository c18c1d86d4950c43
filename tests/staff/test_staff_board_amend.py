"""The first board after a change does not work everything out again, and shows what a
board worked out from nothing shows: who holds each node's units (``NodeHoldings``) is
the ledger's itemisation, node by node; the units per node and tenant (``node_units``)
amended from the previous snapshot's sets add up to the holdings; and a board drawn after
changes to nodes, sets and pods, from what the previous board kept, is the board drawn
after ``forget()``."""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from django.test import Client
from django.urls import reverse

from binder import models
from binder.engine import Holding, ledger_for
from binder.engine import types as e
from gpuplane.staff.snapshot import NodeHoldings, forget, node_units

H100, A10, RAW = "nvidia.com/H100", "nvidia.com/A10", "nvidia.com/RAW"
NOW = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _nothing_kept() -> Iterator[None]:
    forget()
    yield
    forget()


def _cluster(seed: int) -> e.Cluster:
    """Nodes of two classes' resources (one deleted: devices still Bound there), sets Bound,
    Lost and Pending, a device of a class that does not exist, launcher pods asking more
    than their set holds (some on another node than their devices), plain and finished
    pods, and a pod on a node the mirror does not have."""
    rng = random.Random(seed)
    classes = (
        e.GpuClass(name="h100", resource_name=H100),
        e.GpuClass(name="a10", resource_name=A10, units_per_device=2),
    )
    nodes = tuple(
        e.Node(name=f"n{i}", allocatable={H100: 8} if i % 3 else {A10: 8, RAW: 2}, ready=i != 4) for i in range(8)
    )
    devices: list[e.Device] = []
    vmis: list[e.Vmi] = []
    pods: list[e.Pod] = []
    for s in range(14):
        namespace, vm = f"t{rng.randrange(4)}", f"vm-{s}"
        cls = rng.choice(("h100", "a10", "gone"))
        phase = rng.choice((e.Phase.BOUND, e.Phase.BOUND, e.Phase.BOUND, e.Phase.LOST, e.Phase.PENDING))
        node = rng.choice([n.name for n in nodes] + ["deleted-node"]) if phase is e.Phase.BOUND else ""
        size = rng.choice((1, 2, 3))
        devices.extend(
            e.Device(namespace=namespace, name=f"{vm}-g{j}", class_name=cls, vm_name=vm, phase=phase, node=node)
            for j in range(size)
        )
        if rng.random() < 0.6:
            pod_node = node if node and rng.random() < 0.7 else rng.choice([n.name for n in nodes])
            uid = f"uid-{s}"
            vmis.append(e.Vmi(namespace=namespace, name=vm, uid=f"vmi-{s}", active_pods={uid: pod_node}, node=pod_node))
            resource = H100 if cls == "h100" else A10
            pods.append(
                e.Pod(
                    namespace=namespace,
                    name=f"virt-launcher-{vm}",
                    uid=uid,
                    node=pod_node,
                    requests={resource: size * rng.choice((1, 2)), RAW: rng.choice((0, 1))},
                    owner_vmi=vm,
                )
            )
    pods.extend(
        e.Pod(
            namespace=f"t{rng.randrange(4)}",
            name=f"trainer-{p}",
            uid=f"uid-trainer-{p}",
            node=rng.choice([n.name for n in nodes] + ["deleted-node", ""]),
            phase=rng.choice(("Running", "Running", "Succeeded")),
            requests={rng.choice((H100, A10, RAW)): rng.choice((1, 2))},
        )
        for p in range(5)
    )
    return e.Cluster(
        now=NOW,
        classes=classes,
        nodes=nodes,
        devices=tuple(devices),
        budgets=(),
        vmis=tuple(vmis),
        pods=tuple(pods),
        settings=e.Settings(),
    )


def _units(holdings: Mapping[str, list[Holding]]) -> dict[str, dict[tuple[str, str], int]]:
    """What ``node_units`` should give: the holdings' units per node, tenant and resource."""
    out: dict[str, Counter[tuple[str, str]]] = {}
    for node, held in holdings.items():
        for h in held:
            holder = h.device or h.pod
            assert holder is not None
            out.setdefault(node, Counter())[(holder.namespace, h.resource)] += h.units
    return {node: {k: v for k, v in units.items() if v} for node, units in out.items() if +units}


def _non_empty(units: Mapping[str, Mapping[tuple[str, str], int]]) -> dict[str, dict[tuple[str, str], int]]:
    return {node: dict(here) for node, here in units.items() if here}


@pytest.mark.parametrize("seed", range(12))
def test_node_holdings_are_the_ledgers_itemisation_node_by_node(seed: int) -> None:
    cluster = _cluster(seed)
    ledger = ledger_for(cluster)
    expected = {node: held for node, held in ledger.holdings().items() if held}
    lazy = NodeHoldings(ledger)
    # Node by node first (as a page asks), then the whole mapping.
    for node in [*(n.name for n in cluster.nodes), "deleted-node", "nowhere"]:
        assert lazy.get(node, []) == expected.get(node, []), node
        assert (node in lazy) == (node in expected)
    assert dict(lazy) == expected
    assert sorted(lazy) == sorted(expected)
    assert len(lazy) == len(expected)
    assert bool(lazy) is True
    with pytest.raises(KeyError):
        lazy["nowhere"]
    # The next snapshot's: a copy (its pods' index reused), then a pod fewer (made again).
    gone = next(p for p in cluster.pods if p.node and not p.finished)
    fewer = ledger_for(replace(cluster, pods=tuple(p for p in cluster.pods if p is not gone)))
    for after in (ledger.copy(), fewer):
        expected = {node: held for node, held in after.holdings().items() if held}
        assert {n: NodeHoldings(after).get(n, []) for n in expected} == expected
        assert dict(NodeHoldings(after)) == expected
    empty = ledger_for(replace(cluster, devices=(), pods=(), vmis=()))
    assert not NodeHoldings(empty) and dict(NodeHoldings(empty)) == {}


@pytest.mark.parametrize("seed", range(12))
def test_node_units_add_up_to_the_holdings_and_are_amended_after_changes(seed: int) -> None:
    rng = random.Random(seed)
    cluster = _cluster(seed)
    ledger = ledger_for(cluster)
    assert _non_empty(node_units(ledger)) == _units(ledger.holdings())

    # The read model's way: a copy of the kept ledger with a few sets committed anew
    # (moved, Lost, emptied, a new one); the other sets are the very same records.
    for _ in range(3):
        ledger = ledger.copy()
        keys = sorted({d.set_key for d in cluster.devices})
        for key in rng.sample(keys, 3):
            devices = ledger.devices(key)
            change = rng.choice(("move", "lose", "empty"))
            if change == "move":
                node = rng.choice([n.name for n in cluster.nodes])
                devices = tuple(replace(d, phase=e.Phase.BOUND, node=node) for d in devices)
            elif change == "lose":
                devices = tuple(replace(d, phase=e.Phase.LOST, node="") for d in devices)
            else:
                devices = ()
            ledger.commit(key, devices)
        vm = f"new-{rng.randrange(10**6)}"
        bound = e.Device(namespace="t9", name=f"{vm}-g0", class_name="h100", vm_name=vm, phase=e.Phase.BOUND, node="n1")
        ledger.commit(("t9", vm), (bound,))
        amended = _non_empty(node_units(ledger))
        assert amended == _units(ledger.holdings())
        forget()  # from nothing: the same sums
        assert _non_empty(node_units(ledger)) == amended

    # A ledger built again (a pod changed): new records everywhere, the same sums.
    rebuilt = ledger_for(replace(cluster, pods=cluster.pods[1:]))
    assert _non_empty(node_units(rebuilt)) == _units(rebuilt.holdings())


# -- through the page ------------------------------------------------------------------------------

BOARD = "admin:placement-board"


@pytest.fixture
def fleet() -> None:
    """60 nodes of 8 H100 units, sets of 1-4 devices of 12 tenants, launcher pods asking
    one unit more than their set (raw usage), plain pods, a few cordoned and NotReady."""
    rng = random.Random(5)
    tenants = models.Namespace.objects.bulk_create([models.Namespace(name=f"t{i:02d}") for i in range(12)])
    models.GpuClass.objects.create(name="h100", resource_name=H100)
    models.GpuClass.objects.create(name="a10", resource_name=A10)
    models.Node.objects.bulk_create(
        models.Node(
            name=f"node-{i:02d}",
            allocatable={A10: 4} if i % 7 == 3 else {H100: 8},
            unschedulable=i % 11 == 5,
            ready=i % 13 != 6,
        )
        for i in range(60)
    )
    devices, vmis, pods = [], [], []
    for s in range(120):
        node, size, tenant = f"node-{rng.randrange(60):02d}", rng.choice((1, 2, 4)), tenants[rng.randrange(12)]
        cls = "a10" if int(node[-2:]) % 7 == 3 else "h100"
        devices.extend(
            models.GpuDevice(
                namespace=tenant, name=f"vm-{s}-g{j}", class_name=cls, vm_name=f"vm-{s}", phase="Bound", node=node
            )
            for j in range(size)
        )
        if s % 4 == 0:
            uid = f"uid-{s}"
            vmis.append(
                models.VirtualMachineInstance(
                    namespace=tenant,
                    name=f"vm-{s}",
                    uid=f"vmi-{s}",
                    active_pods={uid: node},
                    node=node,
                    phase="Running",
                )
            )
            pods.append(
                models.Pod(
                    namespace=tenant,
                    name=f"virt-launcher-vm-{s}",
                    uid=uid,
                    node=node,
                    phase="Running",
                    gpu_requests={H100 if cls == "h100" else A10: size + 1},
                    owner_kind="VirtualMachineInstance",
                    owner_name=f"vm-{s}",
                    owner_vmi_hint=f"vm-{s}",
                )
            )
    pods.extend(
        models.Pod(
            namespace=tenants[p],
            name=f"trainer-{p}",
            uid=f"uid-trainer-{p}",
            node=f"node-{p * 9:02d}",
            phase="Running",
            gpu_requests={H100: 1},
        )
        for p in range(6)
    )
    models.GpuDevice.objects.bulk_create(devices)
    models.VirtualMachineInstance.objects.bulk_create(vmis)
    models.Pod.objects.bulk_create(pods)


VIEWS = (
    {},
    {"page": "2"},
    {"sort": "-free"},
    {"sort": "state", "problems": "1"},
    {"class": "a10"},
    {"tenant": "t03"},
    {"q": "node-09"},
)


def _board(client: Client, params: Mapping[str, str]) -> str:
    """The board's own parts of the page (the admin around it carries a fresh CSRF token)."""
    response = client.get(reverse(BOARD), params)
    assert response.status_code == 200, response.content[:400]
    html = response.content.decode()
    start = html.index('<div class="gp-board-page">')
    return re.sub(r'name="csrfmiddlewaretoken" value="[^"]*"', "", html[start:])


def _every_view(client: Client) -> list[str]:
    moved = models.GpuDevice.objects.filter(vm_name="vm-5").values_list("namespace__name", flat=True).first()
    return [_board(client, params) for params in (*VIEWS, {"q": f"{moved}/vm-5"})]


def test_a_board_after_changes_is_the_board_worked_out_from_nothing(admin_client: Client, fleet: None) -> None:
    _every_view(admin_client)  # what the next boards amend
    # Nodes: one cordoned, one NotReady, one with less allocatable; sets: one moved, one
    # Lost, one deleted, one new; pods: a launcher gone, a plain pod added.
    models.Node.objects.filter(name="node-01").update(unschedulable=True)
    models.Node.objects.filter(name="node-02").update(ready=False)
    models.Node.objects.filter(name="node-08").update(allocatable={H100: 2})
    models.GpuDevice.objects.filter(vm_name="vm-5").update(node="node-09")
    first = models.GpuDevice.objects.filter(phase="Bound").exclude(vm_name="vm-5").order_by("name").first()
    assert first is not None
    models.GpuDevice.objects.filter(namespace=first.namespace, vm_name=first.vm_name).update(phase="Lost", node="")
    models.GpuDevice.objects.filter(vm_name="vm-7").delete()
    models.GpuDevice.objects.create(
        namespace=models.Namespace.objects.get(name="t03"),
        name="late-g0",
        class_name="h100",
        vm_name="late",
        phase="Bound",
        node="node-10",
    )
    models.Pod.objects.filter(name="virt-launcher-vm-8").delete()
    models.Pod.objects.create(
        namespace=models.Namespace.objects.get(name="t03"),
        name="trainer-late",
        uid="uid-trainer-late",
        node="node-10",
        phase="Running",
        gpu_requests={H100: 2},
    )
    amended = _every_view(admin_client)
    forget()
    assert _every_view(admin_client) == amended
    # and the change shows
    row = amended[0].split('data-node="node-01"', 1)[1].split("</tr>", 1)[0]
    assert "cordoned" in row
    assert re.search(r"set t\d\d/vm-5: Bound on node-09", amended[-1])

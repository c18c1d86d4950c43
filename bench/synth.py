"""The synthetic cluster the benches measure: GPU nodes, classes, tenants with budgets, Bound sets
packed best fit, VMIs with their launcher pods, and the orders a bench adds."""

from __future__ import annotations

import argparse
import random
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.common import Packer, load

#: The device columns the generator and the inserted orders write (the rest take their defaults).
DEVICE_COLUMNS = (
    "namespace_id",
    "name",
    "class_name",
    "vm_name",
    "phase",
    "node",
    "since",
    "reason",
    "bind_request",
    "bind_requested_at",
    "answered_request",
    "answer",
    "created",
)
#: (class name, raw resource, display name): the resource names of tests/fixtures/kubernetes.
CLASSES = (
    ("h100", "nvidia.com/GH100_H100_SXM5_80GB", "NVIDIA H100 SXM5 80GB"),
    ("a10", "nvidia.com/GA102GL_A10", "NVIDIA A10"),
    ("l40s", "nvidia.com/AD102GL_L40S", "NVIDIA L40S"),
)


RESOURCE = {name: res for name, res, _ in CLASSES}


SIZES = (1, 2, 4, 8)


SIZE_WEIGHTS = (40, 30, 20, 10)  # mean 2.6 devices per set


#: Every class selects GPU-passthrough nodes, the label the GPU operator writes (tests/fixtures/kubernetes).
NODE_SELECTOR = {"nvidia.com/gpu.workload.config": "vm-passthrough"}


EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


def uid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def node_labels(name: str, cls: str) -> dict[str, str]:
    """Labels of a GPU-passthrough node as in tests/fixtures/kubernetes/node-with-gpus.yaml."""
    labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "cpumanager": "false",
        "feature.node.kubernetes.io/pci-10de.present": "true",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubevirt.io/schedulable": "true",
        "node-role.kubernetes.io/worker": "",
        "nvidia.com/gpu.deploy.sandbox-device-plugin": "true",
        "nvidia.com/gpu.deploy.vfio-manager": "true",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.workload.config": "vm-passthrough",
    }
    if cls == "h100":
        labels["nvidia.com/gpu.product"] = "GH100-H100-SXM5-80GB"
    return labels


def truncate_all() -> None:
    from django.apps import apps
    from django.db import connection

    # Usage records are billing history, not the cluster: they stay.
    tables = [
        m._meta.db_table
        for m in apps.get_app_config("binder").get_models()
        if not m._meta.proxy and m._meta.db_table != "usage_usagerecord"
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE " + ", ".join(connection.ops.quote_name(t) for t in tables) + " RESTART IDENTITY CASCADE"
        )


def generate(args: argparse.Namespace, progress: Any) -> dict[str, Any]:  # noqa: C901 - fixed steps drawing in order from one seeded random stream
    """Write the synthetic cluster into the database; return counts and timings."""
    from django.db import connection, transaction

    from binder import models

    rng = random.Random(args.seed)
    now = datetime.now(UTC)
    stats: dict[str, Any] = {"loader": args.loader}
    clock = time.perf_counter()
    g = args.gpus_per_node

    # Nodes: classes round-robin; a few cordoned (they keep their sets), a few NotReady
    # for long past the grace period (they hold nothing and take nothing).
    node_names = [f"gpu-{CLASSES[i % 3][0]}-{i:05d}" for i in range(args.nodes)]
    node_class = [CLASSES[i % 3][0] for i in range(args.nodes)]
    not_ready = set(rng.sample(range(args.nodes), max(1, args.nodes // 200)))
    cordoned = set(rng.sample(sorted(set(range(args.nodes)) - not_ready), max(1, args.nodes // 100)))
    packable: dict[str, list[int]] = {c: [] for c, _, _ in CLASSES}
    for i in range(args.nodes):
        if i not in not_ready:
            packable[node_class[i]].append(i)
    rng.shuffle(packable["h100"])
    packer = Packer(packable, g)

    tenants = [f"tenant-{t:04d}" for t in range(args.tenants)]

    # Sets: sizes 1/2/4/8 until --devices; packed biggest first (best-fit decreasing).
    sets: list[tuple[int, str, str, int]] = []  # (tenant, vm, class, size)
    total = 0
    s = 0
    while total < args.devices:
        size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        cls = CLASSES[rng.randrange(3)][0]
        sets.append((rng.randrange(args.tenants), f"vm-{s:06d}", cls, size))
        total += size
        s += 1
    placed: list[tuple[int, str, str, int, int]] = []  # + node index
    unplaced = 0
    for t, vm, cls, size in sorted(sets, key=lambda x: -x[3]):
        node = packer.take(cls, size)
        if node is None:
            unplaced += size
            continue
        placed.append((t, vm, cls, size, node))
    if unplaced:
        raise SystemExit(
            f"{unplaced} devices do not fit on {args.nodes} nodes x {g} GPUs; "
            "lower --devices or raise --nodes / --gpus-per-node"
        )
    placed.sort(key=lambda x: x[1])

    # Pods that book raw units: raw-GPU pods (no owner) and pods whose owner reference
    # names a VMI they do not launch (forged); both take room from the packer.
    raw_pods: list[tuple[int, str, str, int, int | None, str, str]] = []
    for p in range(args.raw_pods):
        cls = CLASSES[rng.randrange(3)][0]
        units = rng.choice((1, 1, 2))
        node = packer.take(cls, units)
        raw_pods.append((rng.randrange(args.tenants), f"cuda-job-{p:05d}", cls, units, node, "Running", ""))

    launchers = [x for x in placed if rng.random() < args.launcher_fraction]
    by_tenant_vmis: dict[int, list[str]] = {}
    for t, vm, _, _, _ in launchers:
        by_tenant_vmis.setdefault(t, []).append(vm)
    tenants_with_vmis = sorted(by_tenant_vmis)
    for p in range(args.forged_pods):
        t = rng.choice(tenants_with_vmis)
        hint = rng.choice(by_tenant_vmis[t])
        cls = CLASSES[rng.randrange(3)][0]
        roll = rng.random()
        if roll < 0.1:
            node, phase = None, "Pending"  # not yet bound: counts in budgets only
        elif roll < 0.2:
            node, phase = None, "Succeeded"  # finished: uses nothing
        else:
            node, phase = packer.take(cls, 1), "Running"
        raw_pods.append((t, f"virt-launcher-{hint}-forged{p:05d}", cls, 1, node, phase, hint))

    # Budgets: most generous, ~5% tight (limit = current use, so new orders are refused),
    # ~5% none (unlimited), ~2% two budgets (the smallest limit wins).
    class_use: dict[tuple[int, str], int] = {}
    for t, _, cls, size, _ in placed:
        class_use[(t, cls)] = class_use.get((t, cls), 0) + size
    budgets: list[tuple[int, str, dict[str, int]]] = []
    tight = 0
    for t in range(args.tenants):
        roll = rng.random()
        if roll < 0.05:
            continue
        if roll < 0.10:
            tight += 1
            budgets.append((t, "gpu-budget", {c: class_use.get((t, c), 0) for c, _, _ in CLASSES}))
            continue
        limits = {c: 100_000 for c, _, _ in CLASSES}
        limits.update({res: 100_000 for _, res, _ in CLASSES})
        budgets.append((t, "gpu-budget", limits))
        if roll > 0.98:
            budgets.append((t, "team-cap", {"h100": 50_000}))
    stats["plan_s"] = time.perf_counter() - clock

    counts = {
        "namespaces": args.tenants,
        "nodes": args.nodes,
        "classes": len(CLASSES),
        "devices": sum(x[3] for x in placed),
        "sets": len(placed),
        "budgets": len(budgets),
        "vmis": len(launchers),
        "pods": len(launchers) + len(raw_pods),
    }
    planned = sum(v for k, v in counts.items() if k != "sets")
    task = progress.add_task("generating", total=planned)

    def advance(n: int) -> None:
        progress.advance(task, n)

    def step(label: str) -> None:
        progress.update(task, description=f"generating: {label}")

    clock = time.perf_counter()
    with transaction.atomic():
        step("truncate")
        truncate_all()
        step("namespaces")
        load(
            models.Namespace,
            ("name", "uid", "labels", "created"),
            ((n, uid(rng), {"kubernetes.io/metadata.name": n}, EPOCH) for n in tenants),
            args.loader,
            advance,
        )
        ns_id = dict(models.Namespace.objects.values_list("name", "id"))
        step("classes")
        load(
            models.GpuClass,
            (
                "name",
                "resource_name",
                "units_per_device",
                "node_selector",
                "display_name",
                "created",
                "status_allocatable",
                "status_bound",
                "status_lost",
            ),
            ((c, r, 1, NODE_SELECTOR, d, EPOCH, 0, 0, 0) for c, r, d in CLASSES),
            args.loader,
            advance,
        )

        def node_rows() -> Iterable[tuple[Any, ...]]:
            for i, name in enumerate(node_names):
                cls = node_class[i]
                allocatable = {
                    RESOURCE[cls]: g,
                    "nvidia.com/gpu": 0,  # stale resource of a removed plugin (NOTES.md)
                    "devices.kubevirt.io/kvm": 1000,
                    "devices.kubevirt.io/tun": 1000,
                    "devices.kubevirt.io/vhost-net": 1000,
                }
                if cls == "h100":
                    allocatable["nvidia.com/GH100_H100_NVSWITCH"] = 4
                ready = i not in not_ready
                since = EPOCH if ready else now - timedelta(days=2)
                yield (name, uid(rng), node_labels(name, cls), allocatable, i in cordoned, ready, since, EPOCH)

        step("nodes")
        load(
            models.Node,
            ("name", "uid", "labels", "allocatable", "unschedulable", "ready", "ready_since", "created"),
            node_rows(),
            args.loader,
            advance,
        )

        def device_rows() -> Iterable[tuple[Any, ...]]:
            for t, vm, cls, size, node in placed:
                created = EPOCH + timedelta(seconds=rng.randrange(300 * 86400))
                since = created + timedelta(seconds=rng.randrange(1, 120))
                for j in range(size):
                    yield (
                        ns_id[tenants[t]],
                        f"{vm}-gpu{j}",
                        cls,
                        vm,
                        "Bound",
                        node_names[node],
                        since,
                        "bound: fullest node with room",
                        "",
                        None,
                        "",
                        "",
                        created,
                    )

        step("devices")
        load(models.GpuDevice, DEVICE_COLUMNS, device_rows(), args.loader, advance)
        step("budgets")
        load(
            models.GpuBudget,
            ("namespace_id", "name", "limits", "used"),
            ((ns_id[tenants[t]], name, limits, {}) for t, name, limits in budgets),
            args.loader,
            advance,
        )

        # VMIs and their launcher pods (activePods lists the pod; ~2% also list the
        # Succeeded pod of an earlier run, as KubeVirt leaves it there for a while).
        vmi_rows = []
        pod_rows = []
        for t, vm, cls, size, node in launchers:
            pod_uid, vmi_uid = uid(rng), uid(rng)
            active = {pod_uid: node_names[node]}
            requests = {RESOURCE[cls]: size}
            if rng.random() < 0.02:
                old_uid = uid(rng)
                old_node = node_names[rng.randrange(args.nodes)]
                active[old_uid] = old_node
                pod_rows.append(
                    (
                        ns_id[tenants[t]],
                        f"virt-launcher-{vm}-old{len(pod_rows):05d}",
                        old_uid,
                        old_node,
                        "Succeeded",
                        requests,
                        "VirtualMachineInstance",
                        vm,
                        vmi_uid,
                        vm,
                    )
                )
            names = [f"gpuplane.io/{vm}-gpu{j}" for j in range(size)]
            vmi_rows.append((ns_id[tenants[t]], vm, vmi_uid, names, active, node_names[node], "Running"))
            pod_rows.append(
                (
                    ns_id[tenants[t]],
                    f"virt-launcher-{vm}-{pod_uid[:5]}",
                    pod_uid,
                    node_names[node],
                    "Running",
                    requests,
                    "VirtualMachineInstance",
                    vm,
                    vmi_uid,
                    vm,
                )
            )
        for t, name, cls, units, node, phase, hint in raw_pods:
            pod_rows.append(
                (
                    ns_id[tenants[t]],
                    name,
                    uid(rng),
                    node_names[node] if node is not None else "",
                    phase,
                    {RESOURCE[cls]: units},
                    "VirtualMachineInstance" if hint else "",
                    hint,
                    uid(rng) if hint else "",
                    hint,
                )
            )
        progress.update(task, total=planned + len(pod_rows) - counts["pods"])
        step("VMIs")
        load(
            models.VirtualMachineInstance,
            ("namespace_id", "name", "uid", "device_names", "active_pods", "node", "phase"),
            vmi_rows,
            args.loader,
            advance,
        )
        step("pods")
        counts["pods"] = load(
            models.Pod,
            (
                "namespace_id",
                "name",
                "uid",
                "node",
                "phase",
                "gpu_requests",
                "owner_kind",
                "owner_name",
                "owner_uid",
                "owner_vmi_hint",
            ),
            pod_rows,
            args.loader,
            advance,
        )
        step("commit")
    stats["insert_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    step("VACUUM ANALYZE")
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")
    stats["vacuum_s"] = time.perf_counter() - clock
    progress.update(task, description="generated")
    stats.update(counts)
    stats["tight_budgets"] = tight
    stats["units"] = args.nodes * g
    return stats


def current_counts() -> dict[str, int]:
    from binder import models

    return {
        "namespaces": models.Namespace.objects.count(),
        "nodes": models.Node.objects.count(),
        "devices": models.GpuDevice.objects.count(),
        "sets": models.GpuDevice.objects.values("namespace_id", "vm_name").distinct().count(),
        "budgets": models.GpuBudget.objects.count(),
        "vmis": models.VirtualMachineInstance.objects.count(),
        "pods": models.Pod.objects.count(),
        "units": sum(
            sum(v for k, v in (a or {}).items() if k in RESOURCE.values())
            for a in models.Node.objects.values_list("allocatable", flat=True)
        ),
    }


def generous_tenants() -> list[int]:
    """Namespace ids whose budgets let them order more (not the tight ones)."""
    from binder import models

    tight = set()
    for ns, limits in models.GpuBudget.objects.values_list("namespace_id", "limits"):
        if min(limits.values(), default=0) < 50_000:
            tight.add(ns)
    return sorted(set(models.Namespace.objects.values_list("id", flat=True)) - tight)


def insert_sets(
    prefix: str,
    count: int,
    rng: random.Random,
    namespace_ids: Sequence[int],
    *,
    size: int | None = None,
    bind_request: bool = False,
    alternatives_share: float = 0.0,
) -> int:
    """Insert ``count`` Pending sets (new orders); with ``bind_request`` the webhook's annotation.

    ``alternatives_share`` of them accept one or two further classes after their own, in a
    random order of preference (``spec.alternativeClassNames``)."""
    from django.db import transaction

    from binder import models

    now = datetime.now(UTC)
    rows = []
    for i in range(count):
        n = size or rng.choices(SIZES, SIZE_WEIGHTS)[0]
        cls = CLASSES[rng.randrange(3)][0]
        ns = rng.choice(namespace_ids)
        vm = f"{prefix}-{i:05d}"
        request = uuid.uuid4().hex if bind_request else ""
        others = [name for name, _, _ in CLASSES if name != cls]
        offered = bool(alternatives_share) and rng.random() < alternatives_share
        choices = rng.sample(others, rng.choice((1, 2))) if offered else []
        rows.extend(
            (
                ns,
                f"{vm}-gpu{j}",
                cls,
                vm,
                "Pending",
                "",
                None,
                "",
                request,
                now if request else None,
                "",
                "",
                now,
                choices,
            )
            for j in range(n)
        )
    with transaction.atomic():
        load(
            models.GpuDevice,
            (*DEVICE_COLUMNS, "alternative_class_names"),
            rows,
            "copy",
            lambda n: None,
        )
    return len(rows)


def delete_bench_sets() -> int:
    from django.db.models import Q

    from binder import models

    deleted, _ = models.GpuDevice.objects.filter(
        Q(vm_name__startswith="order") | Q(vm_name__startswith="answer-")
    ).delete()
    return deleted


def bound_bodies(count: int) -> list[dict[str, Any]]:
    """Reviews for ``count`` random sets Bound on one node (each VMI names its whole set)."""
    from django.db import connection

    from binder import models
    from harness.factories import new_vmi, review

    devices = models.GpuDevice._meta.db_table
    namespaces = models.Namespace._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT n.name, d.vm_name, array_agg(d.name ORDER BY d.name) FROM {devices} d "  # noqa: S608
            f"JOIN {namespaces} n ON n.id = d.namespace_id GROUP BY n.name, d.vm_name "
            "HAVING bool_and(d.phase = 'Bound') AND count(DISTINCT d.node) = 1 ORDER BY random() LIMIT %s",
            [count],
        )
        rows = cursor.fetchall()
    if len(rows) < count:
        raise SystemExit(f"only {len(rows)} Bound sets in the database; generate a cluster with cluster_bench.py")
    return [review(new_vmi(ns, vm, list(names))) for ns, vm, names in rows]

"""One node as staff look at it: its state, booked and free units per resource, the sets
Bound there and the pods that book its units.

Only the rows about this node are read (its devices, its pods, the VMIs those pods may
launch for, the classes), not the whole mirror: the page stays as fast at 10,000 nodes as
at 10. The counting is the engine's ledger over that slice; a node's booked units depend
only on devices Bound on it and pods on it (``held_here``), so the slice gives
the same figures as the whole cluster's ledger (a test compares them).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from django.utils import timezone

from binder import models
from binder.engine import build_ledger
from binder.engine import types as e
from binder.engine.preview import NodeAction, NodePreview, preview
from binder.mirror.read import read_cluster, read_rows


@dataclass(frozen=True, slots=True)
class ResourceLine:
    resource: str
    allocatable: int
    booked: int
    devices: int
    """Of ``booked``: units of devices Bound here (the rest is pods' raw usage)."""

    @property
    def free(self) -> int:
        return self.allocatable - self.booked

    @property
    def pods(self) -> int:
        return self.booked - self.devices


@dataclass(frozen=True, slots=True)
class SetOnNode:
    """A set with devices Bound on the node: who, which devices, how many units."""

    namespace: str
    vm: str
    devices: tuple[models.GpuDevice, ...]
    units: dict[str, int]
    """resource -> units the set books here."""
    vmi_phase: str = ""
    vmi_node: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.vm}"


@dataclass(frozen=True, slots=True)
class PodOnNode:
    pod: models.Pod
    launcher_of: str
    """``namespace/vmi`` when the pod is that VMI's proven launcher, else ""."""
    raw_units: dict[str, int]
    """resource -> units the pod books here beyond its VMI's devices (raw usage for capacity)."""


@dataclass(frozen=True, slots=True)
class NodeReport:
    name: str
    row: models.Node | None
    """None: the node is gone from the mirror but devices still name it."""
    now: datetime
    resources: tuple[ResourceLine, ...]
    sets: tuple[SetOnNode, ...]
    pods: tuple[PodOnNode, ...]
    taints: tuple[e.Taint, ...] = ()
    states: tuple[str, ...] = field(default=())

    @property
    def exists(self) -> bool:
        return self.row is not None


def node_states(row: models.Node | None) -> tuple[str, ...]:
    """The words the staff pages put on a node: deleted, NotReady, cordoned, draining, tainted."""
    if row is None:
        return ("deleted",)
    states = []
    if not row.ready:
        states.append("NotReady")
    if row.unschedulable:
        states.append("cordoned")
    if row.draining:
        states.append("draining")
    if row.taints:
        states.append("tainted")
    return tuple(states)


def node_report(name: str, now: datetime | None = None) -> NodeReport | None:
    """The node page of ``name``, or None when no node and no device or pod has that name."""
    now = now or timezone.now()
    row = models.Node.objects.filter(name=name).first()
    devices = list(
        models.GpuDevice.objects.filter(node=name, phase=models.Phase.BOUND)
        .select_related("namespace")
        .order_by("namespace__name", "vm_name", "name")
    )
    pods = list(models.Pod.objects.filter(node=name).select_related("namespace").order_by("namespace__name", "name"))
    if row is None and not devices and not pods:
        return None
    namespaces = {d.namespace.name for d in devices} | {p.namespace.name for p in pods}
    vm_names = {d.vm_name for d in devices} | {p.owner_vmi_hint for p in pods if p.owner_vmi_hint}
    vmi_rows = models.VirtualMachineInstance.objects.filter(namespace__name__in=namespaces, name__in=vm_names)
    vmi_by_key = {(v.namespace.name, v.name): v for v in vmi_rows.select_related("namespace")}

    ledger = build_ledger(
        classes=read_rows("GPUClass"),
        nodes=read_rows("Node", queryset=models.Node.objects.filter(name=name)),
        devices=read_rows("GPU", queryset=models.GpuDevice.objects.filter(pk__in=[d.pk for d in devices])),
        pods=read_rows("Pod", queryset=models.Pod.objects.filter(pk__in=[p.pk for p in pods])),
        vmis=read_rows("VirtualMachineInstance", queryset=vmi_rows),
    )
    allocatable = dict(row.allocatable or {}) if row is not None else {}
    booked: Mapping[str, int] = ledger.booked.get(name, Counter())
    by_devices: Mapping[str, int] = ledger.device_booked.get(name, Counter())
    resources = tuple(
        ResourceLine(r, int(allocatable.get(r, 0)), booked.get(r, 0), by_devices.get(r, 0))
        for r in sorted(set(allocatable) | {r for r, n in booked.items() if n})
    )

    grouped: dict[tuple[str, str], list[models.GpuDevice]] = defaultdict(list)
    for device in devices:
        grouped[(device.namespace.name, device.vm_name)].append(device)
    units: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    pod_raw: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    pod_launcher: dict[tuple[str, str], str] = {}
    for holding in ledger.holdings_on(name):
        if holding.device is not None:
            units[holding.device.set_key][holding.resource] += holding.units
        elif holding.pod is not None:
            pod_raw[(holding.pod.namespace, holding.pod.name)][holding.resource] += holding.units
    for key, pairs in ledger.launcher_pods.items():
        for pod, _ in pairs:
            pod_launcher[(pod.namespace, pod.name)] = f"{key[0]}/{key[1]}"
    sets = []
    for key, members in grouped.items():
        vmi = vmi_by_key.get(key)
        sets.append(
            SetOnNode(
                key[0],
                key[1],
                tuple(members),
                dict(units.get(key, {})),
                vmi.phase if vmi else "",
                vmi.node if vmi else "",
            )
        )
    pod_lines = tuple(
        PodOnNode(
            pod,
            pod_launcher.get((pod.namespace.name, pod.name), ""),
            dict(pod_raw.get((pod.namespace.name, pod.name), {})),
        )
        for pod in pods
    )
    taints = tuple(ledger.nodes[name].taints) if name in ledger.nodes else ()
    return NodeReport(name, row, now, resources, tuple(sets), pod_lines, taints, node_states(row))


def node_preview(name: str, action: NodeAction, now: datetime | None = None) -> NodePreview:
    """The drain (or cordon, ...) preview of ``name``: the engine's next full pass on a copy
    of the whole mirror with the node changed (raises PreviewError for an unknown node)."""
    cluster, _ = read_cluster(now or timezone.now())
    return preview(cluster, name, action)

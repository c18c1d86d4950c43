"""Translate mirror rows (and freshly parsed objects) into the engine's dataclasses.

Passes, ``dump_state``, the catalog and the admin all need the cluster as the engine
sees it. Rows and parsed Kubernetes objects carry the same field names (the model's),
so one converter per kind serves both, and every consumer gets the same view (and the
same launcher rule, which lives in the engine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import QuerySet

from . import models
from .engine import types as e
from .kube import Parsed

Values = Mapping[str, Any]


def engine_settings() -> e.Settings:
    return e.Settings(
        enabled=settings.GPUPLANE_ENABLED,
        node_grace_seconds=settings.GPUPLANE_NODE_GRACE_SECONDS,
        default_budget=e.DefaultBudget(settings.GPUPLANE_DEFAULT_BUDGET),
    )


def _ints(mapping: Mapping[str, Any] | None) -> dict[str, int]:
    return {str(k): int(v) for k, v in (mapping or {}).items()}


def device_from(namespace: str, name: str, v: Values) -> e.Device:
    return e.Device(
        namespace=namespace,
        name=name,
        class_name=v["class_name"],
        vm_name=v["vm_name"],
        phase=e.Phase(v["phase"]),
        node=v["node"],
        since=v["since"],
        reason=v["reason"],
        bind_request=v["bind_request"],
        answered_request=v["answered_request"],
        answer=v["answer"],
        created=v["created"],
    )


def class_from(namespace: str, name: str, v: Values) -> e.GpuClass:
    return e.GpuClass(
        name=name,
        resource_name=v["resource_name"],
        units_per_device=int(v["units_per_device"]),
        node_selector=dict(v["node_selector"] or {}),
        display_name=v["display_name"],
    )


def node_from(namespace: str, name: str, v: Values) -> e.Node:
    return e.Node(
        name=name,
        allocatable=_ints(v["allocatable"]),
        labels=dict(v["labels"] or {}),
        unschedulable=v["unschedulable"],
        ready=v["ready"],
        ready_since=v["ready_since"],
    )


def budget_from(namespace: str, name: str, v: Values) -> e.Budget:
    return e.Budget(namespace=namespace, name=name, limits=_ints(v["limits"]))


def vmi_from(namespace: str, name: str, v: Values) -> e.Vmi:
    return e.Vmi(
        namespace=namespace,
        name=name,
        uid=v["uid"],
        active_pods=dict(v["active_pods"] or {}),
        node=v["node"],
        phase=v["phase"],
        device_names=tuple(v["device_names"] or ()),
    )


def pod_from(namespace: str, name: str, v: Values) -> e.Pod:
    return e.Pod(
        namespace=namespace,
        name=name,
        uid=v["uid"],
        node=v["node"],
        phase=v["phase"],
        requests=_ints(v["gpu_requests"]),
        owner_vmi=v["owner_vmi_hint"],
    )


#: kind -> (model, converter, the model fields the converter reads)
KINDS: dict[str, tuple[type[Any], Callable[[str, str, Values], Any], tuple[str, ...]]] = {
    "GPU": (
        models.GpuDevice,
        device_from,
        (
            "class_name",
            "vm_name",
            "phase",
            "node",
            "since",
            "reason",
            "bind_request",
            "answered_request",
            "answer",
            "created",
        ),
    ),
    "GPUClass": (models.GpuClass, class_from, ("resource_name", "units_per_device", "node_selector", "display_name")),
    "Node": (models.Node, node_from, ("allocatable", "labels", "unschedulable", "ready", "ready_since")),
    "GPUBudget": (models.GpuBudget, budget_from, ("limits",)),
    "VirtualMachineInstance": (
        models.VirtualMachineInstance,
        vmi_from,
        ("uid", "active_pods", "node", "phase", "device_names"),
    ),
    "Pod": (models.Pod, pod_from, ("uid", "node", "phase", "gpu_requests", "owner_vmi_hint")),
}


def from_parsed(parsed: Parsed) -> Any:
    """The engine record of a parsed Kubernetes object (tests and the cluster sync use it)."""
    _, convert, _ = KINDS[parsed.kind]
    return convert(parsed.namespace, parsed.name, parsed.values)


def read_rows(kind: str, namespaces: Iterable[str] | None = None, queryset: QuerySet | None = None) -> list[Any]:  # type: ignore[type-arg]
    """Engine records of every mirrored ``kind`` (optionally of some namespaces only)."""
    model, convert, fields = KINDS[kind]
    namespaced = hasattr(model, "NAMESPACE_LOOKUP")
    if queryset is None:
        queryset = model.objects.for_tenant(namespaces) if namespaced else model.objects.all()
    columns = ("namespace__name", "name", *fields) if namespaced else ("name", *fields)
    order = ("namespace__name", "name") if namespaced else ("name",)
    return [
        convert(row["namespace__name"] if namespaced else "", row["name"], row)
        for row in queryset.order_by(*order).values(*columns).iterator(chunk_size=5000)
    ]


def read_device_ids() -> dict[tuple[str, str], int]:
    """Device row ids by (namespace, name), for writing a pass's result back."""
    return {
        (ns, name): pk
        for pk, ns, name in models.GpuDevice.objects.order_by().values_list("id", "namespace__name", "name")
    }


def read_cluster(now: datetime) -> tuple[e.Cluster, dict[tuple[str, str], int]]:
    """The whole mirror as one engine snapshot (read inside the caller's transaction)."""
    cluster = e.Cluster(
        now=now,
        classes=tuple(read_rows("GPUClass")),
        nodes=tuple(read_rows("Node")),
        devices=tuple(read_rows("GPU")),
        budgets=tuple(read_rows("GPUBudget")),
        vmis=tuple(read_rows("VirtualMachineInstance")),
        pods=tuple(read_rows("Pod")),
        settings=engine_settings(),
    )
    return cluster, read_device_ids()

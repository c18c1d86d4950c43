"""Translate between mirror rows and the engine's dataclasses.

Passes, ``dump_state``, the catalog and the admin all need the cluster as the engine
sees it; reading it in one place keeps every consumer on the same view (and the same
launcher rule, which lives in the engine).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.db.models import QuerySet

from . import models
from .engine import types as e


def engine_settings() -> e.Settings:
    return e.Settings(
        enabled=settings.GPUPLANE_ENABLED,
        node_grace_seconds=settings.GPUPLANE_NODE_GRACE_SECONDS,
        default_budget=e.DefaultBudget(settings.GPUPLANE_DEFAULT_BUDGET),
    )


def device_from_row(row: dict) -> e.Device:  # type: ignore[type-arg]
    return e.Device(
        namespace=row["namespace__name"],
        name=row["name"],
        class_name=row["class_name"],
        vm_name=row["vm_name"],
        phase=e.Phase(row["phase"]),
        node=row["node"],
        since=row["since"],
        reason=row["reason"],
        bind_request=row["bind_request"],
        answered_request=row["answered_request"],
        answer=row["answer"],
        created=row["created"],
    )


DEVICE_FIELDS = (
    "id",
    "namespace__name",
    "name",
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
)


def read_devices(queryset: QuerySet | None = None) -> tuple[list[e.Device], dict[tuple[str, str], int]]:  # type: ignore[type-arg]
    """Devices as engine records, plus their row ids by (namespace, name)."""
    queryset = queryset if queryset is not None else models.GpuDevice.objects.all()
    devices, ids = [], {}
    for row in queryset.order_by().values(*DEVICE_FIELDS).iterator(chunk_size=5000):
        device = device_from_row(row)
        devices.append(device)
        ids[device.key] = row["id"]
    return devices, ids


def read_classes() -> list[e.GpuClass]:
    return [
        e.GpuClass(
            name=c.name,
            resource_name=c.resource_name,
            units_per_device=c.units_per_device,
            node_selector=dict(c.node_selector or {}),
            display_name=c.display_name,
        )
        for c in models.GpuClass.objects.order_by("name")
    ]


def read_nodes() -> list[e.Node]:
    return [
        e.Node(
            name=row["name"],
            allocatable={k: int(v) for k, v in (row["allocatable"] or {}).items()},
            labels=dict(row["labels"] or {}),
            unschedulable=row["unschedulable"],
            ready=row["ready"],
            ready_since=row["ready_since"],
        )
        for row in models.Node.objects.order_by("name").values(
            "name", "allocatable", "labels", "unschedulable", "ready", "ready_since"
        )
    ]


def read_budgets(namespaces: Iterable[str] | None = None) -> list[e.Budget]:
    queryset = models.GpuBudget.objects.for_tenant(namespaces).order_by("namespace__name", "name")
    return [
        e.Budget(
            namespace=row["namespace__name"], name=row["name"], limits={k: int(v) for k, v in row["limits"].items()}
        )
        for row in queryset.values("namespace__name", "name", "limits")
    ]


def read_vmis(namespaces: Iterable[str] | None = None) -> list[e.Vmi]:
    queryset = models.VirtualMachineInstance.objects.for_tenant(namespaces).order_by("namespace__name", "name")
    return [
        e.Vmi(
            namespace=row["namespace__name"],
            name=row["name"],
            uid=row["uid"],
            active_pods=dict(row["active_pods"] or {}),
            node=row["node"],
            phase=row["phase"],
            device_names=tuple(row["device_names"] or ()),
        )
        for row in queryset.values("namespace__name", "name", "uid", "active_pods", "node", "phase", "device_names")
    ]


def read_pods(namespaces: Iterable[str] | None = None) -> list[e.Pod]:
    queryset = models.Pod.objects.for_tenant(namespaces).order_by("namespace__name", "name")
    return [
        e.Pod(
            namespace=row["namespace__name"],
            name=row["name"],
            uid=row["uid"],
            node=row["node"],
            phase=row["phase"],
            requests={k: int(v) for k, v in (row["gpu_requests"] or {}).items()},
            owner_vmi=row["owner_vmi_hint"],
        )
        for row in queryset.values("namespace__name", "name", "uid", "node", "phase", "gpu_requests", "owner_vmi_hint")
    ]


def read_cluster(now: datetime) -> tuple[e.Cluster, dict[tuple[str, str], int]]:
    """The whole mirror as one engine snapshot (read inside the caller's transaction)."""
    devices, ids = read_devices()
    cluster = e.Cluster(
        now=now,
        classes=tuple(read_classes()),
        nodes=tuple(read_nodes()),
        devices=tuple(devices),
        budgets=tuple(read_budgets()),
        vmis=tuple(read_vmis()),
        pods=tuple(read_pods()),
        settings=engine_settings(),
    )
    return cluster, ids

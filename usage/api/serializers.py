"""The API's shapes: records, usage per key, GPU-hours, devices and decisions."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field, inline_serializer
from rest_framework import serializers

from binder import models as binder_models
from binder.reports.formatting import held_class
from usage.models import UsageRecord

# -- serializers ----------------------------------------------------------------------------


class Hours(serializers.FloatField):
    """GPU-hours, to the microhour (SQLite's julianday arithmetic leaves float dust)."""

    def to_representation(self, value: Any) -> float:  # type: ignore[override] # a JSON number, not str
        return round(float(value), 6)


class UsageRecordSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """One usage record. ``gpuHours`` = units × hours of the whole record (until now if open)."""

    subjectKind = serializers.CharField(source="subject_kind")
    subjectUid = serializers.CharField(source="subject_uid")
    vmName = serializers.CharField(source="vm_name")
    resourceName = serializers.CharField(source="resource_name")
    open = serializers.BooleanField(source="is_open")
    gpuHours = Hours(source="gpu_hours", help_text="units × hours, until now while open")
    openedByPass = serializers.IntegerField(source="opened_by_pass", allow_null=True)
    closedByPass = serializers.IntegerField(source="closed_by_pass", allow_null=True)

    class Meta:
        model = UsageRecord
        fields = [
            "id",
            "namespace",
            "subjectKind",
            "subject",
            "subjectUid",
            "vmName",
            "key",
            "resourceName",
            "units",
            "node",
            "phase",
            "start",
            "end",
            "open",
            "gpuHours",
            "openedByPass",
            "closedByPass",
            "borrowed",
        ]


class KeyUsageSerializer(serializers.Serializer):  # type: ignore[type-arg]
    key = serializers.CharField(help_text="a class name, or a raw resource name (contains /)")
    kind = serializers.ChoiceField(choices=["class", "raw"])
    used = serializers.IntegerField(help_text="units in use now")
    limit = serializers.IntegerField(allow_null=True, help_text="smallest limit over the tenant's budgets; null: none")
    remaining = serializers.IntegerField(allow_null=True, help_text="limit − used, at least 0; null: no limit")
    gpuHours = serializers.FloatField(
        source="gpu_hours", help_text="units × hours held in the window, counted as budgets count the key"
    )
    borrowing = serializers.IntegerField(
        allow_null=True, help_text="units the tenant may borrow beyond the limit while GPUs stand idle; null: none"
    )
    borrowed = serializers.IntegerField(help_text="units held now by borrowed sets (part of used)")
    borrowedGpuHours = serializers.FloatField(
        source="borrowed_gpu_hours", help_text="the share of gpuHours held by borrowed sets"
    )


class GpuHoursSerializer(serializers.Serializer):  # type: ignore[type-arg]
    total = serializers.FloatField(help_text="every record once: each GPU counted once")
    devices = serializers.FloatField(help_text="records of GPU devices (Bound or Lost)")
    pods = serializers.FloatField(help_text="pods' raw-name usage records")
    borrowed = serializers.FloatField(help_text="the share of total held by borrowed sets (lending)")


class TenantUsageSerializer(serializers.Serializer):  # type: ignore[type-arg]
    namespace = serializers.CharField()
    window = inline_serializer(
        "UsageWindow", fields={"from": serializers.DateTimeField(), "to": serializers.DateTimeField()}
    )
    asOf = serializers.DateTimeField(source="as_of", help_text="when usage was read")
    keys = KeyUsageSerializer(many=True)
    gpuHours = GpuHoursSerializer(source="gpu_hours")
    openRecords = UsageRecordSerializer(many=True, source="open_records")


class DeviceSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """A GPU device: where it is and why."""

    namespace = serializers.CharField(source="namespace.name")
    className = serializers.CharField(source="class_name", help_text="the class ordered first (spec.className)")
    alternativeClassNames = serializers.ListField(
        child=serializers.CharField(),
        source="alternative_class_names",
        help_text="further classes the order accepts, in order of preference (spec.alternativeClassNames)",
    )
    heldClassName = serializers.SerializerMethodField(
        method_name="held_class_of",
        help_text="the class the device is booked as: the choice it is held as while Bound or Lost, "
        "className while Pending; usage and budgets count it under this class",
    )
    vmName = serializers.CharField(source="vm_name")
    since = serializers.DateTimeField(allow_null=True)
    answer = serializers.CharField(help_text="the binder's answer to the latest bind request")
    borrowed = serializers.BooleanField(
        help_text="held by a borrowed set: lent beyond the tenant's limit on idle GPUs, and taken back "
        "only while its VM is not running (status.borrowed)"
    )
    reclaimFor = serializers.CharField(
        source="reclaim_for",
        help_text="<namespace>/<vm> of the waiting set this borrowed set is marked for: its GPUs go there "
        "once its VM stops (status.reclaimFor; empty: not marked)",
    )

    class Meta:
        model = binder_models.GpuDevice
        fields = [
            "namespace",
            "name",
            "className",
            "alternativeClassNames",
            "heldClassName",
            "vmName",
            "phase",
            "node",
            "since",
            "reason",
            "answer",
            "borrowed",
            "reclaimFor",
        ]

    @extend_schema_field(OpenApiTypes.STR)
    def held_class_of(self, device: binder_models.GpuDevice) -> str:
        return held_class(device)


class DecisionSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """One placement change of a device: which pass, from where to where, and why."""

    passId = serializers.IntegerField(source="pass_run_id")
    passKind = serializers.CharField(source="pass_run.kind")
    at = serializers.DateTimeField(source="created")
    vmName = serializers.CharField(source="vm_name")
    device = serializers.CharField(source="device_name")
    fromPhase = serializers.CharField(source="from_phase")
    fromNode = serializers.CharField(source="from_node")
    toPhase = serializers.CharField(source="to_phase")
    toNode = serializers.CharField(source="to_node")

    class Meta:
        model = binder_models.Decision
        fields = [
            "passId",
            "passKind",
            "at",
            "namespace",
            "vmName",
            "device",
            "fromPhase",
            "fromNode",
            "toPhase",
            "toNode",
            "reason",
        ]

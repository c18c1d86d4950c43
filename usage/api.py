"""The tenant API (SPEC §8): usage, usage records, devices and their decision history.

Every view here derives from :class:`TenantScopedMixin`, which is where tenant scoping
happens, once: querysets pass the user's visible namespaces to ``for_tenant``, and a
namespace in the URL that the user may not read answers 404 like one that does not
exist. Views only parse parameters, call the read functions in ``usage.queries`` and
serialize.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import UTC, datetime, time, timedelta
from typing import Any

from django import forms
from django.conf import settings
from django.db.models import Q, QuerySet
from django.http import StreamingHttpResponse
from django.utils import timezone
from django_filters import rest_framework as filters
from django_filters.fields import IsoDateTimeField
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import generics, serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import BaseRenderer, BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from binder import models as binder_models

from . import queries
from .models import RecordPhase, SubjectKind, UsageRecord
from .tenancy import Visible, may_read, visible_namespaces

# -- the base: authentication, scoping, 404 ---------------------------------------------------


class TenantScopedMixin:
    """Authenticated, tenant-scoped: the one place the API applies "who sees what".

    ``scoped_queryset()`` is the model's queryset limited to the user's namespaces;
    ``tenant(ns)`` returns ``ns`` if the user may read it and it is known, else raises
    404 (never 403, so another tenant's namespace names do not leak).
    """

    permission_classes = [IsAuthenticated]
    request: Request
    kwargs: dict[str, Any]
    scoped_model: Any = None

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        # DRF reads ``?format=`` as "the default renderer"; an empty format is a mistake.
        if request.query_params.get("format") == "":
            raise ValidationError({"format": ["must not be empty: json or csv, or leave it out"]})

    def visible(self) -> Visible:
        return visible_namespaces(self.request.user)

    def scoped_queryset(self) -> QuerySet[Any]:
        return self.scoped_model.objects.for_tenant(self.visible())  # type: ignore[no-any-return]

    def get_queryset(self) -> QuerySet[Any]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular reading the view
            return self.scoped_model.objects.none()  # type: ignore[no-any-return]
        return self.tenant_queryset()

    def tenant_queryset(self) -> QuerySet[Any]:
        """The view's rows; override to narrow ``scoped_queryset()`` further."""
        return self.scoped_queryset()

    def tenant(self, namespace: str | None = None) -> str:
        namespace = namespace if namespace is not None else self.kwargs["namespace"]
        if not may_read(self.request.user, namespace) or not queries.namespace_known(namespace):
            raise NotFound(f"namespace {namespace!r} not found")
        return namespace


class Pages(PageNumberPagination):
    """``?page=N&page_size=M`` (default 100, at most 1000).

    A page or size that is not a positive integer, or a size above 1000, is a 400 naming
    the parameter (DRF alone answers 404 "Invalid page" for ``page=0`` and silently
    ignores a bad size); a page past the last one is 404, as in DRF.
    """

    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> Any:
        self.check_parameters(request)
        return super().paginate_queryset(queryset, request, view)

    def check_parameters(self, request: Request) -> None:
        """400 naming ``page`` or ``page_size`` if either is given and not valid."""
        for name in (self.page_query_param, self.page_size_query_param):
            raw = request.query_params.get(name)
            if raw is None or raw == "last" and name == self.page_query_param:
                continue
            if not raw.isdigit() or int(raw) < 1:
                raise ValidationError({name: [f"must be a positive integer, got {raw!r}"]})
            if name == self.page_size_query_param and int(raw) > self.max_page_size:
                raise ValidationError({name: [f"must be at most {self.max_page_size}, got {raw}"]})

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"]["minimum"] = 1
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"]["maximum"] = self.max_page_size
        return parameters


NOT_FOUND = OpenApiResponse(
    inline_serializer("NotFound", fields={"detail": serializers.CharField()}),
    description="no such namespace or object, or not yours",
)
UNAUTHORIZED = OpenApiResponse(
    inline_serializer("Unauthorized", fields={"detail": serializers.CharField()}),
    description="no or bad credentials",
)
BAD_REQUEST = OpenApiResponse(
    OpenApiTypes.OBJECT, description='a parameter is invalid: the body names it, e.g. {"from": ["..."]}'
)


# -- time windows -------------------------------------------------------------------------


def in_utc(value: datetime) -> datetime:
    """``value`` in UTC, or a ValueError if that is outside the years 1-9999.

    Python accepts offsets up to ±23:59 and PostgreSQL only ±15:59, so every time a
    client sends is turned into UTC before it reaches a query (schemathesis found
    ``+19:10`` answering a 500).
    """
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{value.isoformat()} is outside the years 1-9999 in UTC") from None


class FlexibleDateTimeField(serializers.DateTimeField):
    """RFC 3339 / ISO 8601 date-time, or a plain date (its midnight, UTC); always in UTC."""

    def to_internal_value(self, value: Any) -> datetime:
        if isinstance(value, str) and len(value) == 10:
            try:
                day = datetime.strptime(value, "%Y-%m-%d").date()  # noqa: DTZ007 - a date, made aware below
            except ValueError:
                pass
            else:
                return datetime.combine(day, time.min, tzinfo=timezone.get_current_timezone())
        parsed = super().to_internal_value(value)
        try:
            return in_utc(parsed)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None


class UtcIsoDateTimeField(IsoDateTimeField):  # type: ignore[misc]
    """django-filter's ISO 8601 field, turned into UTC (see :func:`in_utc`)."""

    def to_python(self, value: Any) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return in_utc(parsed)
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None


class UtcIsoDateTimeFilter(filters.IsoDateTimeFilter):
    field_class = UtcIsoDateTimeField


class WindowSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """``from`` / ``to`` query parameters: the window GPU-hours are counted in."""

    to = FlexibleDateTimeField(required=False, help_text="end of the window (default: now)")

    def get_fields(self) -> dict[str, serializers.Field]:  # type: ignore[type-arg]
        fields = super().get_fields()
        fields["from"] = FlexibleDateTimeField(required=False, help_text="start of the window (default: to − 30 days)")
        return fields

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        # DRF reads an empty query parameter as absent; here it is a mistake worth saying.
        empty = {name: ["must be a date-time, not empty"] for name in ("from", "to") if data.get(name) == ""}
        if empty:
            raise serializers.ValidationError(empty)
        return super().to_internal_value(data)  # type: ignore[no-any-return]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        now = timezone.now()
        end = attrs.get("to") or now
        start = attrs.get("from") or end - timedelta(days=settings.GPUPLANE_USAGE_DEFAULT_DAYS)
        if start >= end:
            raise serializers.ValidationError({"from": [f"must be before to ({end.isoformat()})"]})
        return {"from": start, "to": end, "now": now}


#: RFC 3339 date-time, or a plain date (its midnight, UTC).
WHEN = {"type": "string", "anyOf": [{"format": "date-time"}, {"format": "date"}]}
WINDOW_PARAMETERS = [
    OpenApiParameter(
        "from",
        WHEN,
        OpenApiParameter.QUERY,
        description="start of the window, RFC 3339 date-time or YYYY-MM-DD (default: `to` − 30 days)",
    ),
    OpenApiParameter("to", WHEN, OpenApiParameter.QUERY, description="end of the window, like `from` (default: now)"),
]


# -- serializers ----------------------------------------------------------------------------


class Hours(serializers.FloatField):
    """GPU-hours, to the microhour (SQLite's julianday arithmetic leaves float dust)."""

    def to_representation(self, value: Any) -> float:
        return round(float(value), 6)


class UsageRecordSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """One usage record. ``gpuHours`` = units × hours of the whole record (until now if open)."""

    subjectKind = serializers.CharField(source="subject_kind")  # noqa: N815
    subjectUid = serializers.CharField(source="subject_uid")  # noqa: N815
    vmName = serializers.CharField(source="vm_name")  # noqa: N815
    resourceName = serializers.CharField(source="resource_name")  # noqa: N815
    open = serializers.BooleanField(source="is_open")
    gpuHours = Hours(source="gpu_hours", help_text="units × hours, until now while open")  # noqa: N815
    openedByPass = serializers.IntegerField(source="opened_by_pass", allow_null=True)  # noqa: N815
    closedByPass = serializers.IntegerField(source="closed_by_pass", allow_null=True)  # noqa: N815

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
        ]


class KeyUsageSerializer(serializers.Serializer):  # type: ignore[type-arg]
    key = serializers.CharField(help_text="a class name, or a raw resource name (contains /)")
    kind = serializers.ChoiceField(choices=["class", "raw"])
    used = serializers.IntegerField(help_text="units in use now (SPEC §3)")
    limit = serializers.IntegerField(allow_null=True, help_text="smallest limit over the tenant's budgets; null: none")
    remaining = serializers.IntegerField(allow_null=True, help_text="limit − used, at least 0; null: no limit")
    gpuHours = serializers.FloatField(  # noqa: N815
        source="gpu_hours", help_text="units × hours held in the window, counted as budgets count the key"
    )


class GpuHoursSerializer(serializers.Serializer):  # type: ignore[type-arg]
    total = serializers.FloatField(help_text="every record once: each GPU counted once")
    devices = serializers.FloatField(help_text="records of GPU devices (Bound or Lost)")
    pods = serializers.FloatField(help_text="pods' raw-name usage records")


class TenantUsageSerializer(serializers.Serializer):  # type: ignore[type-arg]
    namespace = serializers.CharField()
    window = inline_serializer(
        "UsageWindow", fields={"from": serializers.DateTimeField(), "to": serializers.DateTimeField()}
    )
    asOf = serializers.DateTimeField(source="as_of", help_text="when usage was read")  # noqa: N815
    keys = KeyUsageSerializer(many=True)
    gpuHours = GpuHoursSerializer(source="gpu_hours")  # noqa: N815
    openRecords = UsageRecordSerializer(many=True, source="open_records")  # noqa: N815


class DeviceSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """A GPU device: where it is and why."""

    namespace = serializers.CharField(source="namespace.name")
    className = serializers.CharField(source="class_name")  # noqa: N815
    vmName = serializers.CharField(source="vm_name")  # noqa: N815
    since = serializers.DateTimeField(allow_null=True)
    answer = serializers.CharField(help_text="the binder's answer to the latest bind request")

    class Meta:
        model = binder_models.GpuDevice
        fields = ["namespace", "name", "className", "vmName", "phase", "node", "since", "reason", "answer"]


class DecisionSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    """One placement change of a device: which pass, from where to where, and why."""

    passId = serializers.IntegerField(source="pass_run_id")  # noqa: N815
    passKind = serializers.CharField(source="pass_run.kind")  # noqa: N815
    at = serializers.DateTimeField(source="created")
    vmName = serializers.CharField(source="vm_name")  # noqa: N815
    device = serializers.CharField(source="device_name")
    fromPhase = serializers.CharField(source="from_phase")  # noqa: N815
    fromNode = serializers.CharField(source="from_node")  # noqa: N815
    toPhase = serializers.CharField(source="to_phase")  # noqa: N815
    toNode = serializers.CharField(source="to_node")  # noqa: N815

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


# -- filters --------------------------------------------------------------------------------


class StrictFilterSet(filters.FilterSet):
    """A FilterSet that refuses an empty value for a typed filter (choice, date-time, boolean).

    django-filter reads ``?phase=`` as "no filter"; for a typed parameter that is a client
    mistake (the OpenAPI schema says it is an enum or a date-time), so it is a 400 naming
    the parameter, not a silently unfiltered answer. Free-text filters may be empty.
    """

    def is_valid(self) -> bool:
        valid = super().is_valid()
        empty = [
            name
            for name, declared in self.filters.items()
            if self.data.get(name) == "" and not isinstance(declared, filters.CharFilter)
        ]
        for name in empty:
            self.form.add_error(name, "must not be empty (leave the parameter out to not filter)")
        return valid and not empty  # type: ignore[no-any-return]


class StrictBooleanField(forms.NullBooleanField):
    """``true``/``false`` (or ``1``/``0``); anything else is an error, not "no filter"."""

    def to_python(self, value: Any) -> bool | None:
        if value in (None, ""):
            return None
        if str(value).lower() in ("true", "1"):
            return True
        if str(value).lower() in ("false", "0"):
            return False
        raise forms.ValidationError(f"must be true or false, got {value!r}")

    def validate(self, value: Any) -> None:
        pass


class StrictBooleanFilter(filters.BooleanFilter):
    """A boolean filter whose raw value reaches :class:`StrictBooleanField` (django-filter's
    own widget turns anything unknown into "no filter" before the field sees it)."""

    field_class = StrictBooleanField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("widget", forms.TextInput)
        super().__init__(*args, **kwargs)


class UsageRecordFilter(StrictFilterSet):
    """Filters of ``usage-records``; ``from``/``to`` keep records that overlap the range."""

    key = filters.CharFilter(help_text="class name or raw resource name")
    phase = filters.ChoiceFilter(choices=RecordPhase.choices)
    subject = filters.CharFilter(help_text="device or pod name")
    subject_kind = filters.ChoiceFilter(choices=SubjectKind.choices)
    node = filters.CharFilter()
    vm = filters.CharFilter(field_name="vm_name")
    open = StrictBooleanFilter(field_name="end", lookup_expr="isnull", help_text="true: only open records")

    class Meta:
        model = UsageRecord
        fields: list[str] = []


def _held_at_or_after(queryset: QuerySet[UsageRecord], name: str, value: datetime) -> QuerySet[UsageRecord]:
    return queryset.filter(Q(end__isnull=True) | Q(end__gt=value))


# ``from`` is a Python keyword: declared after the class.
UsageRecordFilter.base_filters["from"] = UtcIsoDateTimeFilter(
    method=_held_at_or_after, help_text="records still held after this time (open, or ending later)"
)
UsageRecordFilter.base_filters["to"] = UtcIsoDateTimeFilter(
    field_name="start", lookup_expr="lt", help_text="records that started before this time"
)


class DeviceFilter(StrictFilterSet):
    namespace = filters.CharFilter(field_name="namespace__name")
    phase = filters.ChoiceFilter(choices=binder_models.Phase.choices)
    node = filters.CharFilter()
    vm = filters.CharFilter(field_name="vm_name")
    className = filters.CharFilter(field_name="class_name")  # noqa: N815
    reason = filters.CharFilter(lookup_expr="icontains", help_text="words the reason contains")

    class Meta:
        model = binder_models.GpuDevice
        fields: list[str] = []


# -- CSV ------------------------------------------------------------------------------------


class CSVRenderer(BaseRenderer):
    """``?format=csv``: the views stream CSV themselves; this only makes DRF accept it."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        # Errors (400/401/404) come through here as dicts: render them as one CSV row.
        out = io.StringIO()
        writer = csv.writer(out)
        if isinstance(data, dict):
            writer.writerow(["error"])
            writer.writerow([_flatten(data)])
        return out.getvalue().encode()


def _flatten(data: Any) -> str:
    if isinstance(data, dict):
        return "; ".join(f"{k}: {_flatten(v)}" for k, v in data.items())
    if isinstance(data, list):
        return ", ".join(_flatten(v) for v in data)
    return str(data)


CSV_COLUMNS = ["id", "namespace", "subjectKind", "subject", "subjectUid", "vmName", "key", "resourceName", "units",
               "node", "phase", "start", "end", "gpuHours", "openedByPass", "closedByPass"]  # fmt: skip


def csv_stream(queryset: QuerySet[UsageRecord]) -> Iterator[str]:
    """The records as CSV, a chunk of rows at a time (constant memory for any export)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(CSV_COLUMNS)
    rows = queryset.values_list(
        "id", "namespace", "subject_kind", "subject", "subject_uid", "vm_name", "key", "resource_name", "units",
        "node", "phase", "start", "end", "gpu_hours", "opened_by_pass", "closed_by_pass",
    )  # fmt: skip
    for count, row in enumerate(rows.iterator(chunk_size=2000), 1):
        values = list(row)
        values[11] = values[11].isoformat()
        values[12] = values[12].isoformat() if values[12] else ""
        values[13] = f"{float(values[13]):.6f}"
        writer.writerow(["" if v is None else v for v in values])
        if count % 500 == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


# -- views ----------------------------------------------------------------------------------


class TenantUsageView(TenantScopedMixin, APIView):
    """Current usage and limits per key, open records, and GPU-hours per key in a window."""

    scoped_model = UsageRecord

    @extend_schema(
        operation_id="tenant_usage",
        summary="Usage, limits and GPU-hours of one tenant",
        parameters=WINDOW_PARAMETERS,
        responses={200: TenantUsageSerializer, 400: BAD_REQUEST, 401: UNAUTHORIZED, 404: NOT_FOUND},
    )
    def get(self, request: Request, namespace: str) -> Response:
        namespace = self.tenant(namespace)
        window = WindowSerializer(data=request.query_params)
        window.is_valid(raise_exception=True)
        start, end, now = window.validated_data["from"], window.validated_data["to"], window.validated_data["now"]
        hours = queries.gpu_hours(namespace, start, end, now)
        records = queries.with_record_hours(self.scoped_queryset().filter(namespace=namespace).open(), now)
        body = {
            "namespace": namespace,
            "window": {"from": start, "to": end},
            "as_of": now,
            "keys": queries.key_usage(namespace, hours),
            "gpu_hours": {
                "total": round(hours.total, 6),
                "devices": round(hours.devices, 6),
                "pods": round(hours.pods, 6),
            },
            "open_records": list(records.order_by("start", "id")),
        }
        return Response(TenantUsageSerializer(body).data)


class UsageRecordListView(TenantScopedMixin, generics.ListAPIView):  # type: ignore[type-arg]
    """Usage records of one tenant, oldest first; ``?format=csv`` exports every match as CSV."""

    scoped_model = UsageRecord
    serializer_class = UsageRecordSerializer
    filterset_class = UsageRecordFilter
    pagination_class = Pages
    renderer_classes = [JSONRenderer, BrowsableAPIRenderer, CSVRenderer]

    def tenant_queryset(self) -> QuerySet[UsageRecord]:
        namespace = self.tenant()
        records = self.scoped_queryset().filter(namespace=namespace).order_by("start", "id")
        return queries.with_record_hours(records, timezone.now())

    @extend_schema(
        operation_id="tenant_usage_records",
        summary="Usage records of one tenant (filter, paginate, or export as CSV)",
        parameters=[
            OpenApiParameter(
                "format",
                OpenApiTypes.STR,
                OpenApiParameter.QUERY,
                enum=["json", "csv"],
                description="csv: every matching record as a CSV download (no pagination)",
            )
        ],
        responses={
            (200, "application/json"): UsageRecordSerializer(many=True),
            (200, "text/csv"): OpenApiTypes.STR,
            400: BAD_REQUEST,
            401: UNAUTHORIZED,
            404: NOT_FOUND,
        },
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        if getattr(request.accepted_renderer, "format", None) == "csv":
            self.paginator.check_parameters(request)  # ignored by the export, but still checked
            queryset = self.filter_queryset(self.get_queryset())
            response = StreamingHttpResponse(csv_stream(queryset), content_type="text/csv; charset=utf-8")
            stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
            response["Content-Disposition"] = f'attachment; filename="usage-{kwargs["namespace"]}-{stamp}.csv"'
            return response
        return super().get(request, *args, **kwargs)


class DeviceListView(TenantScopedMixin, generics.ListAPIView):  # type: ignore[type-arg]
    """GPU devices the user may read, with phase, node and the binder's reason."""

    scoped_model = binder_models.GpuDevice
    serializer_class = DeviceSerializer
    filterset_class = DeviceFilter
    pagination_class = Pages

    def tenant_queryset(self) -> QuerySet[binder_models.GpuDevice]:
        namespace = self.request.query_params.get("namespace")
        if namespace:
            self.tenant(namespace)  # another tenant's namespace: 404, as everywhere
        return self.scoped_queryset().select_related("namespace").order_by("namespace__name", "name")

    @extend_schema(
        operation_id="devices_list",
        responses={200: DeviceSerializer(many=True), 400: BAD_REQUEST, 401: UNAUTHORIZED, 404: NOT_FOUND},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        return super().get(request, *args, **kwargs)


class DeviceDetailView(TenantScopedMixin, generics.RetrieveAPIView):  # type: ignore[type-arg]
    """One GPU device."""

    scoped_model = binder_models.GpuDevice
    serializer_class = DeviceSerializer

    def get_object(self) -> binder_models.GpuDevice:
        namespace = self.tenant()
        device = (
            self.scoped_queryset()
            .select_related("namespace")
            .filter(namespace__name=namespace, name=self.kwargs["name"])
            .first()
        )
        if device is None:
            raise NotFound(f"GPU {namespace}/{self.kwargs['name']} not found")
        return device  # type: ignore[no-any-return]

    @extend_schema(
        operation_id="devices_retrieve", responses={200: DeviceSerializer, 401: UNAUTHORIZED, 404: NOT_FOUND}
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        return super().get(request, *args, **kwargs)


class DeviceDecisionsView(TenantScopedMixin, generics.ListAPIView):  # type: ignore[type-arg]
    """Every placement change of one device, newest first: "why is my GPU Lost?".

    The history outlives the device: a deleted device's decisions are still listed.
    """

    scoped_model = binder_models.Decision
    serializer_class = DecisionSerializer
    pagination_class = Pages

    def tenant_queryset(self) -> QuerySet[binder_models.Decision]:
        namespace = self.tenant()
        name = self.kwargs["name"]
        decisions = (
            self.scoped_queryset()
            .filter(namespace=namespace, device_name=name)
            .select_related("pass_run")
            .order_by("-created", "-id")
        )
        exists = binder_models.GpuDevice.objects.filter(namespace__name=namespace, name=name).exists()
        if not exists and not decisions.exists():
            raise NotFound(f"GPU {namespace}/{name} not found")
        return decisions  # type: ignore[no-any-return]

    @extend_schema(
        operation_id="devices_decisions",
        responses={200: DecisionSerializer(many=True), 400: BAD_REQUEST, 401: UNAUTHORIZED, 404: NOT_FOUND},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        return super().get(request, *args, **kwargs)

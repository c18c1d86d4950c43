"""The tenant API: usage, usage records, devices and their decision history.

Every view here derives from :class:`TenantScopedView`, which is where tenant scoping
happens, once: querysets pass the user's visible namespaces to ``for_tenant``, and a
namespace in the URL that the user may not read answers 404 like one that does not
exist. Views only parse parameters, call the read functions in ``usage.queries`` and
serialize.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics
from rest_framework.exceptions import NotFound
from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from binder import models as binder_models
from usage import queries
from usage.api.base import BAD_REQUEST, NOT_FOUND, UNAUTHORIZED, Pages, TenantScopedView
from usage.api.fields import WINDOW_PARAMETERS, WindowSerializer
from usage.api.filters import DeviceFilter, UsageRecordFilter
from usage.api.renderers import CSVRenderer, csv_stream
from usage.api.serializers import DecisionSerializer, DeviceSerializer, TenantUsageSerializer, UsageRecordSerializer
from usage.models import UsageRecord

# -- views ----------------------------------------------------------------------------------


class TenantUsageView(TenantScopedView):
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
        open_records = UsageRecord.objects.for_tenant(self.visible()).filter(namespace=namespace).open()
        records = queries.with_record_hours(open_records, now)
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


class UsageRecordListView(TenantScopedView, generics.ListAPIView):  # type: ignore[type-arg]
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
            assert isinstance(self.paginator, Pages)  # noqa: S101 - pagination_class is Pages
            self.paginator.check_parameters(request)  # ignored by the export, but still checked
            queryset = self.filter_queryset(self.get_queryset())
            response = StreamingHttpResponse(csv_stream(queryset), content_type="text/csv; charset=utf-8")
            stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
            response["Content-Disposition"] = f'attachment; filename="usage-{kwargs["namespace"]}-{stamp}.csv"'
            return response
        return super().get(request, *args, **kwargs)


class DeviceListView(TenantScopedView, generics.ListAPIView):  # type: ignore[type-arg]
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


class DeviceDetailView(TenantScopedView, generics.RetrieveAPIView):  # type: ignore[type-arg]
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


class DeviceDecisionsView(TenantScopedView, generics.ListAPIView):  # type: ignore[type-arg]
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
        return decisions

    @extend_schema(
        operation_id="devices_decisions",
        responses={200: DecisionSerializer(many=True), 400: BAD_REQUEST, 401: UNAUTHORIZED, 404: NOT_FOUND},
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        return super().get(request, *args, **kwargs)


# -- the entry points a newcomer types first -------------------------------------------------


@extend_schema(exclude=True)
class TenantUsageSlashView(TenantUsageView):
    """``.../usage/``: the same answer (clients and people add the slash; not in the schema)."""


@extend_schema(exclude=True)
class UsageRecordListSlashView(UsageRecordListView):
    """``.../usage-records/``: the same answer (not in the schema)."""


#: The endpoints ``GET /api/v1/`` lists: path under /api/v1/, what it answers.
ENDPOINTS = (
    ("tenants/{namespace}/usage?from=&to=", "usage and limits per key, open records, GPU-hours in the window"),
    ("tenants/{namespace}/usage-records", "usage records, paginated or ?format=csv; filters key, phase, subject, ..."),
    ("devices", "the GPU devices you may read; filters namespace, phase, node, vm, className, reason"),
    ("devices/{namespace}/{name}", "one device: phase, node, reason"),
    ("devices/{namespace}/{name}/decisions", "why a device is where it is: its placement changes"),
    ("catalog/gpu-options?namespace=", "the GPU classes a tenant may order, with budget and free units"),
)


class ApiRootView(generics.GenericAPIView):  # type: ignore[type-arg]
    """``GET /api/v1/``: what is here, so a first request finds its way (no data, no login)."""

    permission_classes: list[Any] = []
    authentication_classes: list[Any] = []

    @extend_schema(exclude=True)
    def get(self, request: Request) -> Response:
        base = request.build_absolute_uri("/api/v1/")
        return Response(
            {
                "endpoints": [{"url": base + path, "answers": what} for path, what in ENDPOINTS],
                "authentication": "Authorization: Token <token> (manage.py issue_token)",
                "schema": request.build_absolute_uri("/api/schema/"),
                "docs": request.build_absolute_uri("/api/docs/"),
            }
        )

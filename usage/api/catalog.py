"""``GET /api/v1/catalog/gpu-options?namespace=<ns>``: the GPU options of one tenant (SPEC §8).

The numbers come from the pure engine (``binder.engine.catalog.gpu_options``) over this
web process's read model of the mirror (``binder.runtime.readmodel``: in memory, brought
current from the change feed first, so "can I launch N now" holds every change committed
before the call), with the model's own ledger: they agree with the binder and
``dump_state`` (the same ledger, the same shared launcher reader).

Who may see which namespace: the API's one rule (``usage.tenancy``): staff see every
namespace, any other user the namespaces granted to them (``manage.py issue_token``).
A namespace the user may not see and one that does not exist both answer 404, so
namespace names do not leak.
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from binder.engine.catalog import gpu_options
from binder.mirror.read import engine_settings
from binder.runtime.readmodel import read_model
from usage.api.base import BAD_REQUEST, NOT_FOUND, UNAUTHORIZED, TenantScopedView
from usage.tenancy import NAMESPACE_NAME


class GpuOptionSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """One GPU class as offered to a tenant. ``limit``, ``used`` and ``clusterFree`` are units;
    ``remaining`` and ``largestSet`` are devices of the class."""

    name = serializers.CharField()
    displayName = serializers.CharField(source="display_name")
    resourceName = serializers.CharField(source="resource_name")
    unitsPerDevice = serializers.IntegerField(source="units_per_device")
    limit = serializers.IntegerField(allow_null=True, help_text="class-key budget limit in units; null: unlimited")
    used = serializers.IntegerField(help_text="units of the class key in use (Bound or Lost devices)")
    remaining = serializers.IntegerField(
        allow_null=True,
        help_text="devices the budget still allows (class key and raw key); null: unlimited",
    )
    clusterFree = serializers.IntegerField(
        source="cluster_free", help_text="free units on Ready, schedulable, non-draining matching nodes"
    )
    largestSet = serializers.IntegerField(
        source="largest_set", help_text="most devices one node can take now (capped by remaining)"
    )


class GpuOptionsView(TenantScopedView):
    """The GPU classes a tenant may order, with budget and free capacity."""

    @extend_schema(
        operation_id="catalog_gpu_options",
        summary="GPU options of one tenant",
        parameters=[
            OpenApiParameter(
                "namespace",
                OpenApiTypes.STR,
                OpenApiParameter.QUERY,
                required=True,
                description="tenant namespace",
                pattern=NAMESPACE_NAME.pattern,
            )
        ],
        responses={
            200: GpuOptionSerializer(many=True),
            400: BAD_REQUEST,
            401: UNAUTHORIZED,
            404: NOT_FOUND,
        },
    )
    def get(self, request: Request) -> Response:
        namespace = (request.query_params.get("namespace") or "").strip()
        if not namespace:
            raise ValidationError({"namespace": ["this query parameter is required"]})
        self.tenant(namespace)
        taken = read_model().snapshot(timezone.now(), engine_settings())
        options = gpu_options(taken.cluster, namespace, taken.ledger)
        return Response(GpuOptionSerializer(options, many=True).data)

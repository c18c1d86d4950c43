"""``GET /api/v1/catalog/gpu-options?namespace=<ns>``: the GPU options of one tenant (SPEC §8).

The numbers come from the pure engine (``binder.engine.catalog.gpu_options``) over one
consistent snapshot of the mirror, so they agree with the binder and ``dump_state``
(the same ledger, the same shared launcher reader).

Who may see which namespace. Until tenant grants arrive (issue 5, ``issue_token``):
staff see every namespace; any other user sees namespace ``ns`` only when they belong
to the Django group named ``tenant:<ns>``. A namespace the user may not see and one that
does not exist both answer 404, so namespace names do not leak.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from . import models
from .engine.catalog import gpu_options
from .mirror import read_cluster

#: The interim grant: membership of this group lets a user see the namespace.
TENANT_GROUP_PREFIX = "tenant:"


def may_see(user: Any, namespace: str) -> bool:
    """Staff see every namespace; others only those of their ``tenant:<ns>`` groups."""
    if user.is_staff:
        return True
    return bool(user.groups.filter(name=f"{TENANT_GROUP_PREFIX}{namespace}").exists())


class GpuOptionSerializer(serializers.Serializer):
    """One GPU class as offered to a tenant. ``limit``, ``used`` and ``clusterFree`` are units;
    ``remaining`` and ``largestSet`` are devices of the class."""

    name = serializers.CharField()
    displayName = serializers.CharField(source="display_name")  # noqa: N815
    resourceName = serializers.CharField(source="resource_name")  # noqa: N815
    unitsPerDevice = serializers.IntegerField(source="units_per_device")  # noqa: N815
    limit = serializers.IntegerField(allow_null=True, help_text="class-key budget limit in units; null: unlimited")
    used = serializers.IntegerField(help_text="units of the class key in use (Bound or Lost devices)")
    remaining = serializers.IntegerField(
        allow_null=True,
        help_text="devices the budget still allows (class key and raw key); null: unlimited",
    )
    clusterFree = serializers.IntegerField(  # noqa: N815
        source="cluster_free", help_text="free units on Ready, schedulable, non-draining matching nodes"
    )
    largestSet = serializers.IntegerField(  # noqa: N815
        source="largest_set", help_text="most devices one node can take now (capped by remaining)"
    )


ERROR = inline_serializer("CatalogError", fields={"error": serializers.CharField()})


class GpuOptionsView(APIView):
    """The GPU classes a tenant may order, with budget and free capacity."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [IsAuthenticated]

    @extend_schema(
        operation_id="catalog_gpu_options",
        summary="GPU options of one tenant",
        parameters=[
            OpenApiParameter(
                "namespace", OpenApiTypes.STR, OpenApiParameter.QUERY, required=True, description="tenant namespace"
            )
        ],
        responses={
            200: GpuOptionSerializer(many=True),
            400: OpenApiResponse(ERROR, description="namespace parameter missing"),
            401: OpenApiResponse(description="no or bad credentials"),
            404: OpenApiResponse(ERROR, description="no such namespace, or not yours"),
        },
    )
    def get(self, request: Request) -> Response:
        namespace = (request.query_params.get("namespace") or "").strip()
        if not namespace:
            return Response({"error": "query parameter 'namespace' is required"}, status=400)
        if not may_see(request.user, namespace) or not models.Namespace.objects.filter(name=namespace).exists():
            return Response({"error": f"namespace {namespace!r} not found"}, status=404)
        with transaction.atomic():
            cluster, _ = read_cluster(timezone.now())
        options = gpu_options(cluster, namespace)
        return Response(GpuOptionSerializer(options, many=True).data)

"""``GET /api/v1/catalog/gpu-options?namespace=<ns>``: the GPU options of one tenant, and
with ``&devices=N&classes=a,b`` whether an order of N devices accepting those classes (in that
order of preference) fits now, as which class, and the budget it would take.

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

import re
from collections.abc import Mapping

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, PolymorphicProxySerializer, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from binder.engine.catalog import gpu_options, order_fit
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
    borrowing = serializers.IntegerField(
        allow_null=True, help_text="class-key borrowing allowance in units beyond the limit; null: none"
    )
    borrowable = serializers.IntegerField(
        help_text="devices the tenant could borrow now: idle units no entitled order or Lost set waits for, "
        "within limit + borrowing (a borrowed set may be taken back while its VM is stopped)"
    )


#: A class name (a Kubernetes object name) and the most classes an order may list.
CLASS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
MAX_CHOICES = 9
MAX_ORDER_DEVICES = 1024
CLASSES_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(,[a-z0-9]([-a-z0-9.]*[a-z0-9])?){0,8}$"


class BudgetUseSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """One budget key the order would count under (units)."""

    key = serializers.CharField(help_text="class name or raw resource name")
    limit = serializers.IntegerField(allow_null=True, help_text="null: unlimited")
    used = serializers.IntegerField(help_text="units used now")
    after = serializers.IntegerField(help_text="units used once the order is placed")


class OrderFitSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """Whether an order fits now and as which of its classes (the binder's own rules:
    the first choice with room and budget wins, the fullest node within it)."""

    devices = serializers.IntegerField()
    choices = serializers.ListField(child=serializers.CharField(), help_text="the classes, first preference first")
    fits = serializers.BooleanField()
    className = serializers.CharField(source="class_name", help_text="the class it would be held as; empty if not")
    reason = serializers.CharField(help_text="the binder's sentence: where, or why not (each choice passed over)")
    budget = BudgetUseSerializer(many=True, help_text="the class key and raw key it would count under, if it fits")
    borrowed = serializers.BooleanField(
        help_text="it would borrow idle GPUs beyond the budget: it may be taken back while its VM is stopped"
    )


def _order(params: Mapping[str, str]) -> tuple[int, tuple[str, ...]] | None:
    """``devices`` and ``classes`` from the query (both or neither), checked; None when absent."""
    raw_devices, raw_classes = params.get("devices"), params.get("classes")
    if raw_devices is None and raw_classes is None:
        return None
    errors: dict[str, list[str]] = {}
    if raw_classes is None:
        errors["classes"] = ["required with devices: the classes the order accepts, e.g. classes=h100,a100"]
    if raw_devices is None:
        errors["devices"] = ["required with classes: how many devices the order has"]
    if errors or raw_devices is None or raw_classes is None:
        raise ValidationError(errors)
    devices = raw_devices.strip()
    if not devices.isdigit() or not 1 <= int(devices) <= MAX_ORDER_DEVICES:
        raise ValidationError(
            {"devices": [f"must be a whole number from 1 to {MAX_ORDER_DEVICES}, not {raw_devices!r:.40}"]}
        )
    names = tuple(n.strip() for n in raw_classes.split(","))
    bad = [n for n in names if not CLASS_NAME.match(n)]
    if bad:
        raise ValidationError({"classes": [f"{bad[0]!r:.70} is not a class name"]})
    if len(set(names)) != len(names):
        raise ValidationError({"classes": ["a class may be listed once"]})
    if len(names) > MAX_CHOICES:
        raise ValidationError({"classes": [f"at most {MAX_CHOICES} classes (a class and 8 alternatives)"]})
    return int(devices), names


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
            ),
            OpenApiParameter(
                "devices",
                OpenApiTypes.INT,
                OpenApiParameter.QUERY,
                description=f"with classes: ask whether an order of this many devices fits now (1-{MAX_ORDER_DEVICES})",
            ),
            OpenApiParameter(
                "classes",
                OpenApiTypes.STR,
                OpenApiParameter.QUERY,
                description="with devices: the classes the order accepts, first preference first (comma-separated)",
                pattern=CLASSES_PATTERN,
            ),
        ],
        responses={
            200: PolymorphicProxySerializer(
                component_name="GpuOptionsOrOrderFit",
                serializers=[GpuOptionSerializer(many=True), OrderFitSerializer],
                resource_type_field_name=None,
                many=False,
            ),
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
        order = _order(request.query_params)
        taken = read_model().snapshot(timezone.now(), engine_settings())
        if order is not None:
            devices, choices = order
            # The snapshot's ledger is this call's own copy: the probe order may be placed in it.
            fit = order_fit(taken.cluster, namespace, devices, choices, scratch=taken.ledger)
            return Response(OrderFitSerializer(fit).data)
        options = gpu_options(taken.cluster, namespace, taken.ledger)
        return Response(GpuOptionSerializer(options, many=True).data)

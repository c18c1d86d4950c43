"""URLs of the tenant API (mounted under ``/api/v1/``)."""

from django.urls import path

from usage.api import views as api

urlpatterns = [
    path("tenants/<str:namespace>/usage", api.TenantUsageView.as_view(), name="tenant-usage"),
    path("tenants/<str:namespace>/usage-records", api.UsageRecordListView.as_view(), name="tenant-usage-records"),
    path("devices", api.DeviceListView.as_view(), name="devices"),
    path("devices/<str:namespace>/<str:name>", api.DeviceDetailView.as_view(), name="device"),
    path("devices/<str:namespace>/<str:name>/decisions", api.DeviceDecisionsView.as_view(), name="device-decisions"),
]

"""URLs of the tenant API (mounted under ``/api/v1/``)."""

from django.urls import path

from usage.api import views as api

urlpatterns = [
    path("", api.ApiRootView.as_view(), name="api-root"),
    path("tenants/<str:namespace>/usage", api.TenantUsageView.as_view(), name="tenant-usage"),
    path("tenants/<str:namespace>/usage/", api.TenantUsageSlashView.as_view()),
    path("tenants/<str:namespace>/usage-records", api.UsageRecordListView.as_view(), name="tenant-usage-records"),
    path("tenants/<str:namespace>/usage-records/", api.UsageRecordListSlashView.as_view()),
    path("devices", api.DeviceListView.as_view(), name="devices"),
    path("devices/<str:namespace>/<str:name>", api.DeviceDetailView.as_view(), name="device"),
    path("devices/<str:namespace>/<str:name>/decisions", api.DeviceDecisionsView.as_view(), name="device-decisions"),
]

"""Usage records in the staff admin (SPEC §8): read-only, filtered by tenant and date, CSV.

Records are the billing history, so staff may look and export, never add, change or
delete (the model refuses those anyway). The CSV export is the tenant API's own
stream (``usage.api.renderers.csv_stream``), so staff and tenants get the same columns and
numbers for the same records.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, StreamingHttpResponse
from django.urls import URLPattern, path
from django.utils import timezone

from usage import queries
from usage.api.renderers import csv_stream
from usage.models import UsageRecord


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["namespace", "subject_kind", "subject", "vm_name", "key", "units", "node", "phase", "start", "end"]
    list_filter = ["phase", "subject_kind", "namespace", "key", ("end", admin.EmptyFieldListFilter)]
    search_fields = ["namespace", "subject", "vm_name", "node"]
    date_hierarchy = "start"
    ordering = ["-start", "-id"]
    list_per_page = 100
    actions = ["export_csv"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        export = path("export.csv", self.admin_site.admin_view(self.export_view), name="usage_usagerecord_export")
        return [export, *super().get_urls()]

    def export_view(self, request: HttpRequest) -> StreamingHttpResponse:
        """Every record the changelist shows with the current filters, as CSV."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        changelist = self.get_changelist_instance(request)
        return self._csv(changelist.get_queryset(request))

    @admin.action(description="Export the selected records as CSV")
    def export_csv(self, request: HttpRequest, queryset: QuerySet[UsageRecord]) -> StreamingHttpResponse:
        return self._csv(queryset)

    def _csv(self, queryset: QuerySet[UsageRecord]) -> StreamingHttpResponse:
        records = queries.with_record_hours(queryset.order_by("start", "id"), timezone.now())
        response = StreamingHttpResponse(csv_stream(records), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="usage-{timezone.now():%Y%m%dT%H%M%SZ}.csv"'
        return response

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        query = request.GET.urlencode()
        extra = {"export_url": f"export.csv{'?' + query if query else ''}", **(extra_context or {})}
        return super().changelist_view(request, extra)

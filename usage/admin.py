"""Usage records in the staff admin: read-only, filtered by tenant and date, CSV.

Records are the billing history, so staff may look and export, never add, change or
delete (the model refuses those anyway). The CSV export is the tenant API's own
stream (``usage.api.renderers.csv_stream``), so staff and tenants get the same columns and
numbers for the same records.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, StreamingHttpResponse
from django.urls import URLPattern, path
from django.utils import timezone

from usage import queries
from usage.api.renderers import csv_stream
from usage.models import NamespaceGrant, UsageRecord
from usage.tenancy import NAMESPACE_NAME


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "namespace", "subject_kind", "subject", "vm_name", "key", "units", "node", "phase", "borrowed", "start", "end"
    ]  # fmt: skip
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


class GrantForm(forms.ModelForm):  # type: ignore[type-arg]
    """A grant names one token and one namespace (a Kubernetes namespace name)."""

    class Meta:
        model = NamespaceGrant
        fields = ["token", "namespace", "namespace_uid"]

    def clean_namespace(self) -> str:
        name: str = self.cleaned_data["namespace"].strip()
        if not NAMESPACE_NAME.match(name):
            raise forms.ValidationError(f"{name[:63]!r} is not a namespace name (lower-case letters, digits and '-')")
        return name


@admin.register(NamespaceGrant)
class NamespaceGrantAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Which API token reads which namespace: staff see, add, change and remove grants here
    (``issue_token`` makes them, ``revoke_token`` removes a token with its grants). The
    grant's user is always its token's user."""

    form = GrantForm
    list_display = ["namespace", "token_key", "user", "namespace_uid", "token_expiry", "created"]
    list_filter = ["namespace"]
    search_fields = ["namespace", "user__username", "token__token_key"]
    list_select_related = ["token", "user"]
    raw_id_fields = ["token"]
    readonly_fields = ["user", "created"]

    @admin.display(description="token key", ordering="token__token_key")
    def token_key(self, obj: NamespaceGrant) -> str:
        return str(obj.token.token_key)

    @admin.display(description="token expires", ordering="token__expiry")
    def token_expiry(self, obj: NamespaceGrant) -> Any:
        return obj.token.expiry or "never"

    def save_model(self, request: HttpRequest, obj: NamespaceGrant, form: Any, change: bool) -> None:
        obj.user = obj.token.user
        super().save_model(request, obj, form, change)

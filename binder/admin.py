"""The staff admin: where every GPU is, what is Lost and why, and the pass history.

Placement fields are read-only here: the binder is their only writer (SPEC §4), so
staff change placement by changing the cluster (nodes, classes, budgets) or by asking
for a pass, never by editing a device's node by hand.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from binder import models
from binder.actions import full_pass_now, retry_lost_set
from binder.engine import ledger_for
from binder.mirror.read import read_cluster
from binder.reports.explanations import explanation_html, explanations_now


@admin.action(description="Run a full pass now")
def run_full_pass(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet) -> None:  # type: ignore[type-arg]
    outcome = full_pass_now()
    modeladmin.message_user(request, outcome.message, messages.ERROR if outcome.error else messages.SUCCESS)


class ParseErrorFilter(admin.SimpleListFilter):
    """Rows whose object in the cluster stopped parsing (they keep their last good state)."""

    title = "parses"
    parameter_name = "parse_error"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "stopped parsing"), ("no", "parses")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.exclude(parse_error="")
        if self.value() == "no":
            return queryset.filter(parse_error="")
        return queryset


@admin.register(models.SyncStatus)
class SyncStatusAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """What the cluster sync refused and why, per kind (read-only: the sync writes it)."""

    list_display = ["kind", "resource_version", "listed", "events", "invalid", "last_invalid", "errors", "last_error"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(models.Namespace)
class NamespaceAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["name", "device_count", "created", "parse_error"]
    search_fields = ["name"]

    @admin.display(description="devices")
    def device_count(self, obj: models.Namespace) -> int:
        return obj.devices.count()


@admin.register(models.Node)
class NodeAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["name", "ready", "unschedulable", "draining", "gpu_booking", "ready_since", "parse_error"]
    list_filter = [ParseErrorFilter, "ready", "unschedulable"]
    search_fields = ["name"]
    actions = [run_full_pass]

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        cluster, _ = read_cluster(timezone.now())
        self._ledger = ledger_for(cluster)
        return super().changelist_view(request, extra_context)

    @admin.display(boolean=True)
    def draining(self, obj: models.Node) -> bool:
        return obj.draining

    @admin.display(description="booked / allocatable (free)")
    def gpu_booking(self, obj: models.Node) -> str:
        ledger = getattr(self, "_ledger", None)
        if ledger is None:
            return ""
        resources = sorted(set(obj.allocatable) | {r for r, n in ledger.booked.get(obj.name, {}).items() if n})
        return format_html_join(
            ", ",
            "{} {}/{} ({})",
            ((r, ledger.booked[obj.name][r], obj.allocatable.get(r, 0), ledger.free(obj.name, r)) for r in resources),
        )


@admin.register(models.GpuClass)
class GpuClassAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "name",
        "display_name",
        "resource_name",
        "units_per_device",
        "status_allocatable",
        "status_bound",
        "status_lost",
        "parse_error",
    ]
    search_fields = ["name", "resource_name", "display_name"]
    readonly_fields = ["status_allocatable", "status_bound", "status_lost"]


@admin.register(models.GpuDevice)
class GpuDeviceAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["name", "namespace", "vm_name", "class_name", "phase", "node", "since", "reason", "parse_error"]
    list_filter = [ParseErrorFilter, "phase", "class_name", "namespace", "node"]
    search_fields = ["name", "vm_name", "node", "reason"]
    list_select_related = ["namespace"]
    # placement belongs to the binder and bind_request to the webhook (SPEC §4, §5)
    readonly_fields = [
        "phase",
        "node",
        "since",
        "reason",
        "bind_request",
        "answered_request",
        "answer",
        "decision_history",
        "placement_explanation",
    ]
    actions = [run_full_pass]

    # -- issue 18 item 1: why a Lost or Pending device's set does not fit, worked out now --
    @admin.display(description="why not placed, now")
    def placement_explanation(self, obj: models.GpuDevice) -> str:
        if obj.pk is None or obj.phase == models.Phase.BOUND:
            return "-"
        why = explanations_now(timezone.now()).get((obj.namespace.name, obj.vm_name))
        return explanation_html(why) if why else "-"

    @admin.display(description="why is this GPU here?")
    def decision_history(self, obj: models.GpuDevice) -> str:
        if obj.pk is None:
            return "-"
        log = reverse("admin:decisions")
        links = format_html(
            '<p><a class="decision-log-device" href="{}?{}">decision log of this device</a> · '
            '<a class="decision-log-set" href="{}?{}">of its set (VM {})</a></p>',
            log,
            urlencode({"namespace": obj.namespace.name, "device": obj.name}),
            log,
            urlencode({"namespace": obj.namespace.name, "vm": obj.vm_name}),
            obj.vm_name,
        )
        rows = models.Decision.objects.filter(namespace=obj.namespace.name, device_name=obj.name)[:50]
        if not rows:
            return format_html("{}no placement changes recorded", links)
        return format_html(
            "{}<table><tr><th>when</th><th>pass</th><th>from</th><th>to</th><th>reason</th></tr>{}</table>",
            links,
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{} {}</td><td>{} {}</td><td>{}</td></tr>",
                ((d.created, d.pass_run_id, d.from_phase, d.from_node, d.to_phase, d.to_node, d.reason) for d in rows),
            ),
        )


@admin.register(models.GpuBudget)
class GpuBudgetAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["name", "namespace", "usage_vs_limit", "parse_error"]
    list_filter = [ParseErrorFilter, "namespace"]
    readonly_fields = ["used"]

    @admin.display(description="used / limit")
    def usage_vs_limit(self, obj: models.GpuBudget) -> str:
        return format_html_join(
            ", ", "{}: {}/{}", ((k, (obj.used or {}).get(k, 0), v) for k, v in sorted(obj.limits.items()))
        )


@admin.register(models.VirtualMachineInstance)
class VmiAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["name", "namespace", "phase", "node", "active_pod_count", "parse_error"]
    list_filter = [ParseErrorFilter, "phase", "namespace"]
    search_fields = ["name", "uid"]

    @admin.display(description="active pods")
    def active_pod_count(self, obj: models.VirtualMachineInstance) -> int:
        return len(obj.active_pods or {})


@admin.register(models.Pod)
class PodAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["name", "namespace", "phase", "node", "gpu_requests", "owner_kind", "owner_name", "parse_error"]
    list_filter = [ParseErrorFilter, "phase", "namespace"]
    search_fields = ["name", "uid", "owner_name"]


class DecisionInline(admin.TabularInline):  # type: ignore[type-arg]
    model = models.Decision
    extra = 0
    can_delete = False
    fields = ("namespace", "vm_name", "device_name", "from_phase", "from_node", "to_phase", "to_node", "reason")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(models.PassRun)
class PassRunAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "id",
        "kind",
        "started",
        "duration_ms",
        "devices_seen",
        "devices_written",
        "bound",
        "moved",
        "lost",
        "refused",
        "restored",
        "skipped",
    ]
    list_filter = ["kind"]
    inlines = [DecisionInline]
    actions = [run_full_pass]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(models.Decision)
class DecisionAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "created",
        "pass_run",
        "namespace",
        "vm_name",
        "device_name",
        "from_phase",
        "from_node",
        "to_phase",
        "to_node",
        "reason",
    ]
    list_filter = ["to_phase", "namespace"]
    search_fields = ["device_name", "vm_name", "reason", "from_node", "to_node"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(models.LostSet)
class LostSetAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Every Lost set with tenant, VM, devices, since when, why, and whether its VMI runs."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # This view replaces the stock changelist, so it must make the stock permission checks.
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            if not self.has_change_permission(request):
                raise PermissionDenied
            namespace, _, vm = request.POST.get("retry", "").partition("/")
            if namespace and vm:
                outcome = retry_lost_set(namespace, vm)
                level = messages.ERROR if outcome.outcome.error else messages.SUCCESS
                self.message_user(request, outcome.message, level)
            else:
                self.message_user(request, "Say which set to retry: namespace/VM.", messages.ERROR)
            # Post/redirect/get: reloading the page must not queue another pass.
            return HttpResponseRedirect(request.get_full_path())
        lost = models.GpuDevice.objects.filter(phase=models.Phase.LOST).select_related("namespace")
        sets: dict[tuple[str, str], list[models.GpuDevice]] = defaultdict(list)
        for device in lost.order_by("namespace__name", "vm_name", "name"):
            sets[(device.namespace.name, device.vm_name)].append(device)
        vmis = {
            (v.namespace.name, v.name): v
            for v in models.VirtualMachineInstance.objects.select_related("namespace").filter(
                name__in={vm for _, vm in sets}
            )
        }
        rows = []
        for (namespace, vm), devices in sets.items():
            vmi = vmis.get((namespace, vm))
            rows.append(
                {
                    "namespace": namespace,
                    "vm": vm,
                    "devices": devices,
                    "since": min((d.since for d in devices if d.since), default=None),
                    "reason": devices[0].reason,
                    "vmi_running": bool(vmi and vmi.phase == "Running"),
                    "vmi_node": vmi.node if vmi else "",
                    "device_url": reverse("admin:binder_gpudevice_changelist")
                    + f"?phase__exact=Lost&namespace__id__exact={devices[0].namespace_id}&q={vm}",
                    "decisions_url": reverse("admin:decisions") + "?" + urlencode({"namespace": namespace, "vm": vm}),
                }
            )
        context = {
            **self.admin_site.each_context(request),
            "title": "Lost sets",
            "opts": self.model._meta,
            "rows": rows,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/binder/lost_sets.html", context)


@admin.register(models.BindAnswer)
class BindAnswerAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["answered_at", "namespace", "device_name", "request", "allowed", "latency_ms", "answer"]
    list_filter = ["allowed", "namespace"]
    search_fields = ["device_name", "request", "answer"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

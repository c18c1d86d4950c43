"""The staff admin: where every GPU is, what is Lost and why, and the pass history.

Placement fields are read-only here: the binder is their only writer, so
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

from binder import apiserver, models
from binder.actions import full_pass_now, retry_lost_set, staff_trigger
from binder.engine import ledger_for
from binder.mirror.read import read_cluster
from binder.reports.explanations import explanation_html, explanation_of
from binder.reports.formatting import age, duration_ms, duration_s, iso


@admin.action(description="Run a full pass now")
def run_full_pass(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet) -> None:  # type: ignore[type-arg]
    outcome = full_pass_now(staff_trigger(request.user.get_username()))
    modeladmin.message_user(request, outcome.message, messages.ERROR if outcome.error else messages.SUCCESS)


#: A retry is a success only when the set is Bound afterwards (binder.actions.RetryOutcome.level).
RETRY_LEVELS = {
    "error": messages.ERROR,
    "warning": messages.WARNING,
    "info": messages.INFO,
    "success": messages.SUCCESS,
}


def node_link(name: str) -> str:
    """A node name linked to its node page (``admin:node-detail``); "-" for no node."""
    if not name:
        return "-"
    return format_html('<a class="node-link" href="{}">{}</a>', reverse("admin:node-detail", args=[name]), name)


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


class AuditAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """A record of what happened (passes, decisions, answers, sync status): shown, never
    added, edited or deleted by hand, or the trail would stop proving anything."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class MirrorAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """A mirrored cluster object. In cluster mode the API server owns it and the sync
    writes the row, so a hand edit would be overwritten (or, worse, decided on until then):
    read-only. In standalone mode the database is the source of truth and staff
    edit it here, except the fields the binder or the webhook own (``readonly_fields``)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return not apiserver.cluster_mode() and super().has_add_permission(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not apiserver.cluster_mode() and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not apiserver.cluster_mode() and super().has_delete_permission(request, obj)


@admin.register(models.SyncStatus)
class SyncStatusAdmin(AuditAdmin):
    """What the cluster sync refused and why, per kind (read-only: the sync writes it)."""

    list_display = [
        "kind",
        "resource_version",
        "listed",
        "events",
        "lag",
        "invalid",
        "last_invalid",
        "errors",
        "last_error",
    ]
    exclude = ["lag_seconds"]
    readonly_fields = ["lag"]

    @admin.display(description="last event's lag")
    def lag(self, obj: models.SyncStatus) -> str:
        return duration_s(obj.lag_seconds)


@admin.register(models.Namespace)
class NamespaceAdmin(MirrorAdmin):
    list_display = ["name", "device_count", "created", "parse_error"]
    search_fields = ["name"]

    @admin.display(description="devices")
    def device_count(self, obj: models.Namespace) -> int:
        return obj.devices.count()


@admin.register(models.Node)
class NodeAdmin(MirrorAdmin):
    list_display = [
        "name",
        "node_page",
        "ready",
        "unschedulable",
        "draining",
        "gpu_booking",
        "ready_since",
        "parse_error",
    ]
    list_filter = [ParseErrorFilter, "ready", "unschedulable"]
    search_fields = ["name"]
    actions = [run_full_pass]

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        cluster, _ = read_cluster(timezone.now())
        self._ledger = ledger_for(cluster)
        return super().changelist_view(request, extra_context)

    @admin.display(description="devices and pods")
    def node_page(self, obj: models.Node) -> str:
        return format_html(
            '<a class="node-link" href="{}">node page</a>', reverse("admin:node-detail", args=[obj.name])
        )

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
class GpuClassAdmin(MirrorAdmin):
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
class GpuDeviceAdmin(MirrorAdmin):
    list_display = [
        "name",
        "namespace",
        "vm_name",
        "held_class",
        "phase",
        "node_name",
        "since_age",
        "lending",
        "reason",
        "parse_error",
    ]
    list_filter = [ParseErrorFilter, "phase", "borrowed", "class_name", "namespace", "node"]
    search_fields = ["name", "vm_name", "namespace__name", "node", "reason"]
    list_select_related = ["namespace"]
    # placement belongs to the binder and bind_request to the webhook
    readonly_fields = [
        "status_class_name",
        "phase",
        "node",
        "since",
        "reason",
        "bind_request",
        "answered_request",
        "answer",
        "borrowed",
        "reclaim_for",
    ]
    actions = [run_full_pass]

    @admin.display(description="lending", ordering="borrowed")
    def lending(self, obj: models.GpuDevice) -> str:
        """Borrowed beyond the tenant's limits, and the set a mark wants the GPUs back for."""
        if not obj.borrowed:
            return ""
        if obj.reclaim_for:
            return f"borrowed; marked for {obj.reclaim_for}: waits for its VM to stop"
        return "borrowed"

    @admin.display(description="node", ordering="node")
    def node_name(self, obj: models.GpuDevice) -> str:
        return node_link(obj.node)

    @admin.display(description="class", ordering="class_name")
    def held_class(self, obj: models.GpuDevice) -> str:
        """The class the device is booked as (held as, while Bound or Lost) and, for a
        device with alternatives, every choice in order."""
        if not obj.alternative_class_names:
            return obj.class_name
        held = obj.status_class_name if obj.phase != models.Phase.PENDING and obj.status_class_name else ""
        choices = ", ".join([obj.class_name, *obj.alternative_class_names])
        return f"{held} (choices {choices})" if held else f"{obj.class_name} (choices {choices})"

    @admin.display(description="since", ordering="since")
    def since_age(self, obj: models.GpuDevice) -> str:
        if obj.since is None:
            return "-"
        return f"{iso(obj.since)} ({obj.phase} {age(obj.since)})"

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The device page leads with what staff come for, read-only: phase, node (or the
        node a Lost device was lost from), the class held, why, and the decisions; the raw
        mirror row's form follows, folded, only for who may edit it (standalone mode)."""
        device = self.get_object(request, object_id)
        context = dict(extra_context or {})
        if device is not None:
            context["device_status"] = {
                "phase": device.phase,
                "node": device.node,
                "lost_from": lost_from(device) if device.phase == models.Phase.LOST else "",
                "held_class": self.held_class(device),
                "set": f"{device.namespace.name}/{device.vm_name}",
                "since": self.since_age(device),
                "reason": device.reason,
                "explanation": self.placement_explanation(device),
                "decisions": self.decision_history(device),
            }
        return super().change_view(request, object_id, form_url, extra_context=context)

    # -- why a Lost or Pending device's set does not fit, worked out now --
    @admin.display(description="why not placed, now")
    def placement_explanation(self, obj: models.GpuDevice) -> str:
        if obj.pk is None or obj.phase == models.Phase.BOUND:
            return "-"
        why = explanation_of((obj.namespace.name, obj.vm_name), timezone.now())
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
                (
                    (iso(d.created), d.pass_run_id, d.from_phase, d.from_node, d.to_phase, d.to_node, d.reason)
                    for d in rows
                ),
            ),
        )


def lost_from(device: models.GpuDevice) -> str:
    """The node a Lost device was lost from: its last decision into Lost says (a Lost
    device holds no node of its own)."""
    return (
        models.Decision.objects.filter(
            namespace=device.namespace.name, device_name=device.name, to_phase=models.Phase.LOST
        )
        .exclude(from_node="")
        .values_list("from_node", flat=True)
        .first()
        or ""
    )


@admin.register(models.GpuBudget)
class GpuBudgetAdmin(MirrorAdmin):
    list_display = ["name", "namespace", "usage_vs_limit", "borrowing_vs_borrowed", "parse_error"]
    list_filter = [ParseErrorFilter, "namespace"]
    readonly_fields = ["used", "borrowed"]

    @admin.display(description="used / limit")
    def usage_vs_limit(self, obj: models.GpuBudget) -> str:
        return format_html_join(
            ", ", "{}: {}/{}", ((k, (obj.used or {}).get(k, 0), v) for k, v in sorted(obj.limits.items()))
        )

    @admin.display(description="borrowed / borrowing")
    def borrowing_vs_borrowed(self, obj: models.GpuBudget) -> str:
        """Units held by borrowed sets against what the budget lets the tenant borrow."""
        keys = sorted(set(obj.borrowing or {}) | set(obj.borrowed or {}))
        return format_html_join(
            ", ", "{}: {}/{}", ((k, (obj.borrowed or {}).get(k, 0), (obj.borrowing or {}).get(k, 0)) for k in keys)
        )


@admin.register(models.VirtualMachine)
class VirtualMachineAdmin(MirrorAdmin):
    """KubeVirt VirtualMachines: where each VM may start (making room moves a stopped VM's set only there)."""

    list_display = ["name", "namespace", "node_selector", "affinity_terms", "parse_error"]
    list_filter = [ParseErrorFilter, "namespace"]
    search_fields = ["name", "uid", "namespace__name"]

    @admin.display(description="required node affinity")
    def affinity_terms(self, obj: models.VirtualMachine) -> str:
        return "none" if obj.affinity is None else f"{len(obj.affinity)} term(s)"


@admin.register(models.VirtualMachineInstance)
class VmiAdmin(MirrorAdmin):
    list_display = ["name", "namespace", "phase", "node_name", "active_pod_count", "parse_error"]
    list_filter = [ParseErrorFilter, "phase", "namespace"]
    search_fields = ["name", "uid", "namespace__name", "node"]

    @admin.display(description="node", ordering="node")
    def node_name(self, obj: models.VirtualMachineInstance) -> str:
        return node_link(obj.node)

    @admin.display(description="active pods")
    def active_pod_count(self, obj: models.VirtualMachineInstance) -> int:
        return len(obj.active_pods or {})


@admin.register(models.Pod)
class PodAdmin(MirrorAdmin):
    list_display = [
        "name",
        "namespace",
        "phase",
        "node_name",
        "gpu_requests",
        "owner_kind",
        "owner_name",
        "parse_error",
    ]
    list_filter = [ParseErrorFilter, "phase", "namespace"]
    search_fields = ["name", "uid", "owner_name", "namespace__name", "node"]

    @admin.display(description="node", ordering="node")
    def node_name(self, obj: models.Pod) -> str:
        return node_link(obj.node)


class DecisionInline(admin.TabularInline):  # type: ignore[type-arg]
    """The pass's decisions, as the pass wrote them: no "Add another", no delete box."""

    model = models.Decision
    extra = 0
    max_num = 0
    can_delete = False
    fields = ("namespace", "vm_name", "device_name", "from_phase", "from_node", "to_phase", "to_node", "reason")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(models.PassRun)
class PassRunAdmin(AuditAdmin):
    """The pass history. The counts are sets (refused: orders), not devices: a set of 8
    devices bound is "bound 1", beside the board's device counts, so the headers say so."""

    list_display = [
        "id",
        "kind",
        "triggered_by",
        "started",
        "duration",
        "devices_seen",
        "devices_written",
        "sets_bound",
        "sets_moved",
        "sets_lost",
        "orders_refused",
        "sets_restored",
        "skipped",
    ]
    list_filter = ["kind"]
    search_fields = ["triggered_by"]
    exclude = ["duration_ms"]
    readonly_fields = ["duration"]
    inlines = [DecisionInline]
    actions = [run_full_pass]

    @admin.display(description="duration", ordering="duration_ms")
    def duration(self, obj: models.PassRun) -> str:
        return duration_ms(obj.duration_ms)

    @admin.display(description="sets bound", ordering="bound")
    def sets_bound(self, obj: models.PassRun) -> int:
        return obj.bound

    @admin.display(description="sets moved", ordering="moved")
    def sets_moved(self, obj: models.PassRun) -> int:
        return obj.moved

    @admin.display(description="sets lost", ordering="lost")
    def sets_lost(self, obj: models.PassRun) -> int:
        return obj.lost

    @admin.display(description="orders refused", ordering="refused")
    def orders_refused(self, obj: models.PassRun) -> int:
        return obj.refused

    @admin.display(description="sets restored", ordering="restored")
    def sets_restored(self, obj: models.PassRun) -> int:
        return obj.restored


@admin.register(models.Decision)
class DecisionAdmin(AuditAdmin):
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


@admin.register(models.LostSet)
class LostSetAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Every Lost set with tenant, VM, devices, since when, why, and whether its VMI runs."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
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
                outcome = retry_lost_set(namespace, vm, staff_trigger(request.user.get_username()))
                self.message_user(request, outcome.message, RETRY_LEVELS[outcome.level])
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
                    "age": age(min((d.since for d in devices if d.since), default=None)),
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
class BindAnswerAdmin(AuditAdmin):
    list_display = ["answered_at", "namespace", "device_name", "request", "allowed", "latency", "answer"]
    list_filter = ["allowed", "namespace"]
    search_fields = ["device_name", "request", "answer"]
    exclude = ["latency_ms"]
    readonly_fields = ["latency"]

    @admin.display(description="latency", ordering="latency_ms")
    def latency(self, obj: models.BindAnswer) -> str:
        return duration_ms(obj.latency_ms)

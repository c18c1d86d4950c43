"""The staff pages of the admin site: thin views over the domain functions.

Each view checks the model permission its page reads (staff without it get 403, like
any admin page; non-staff never get here: ``AdminSite.admin_view`` sends them to the
login), parses its parameters into a clear message when they are bad (HTTP 400, never
a 500), calls one domain function (``gpuplane.staff.board``, ``binder.reports.budgets``,
``binder.reports.history``, ``binder.actions``, ``usage.daily``) and renders a template under
``templates/admin/gpuplane/``.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any
from urllib.parse import quote

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.admin import AdminSite
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET

from binder import models
from binder.actions import full_pass_now, staff_trigger
from binder.mirror.read import read_cluster
from binder.reports.budgets import budget_bars
from binder.reports.history import HistoryQueryError, decision_log
from gpuplane.staff.billing import RatesError, TenantTotal, parse_rates, presets, ranked
from gpuplane.staff.board import PAGE_SIZE, BoardFilterError, Filters, build_board
from gpuplane.staff.palette import OTHER, categorical, ranked_colours
from gpuplane.staff.snapshot import snapshot
from usage.api.renderers import SafeWriter
from usage.daily import MAX_DAYS, daily_gpu_hours, stacked_bars
from usage.models import UsageRecord
from usage.queries import namespace_known

#: Default usage-chart window: the last two weeks, today included.
DEFAULT_CHART_DAYS = 14


def _require(request: HttpRequest, *perms: str) -> None:
    if not request.user.has_perms(perms):
        raise PermissionDenied


def _render(
    request: HttpRequest, site: AdminSite, template: str, title: str, status: int = 200, **context: Any
) -> TemplateResponse:
    return TemplateResponse(
        request,
        f"admin/gpuplane/{template}",
        {**site.each_context(request), "title": title, **context},
        status=status,
    )


def _namespaces() -> list[str]:
    return list(models.Namespace.objects.values_list("name", flat=True))


def node_url(name: str) -> str:
    """A node's page: the admin's node page (``admin:node-detail``) when the site has one,
    else its plain path (one place to switch)."""
    try:
        return reverse("admin:node-detail", args=[name])
    except NoReverseMatch:
        return f"{reverse('admin:index')}nodes/{quote(name)}/"


def _board_filters(request: HttpRequest) -> Filters:
    """The board's parameters; a page that is not a positive number is a BoardFilterError."""
    raw_page = request.GET.get("page", "").strip()
    if raw_page and not (raw_page.isdigit() and int(raw_page) > 0):
        raise BoardFilterError(f"'page' must be a positive whole number, not {raw_page!r}")
    return Filters(
        class_name=request.GET.get("class", "").strip(),
        tenant=request.GET.get("tenant", "").strip(),
        problems=request.GET.get("problems", "") not in ("", "0"),
        sort=request.GET.get("sort", "").strip() or "name",
        page=int(raw_page) if raw_page else 0,
        q=request.GET.get("q", "").strip(),
    )


@require_GET
def placement_board(request: HttpRequest, site: AdminSite) -> HttpResponse:
    """Nodes × units, coloured by tenant, a page of rows at a time; ``?class=``,
    ``?tenant=``, ``?problems=1`` narrow it, ``?sort=`` orders it, ``?q=ns/vm`` (or a node)
    highlights a set and opens its page."""
    _require(request, "binder.view_gpudevice", "binder.view_node")
    snap = snapshot(timezone.now())
    try:
        filters = _board_filters(request)
        board = build_board(
            snap.cluster,
            snap.ids,
            filters,
            device_url=reverse("admin:binder_gpudevice_changelist"),
            pod_url=reverse("admin:binder_pod_changelist"),
            namespaces=_namespaces(),
            node_url=node_url,
            ledger=snap.ledger,
            holdings=snap.holdings,
            memo=snap.memo,
        )
    except BoardFilterError as exc:
        return _render(
            request,
            site,
            "placement_board.html",
            "Placement board",
            status=400,
            error=str(exc),
            classes=sorted(c.name for c in snap.cluster.classes),
            filters=Filters(
                class_name=request.GET.get("class", ""),
                tenant=request.GET.get("tenant", ""),
                q=request.GET.get("q", ""),
            ),
        )
    return _render(
        request,
        site,
        "placement_board.html",
        "Placement board",
        is_nav_sidebar_enabled=False,  # the board needs the width
        board=board,
        filters=board.filters,
        classes=board.classes,
        colours=[(item.css, item.colour) for item in board.legend if item.css != "tz"],
        other_colour=OTHER,
        grace=settings.GPUPLANE_NODE_GRACE_SECONDS,
        page_size=PAGE_SIZE,
    )


@require_GET
def budgets(request: HttpRequest, site: AdminSite) -> HttpResponse:
    """Usage against limit per tenant and key (class keys and raw keys)."""
    _require(request, "binder.view_gpubudget")
    cluster, _ = read_cluster(timezone.now())
    return _render(
        request,
        site,
        "budgets.html",
        "Budgets",
        tenants=budget_bars(cluster, _namespaces()),
        default_budget=cluster.settings.default_budget.value,
    )


class ChartForm(forms.Form):
    """The usage chart's parameters: a window of whole UTC days, a tenant, a class, and
    ``at``: the moment open records are counted until (now, or earlier). The page's CSV
    link carries the page's ``at``, so the download has exactly the numbers drawn even
    while records are open and growing."""

    def __init__(self, *args: Any, now: datetime, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.now = now
        self.fields["at"] = forms.CharField(required=False, max_length=64)
        self.fields["from"] = forms.DateField(required=False, input_formats=["%Y-%m-%d"])
        self.fields["to"] = forms.DateField(required=False, input_formats=["%Y-%m-%d"])
        self.fields["tenant"] = forms.CharField(required=False, max_length=63)
        self.fields["class"] = forms.CharField(required=False, max_length=253)
        self.fields["format"] = forms.ChoiceField(
            required=False, choices=[("", "page"), ("csv", "CSV"), ("billing", "billing CSV")]
        )
        self.fields["rates"] = forms.CharField(required=False, max_length=2000)
        for name in ("from", "to"):
            self.fields[name].error_messages["invalid"] = f"'{name}' must be a date as YYYY-MM-DD"

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        at = self.now
        if data.get("at"):
            try:
                parsed = parse_datetime(data["at"])
                # In UTC: PostgreSQL takes offsets only up to ±15:59 (Python up to ±23:59).
                if parsed is not None:
                    aware = parsed if timezone.is_aware(parsed) else parsed.replace(tzinfo=UTC)
                    at = min(self.now, aware.astimezone(UTC))
            except (ValueError, OverflowError):
                parsed = None
            if parsed is None:
                self.add_error("at", "'at' must be a time as YYYY-MM-DDTHH:MM:SS+00:00")
        if self.errors:
            return data
        data["at"] = at
        last = data.get("to") or at.date()
        first = data.get("from") or last - timedelta(days=DEFAULT_CHART_DAYS - 1)
        if first > last:
            raise forms.ValidationError(f"'from' ({first}) must not be after 'to' ({last})")
        if (last - first).days + 1 > MAX_DAYS:
            raise forms.ValidationError(
                f"the window may cover at most {MAX_DAYS} days; this one has {(last - first).days + 1}"
            )
        tenant = data.get("tenant", "").strip()
        if tenant and not namespace_known(tenant):
            self.add_error("tenant", f"unknown tenant {tenant!r}: no namespace or usage record has that name")
        key = data.get("class", "").strip()
        if key and not (
            models.GpuClass.objects.filter(name=key).exists() or UsageRecord.objects.filter(key=key).exists()
        ):
            self.add_error("class", f"unknown class {key!r}: no GPU class or usage record has that key")
        data.update({"from": first, "to": last, "tenant": tenant, "class": key})
        try:
            data["rate_table"] = parse_rates(data.get("rates") or settings.GPUPLANE_BILLING_RATES)
        except RatesError as exc:
            self.add_error("rates", str(exc))
        return data


@require_GET
def usage_chart(request: HttpRequest, site: AdminSite) -> HttpResponse:
    """GPU-hours per day per tenant and per class, as SVG bars; ``?format=csv`` exports them."""
    _require(request, "usage.view_usagerecord")
    form = ChartForm(request.GET, now=timezone.now())
    wants_csv = request.GET.get("format") in ("csv", "billing")
    if not form.is_valid():
        problems = [
            f"{field if field != '__all__' else 'window'}: {e}" for field, errs in form.errors.items() for e in errs
        ]
        if wants_csv:
            response = HttpResponse(status=400, content_type="text/csv")
            writer = SafeWriter(response, lineterminator="\n")
            writer.writerow(["error"])
            for problem in problems:
                writer.writerow([problem])
            return response
        return _render(request, site, "usage_chart.html", "Usage chart", status=400, errors=problems, form=form)
    params = form.cleaned_data
    daily = daily_gpu_hours(params["from"], params["to"], params["at"], namespace=params["tenant"], key=params["class"])
    table = ranked(daily, params["rate_table"])
    if request.GET.get("format") == "billing":
        return _billing_csv(table, daily.first, daily.last, f"billing-{daily.first}-{daily.last}.csv")
    if wants_csv:
        return _csv(daily.rows(), f"gpu-hours-{daily.first}-{daily.last}.csv")
    days = daily.days
    by_tenant = daily.by("tenant")
    by_key = daily.by("key")
    charts = [
        (
            "tenant",
            "GPU-hours per day per tenant",
            stacked_bars(days, by_tenant, ranked_colours(sorted(by_tenant, key=lambda t: -sum(by_tenant[t].values())))),
        ),
        (
            "class",
            "GPU-hours per day per class (raw keys: pods' raw usage)",
            stacked_bars(days, by_key, {k: categorical(i) for i, k in enumerate(by_key)}),
        ),
    ]
    for _, _, chart in charts:
        chart.legend.sort(key=lambda item: (-item[2], item[0]))  # ranked: the most GPU-hours first
    query = request.GET.copy()
    for name, value in (("from", daily.first), ("to", daily.last), ("at", params["at"].isoformat()), ("format", "csv")):
        query[name] = str(value)  # replaces (QueryDict.update would append)
    billing_query = query.copy()
    billing_query["format"] = "billing"
    preset_links = []
    for label, first, last in presets(params["at"].date()):
        preset = request.GET.copy()
        for name in ("at", "format"):
            preset.pop(name, None)
        preset["from"], preset["to"] = str(first), str(last)
        current = (first, last) == (daily.first, daily.last)
        preset_links.append((label, f"{request.path}?{preset.urlencode()}", current))
    return _render(
        request,
        site,
        "usage_chart.html",
        "Usage chart",
        is_nav_sidebar_enabled=False,
        form=form,
        params=params,
        charts=charts,
        total=daily.total,
        csv_url=f"{request.path}?{query.urlencode()}",
        billing_url=f"{request.path}?{billing_query.urlencode()}",
        presets=preset_links,
        ranked=table,
        rates=params["rate_table"],
        rates_text=params.get("rates", ""),
        rates_from_setting=not params.get("rates") and bool(settings.GPUPLANE_BILLING_RATES),
        tenants=sorted(set(_namespaces()) | set(by_tenant)),
        classes=sorted(set(models.GpuClass.objects.values_list("name", flat=True)) | set(by_key)),
    )


def _csv(rows: list[tuple[date, str, str, float, float]], filename: str) -> HttpResponse:
    """GPU-hours per day, tenant and class; ``borrowed_gpu_hours``: of them, those held by
    borrowed sets (lending), apart."""
    response = HttpResponse(content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    writer = SafeWriter(response)  # tenant and class names are chosen by others: no formulas
    writer.writerow(["day", "tenant", "class", "gpu_hours", "borrowed_gpu_hours"])
    for day, namespace, key, hours, borrowed in rows:
        writer.writerow([day.isoformat(), namespace, key, f"{hours:.6f}", f"{borrowed:.6f}"])
    return response


def _billing_csv(table: list[TenantTotal], first: date, last: date, filename: str) -> HttpResponse:
    """One row per tenant and key: GPU-hours inside the window (records cut at its edges),
    of them the borrowed GPU-hours (held by borrowed sets, lending: billed alike, shown
    apart), share of all GPU-hours in it, rate and amount (empty without a rate)."""
    response = HttpResponse(content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    writer = SafeWriter(response)
    writer.writerow(["from", "to", "tenant", "class", "gpu_hours", "borrowed_gpu_hours", "share", "rate", "amount"])
    for tenant in table:
        for line in tenant.lines:
            writer.writerow(
                [
                    first.isoformat(),
                    last.isoformat(),
                    line.tenant,
                    line.key,
                    f"{line.hours:.6f}",
                    f"{line.borrowed:.6f}",
                    f"{line.share:.6f}",
                    "" if line.rate is None else str(line.rate),
                    "" if line.amount is None else str(line.amount),
                ]
            )
    return response


@require_GET
def decisions(request: HttpRequest, site: AdminSite) -> HttpResponse:
    """Every placement change of a set (``?namespace=&vm=``) or a device (``&device=``)."""
    _require(request, "binder.view_decision")
    try:
        log = decision_log(
            request.GET.get("namespace", "").strip(),
            vm=request.GET.get("vm", "").strip(),
            device=request.GET.get("device", "").strip(),
        )
    except HistoryQueryError as exc:
        return _render(request, site, "decisions.html", "Decision log", status=400, error=str(exc))
    return _render(request, site, "decisions.html", f"Decision log of {log.subject}", log=log)


def run_pass(request: HttpRequest, site: AdminSite) -> HttpResponse:
    """POST: queue a full pass through the binder queue and report what came of it."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    _require(request, "binder.add_passrun")
    outcome = full_pass_now(staff_trigger(request.user.get_username()))
    level = messages.ERROR if outcome.error else messages.SUCCESS
    messages.add_message(request, level, outcome.message)
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        target = reverse("admin:placement-board")
    return HttpResponseRedirect(target)

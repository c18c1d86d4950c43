"""gpuplane's admin site: Django's admin plus the staff pages that are no model's changelist.

The placement board, budgets, usage chart, decision log and the "run a full pass"
action answer questions across models, so they are not ModelAdmin views; adding them
through ``AdminSite.get_urls`` (Django's documented hook) gives them the admin's own
login, staff check, CSRF and layout, and puts them under the ``admin:`` URL namespace.
``gpuplane.staff.apps.GpuplaneAdminConfig`` replaces ``django.contrib.admin`` in ``INSTALLED_APPS`` so that
``admin.site`` (and every ``@admin.register``) is this site.
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin import AdminSite
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, URLResolver, path

from binder.reports.health import fleet_health
from gpuplane.staff import console, views


class GpuplaneAdminSite(AdminSite):
    """The staff admin with the placement board and its sibling pages."""

    site_header = "gpuplane"
    site_title = "gpuplane"
    index_title = "GPU placement, budgets and usage"
    index_template = "admin/gpuplane/index.html"
    #: No public site beside the admin: Django's "View site" link would be a 404.
    site_url = None

    #: ``?refresh=N`` on the home page reloads it every N seconds (a meta refresh: no script,
    #: so the strict CSP holds); off unless asked for.
    REFRESH_SECONDS = (15, 30, 60, 300)

    def index(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> TemplateResponse:
        """The admin's home page with the health of the fleet first (Lost sets, Pending sets
        and why, NotReady, cordoned and draining nodes, budgets at their limit)."""
        context: dict[str, Any] = {"refresh_choices": self.REFRESH_SECONDS}
        if request.user.has_perms(("binder.view_gpudevice", "binder.view_node", "binder.view_gpubudget")):
            context["health"] = fleet_health()
        asked = request.GET.get("refresh", "")
        context["refresh"] = int(asked) if asked.isdigit() and int(asked) in self.REFRESH_SECONDS else 0
        response: TemplateResponse = super().index(request, {**context, **(extra_context or {})})
        return response

    def get_urls(self) -> list[URLResolver | URLPattern]:
        def page(route: str, view: Any, name: str) -> URLPattern:
            pattern: URLPattern = path(route, self.admin_view(view), {"site": self}, name=name)
            return pattern

        staff_pages = [
            page("placement-board/", views.placement_board, "placement-board"),
            page("budgets/", views.budgets, "budgets"),
            page("usage-chart/", views.usage_chart, "usage-chart"),
            page("decisions/", views.decisions, "decisions"),
            page("run-pass/", views.run_pass, "run-pass"),
            page("search/", console.search_page, "search"),
            page("nodes/<str:name>/", console.node_detail, "node-detail"),
            page("nodes/<str:name>/<str:action>/", console.node_action, "node-action"),
        ]
        return staff_pages + super().get_urls()

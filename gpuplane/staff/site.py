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
from django.urls import URLPattern, URLResolver, path

from gpuplane.staff import console, views


class GpuplaneAdminSite(AdminSite):
    """The staff admin with the placement board and its sibling pages."""

    site_header = "gpuplane"
    site_title = "gpuplane"
    index_title = "GPU placement, budgets and usage"
    index_template = "admin/gpuplane/index.html"
    #: No public site beside the admin: Django's "View site" link would be a 404.
    site_url = None

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

"""The staff console's cross-cutting pages: search and the node page.

Thin views like ``gpuplane.staff.views``: check the permissions of what the page reads,
parse the parameters into a clear 400, call one domain function (``binder.reports.search``,
``binder.reports.nodes``) and render a template under ``templates/admin/gpuplane/``.
"""

from __future__ import annotations

from django.contrib.admin import AdminSite
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.http import require_GET

from binder.reports.nodes import node_report
from binder.reports.search import Hit, SearchQueryError, search
from gpuplane.staff.views import _render, _require

#: kind -> the model permission that lets staff see hits of that kind
KIND_PERMISSIONS = {
    "tenant": "binder.view_namespace",
    "vm": "binder.view_gpudevice",
    "device": "binder.view_gpudevice",
    "node": "binder.view_node",
    "pod": "binder.view_pod",
}


def node_url(name: str) -> str:
    """The node page of ``name`` (``admin:node-detail``), the link every staff page uses."""
    return reverse("admin:node-detail", args=[name])


def hit_links(hit: Hit) -> list[tuple[str, str]]:
    """(label, URL) links of one hit: its own page first."""
    if hit.kind == "tenant":
        devices = reverse("admin:binder_gpudevice_changelist") + f"?namespace__id__exact={hit.pk}"
        return [
            ("devices", devices),
            ("budgets", reverse("admin:budgets") + f"#tenant-{hit.name}"),
            ("board", reverse("admin:placement-board") + "?" + urlencode({"tenant": hit.name})),
        ]
    links: list[tuple[str, str]] = []
    if hit.kind == "vm":
        log = reverse("admin:decisions") + "?" + urlencode({"namespace": hit.namespace, "vm": hit.name})
        links.append(("devices and decisions", log))
    elif hit.kind == "device" and hit.pk is not None:
        links.append(("device", reverse("admin:binder_gpudevice_change", args=[hit.pk])))
    elif hit.kind == "node":
        links.append(("node page", node_url(hit.name)))
    elif hit.kind == "pod" and hit.pk is not None:
        links.append(("pod", reverse("admin:binder_pod_change", args=[hit.pk])))
    if hit.node and hit.kind != "node":
        links.append((f"node {hit.node}", node_url(hit.node)))
    return links


@require_GET
def search_page(request: HttpRequest, site: AdminSite) -> HttpResponse:
    """``?q=``: tenants, VMs (``ns/vm``), devices, nodes and pods matching, grouped, linked."""
    kinds = {kind for kind, perm in KIND_PERMISSIONS.items() if request.user.has_perm(perm)}
    query = request.GET.get("q", "")
    try:
        results = search(query, kinds)
    except SearchQueryError as exc:
        return _render(request, site, "search.html", "Search", status=400, error=str(exc), search_query=query[:300])
    groups = [(group, [(hit, hit_links(hit)) for hit in group.hits]) for group in results.groups]
    title = f"Search: {results.query}" if results.query else "Search"
    return _render(request, site, "search.html", title, results=results, groups=groups, search_query=results.query)


@require_GET
def node_detail(request: HttpRequest, site: AdminSite, name: str) -> HttpResponse:
    """One node: state, units per resource, its sets (by set) and pods, and its actions."""
    _require(request, "binder.view_node", "binder.view_gpudevice", "binder.view_pod")
    report = node_report(name)
    if report is None:
        return _render(
            request,
            site,
            "node.html",
            f"Node {name}",
            status=404,
            error=f"No node {name!r}: no node, device or pod in the mirror has that name.",
            node_name=name,
        )
    return _render(request, site, "node.html", f"Node {name}", report=report, node_name=name)

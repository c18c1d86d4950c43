"""The staff console's cross-cutting pages: search, the node page and its actions.

Thin views like ``gpuplane.staff.views``: check the permissions of what the page reads,
parse the parameters into a clear 400, call one domain function (``binder.reports.search``,
``binder.reports.nodes``) and render a template under ``templates/admin/gpuplane/``.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.admin import AdminSite
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.http import require_GET, require_http_methods

from binder import apiserver
from binder.actions import NodeActionError, change_node, staff_trigger
from binder.engine.preview import EFFECT, NodeAction, PreviewError, title
from binder.reports.nodes import node_preview, node_report
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
    actions = [
        NodeAction.UNCORDON if report.row is not None and report.row.unschedulable else NodeAction.CORDON,
        NodeAction.UNDRAIN if report.row is not None and report.row.draining else NodeAction.DRAIN,
    ]
    if not apiserver.cluster_mode() and report.row is not None:
        # Standalone: the database is the cluster, so its Ready condition is staff's to set.
        actions.insert(0, NodeAction.NOT_READY if report.row.ready else NodeAction.READY)
    return _render(
        request,
        site,
        "node.html",
        f"Node {name}",
        report=report,
        node_name=name,
        actions=[(a.value, title(a), EFFECT[a]) for a in actions] if report.exists else [],
        can_change=request.user.has_perm("binder.change_node"),
    )


#: Messages' levels for a node action's outcome (binder.actions.NodeActionOutcome.level).
LEVELS = {"error": messages.ERROR, "warning": messages.WARNING, "success": messages.SUCCESS}


@require_http_methods(["GET", "POST"])
def node_action(request: HttpRequest, site: AdminSite, name: str, action: str) -> HttpResponse:
    """GET: the confirmation, with the drain preview (where each set would go). POST: make
    the change (the API server in cluster mode, the mirror row in standalone), queue a full
    pass triggered by this user, and go back to the node page with what came of it."""
    _require(request, "binder.view_node", "binder.view_gpudevice", "binder.change_node")
    try:
        chosen = NodeAction(action)
    except ValueError:
        choices = ", ".join(a.value for a in NodeAction)
        return _render(
            request,
            site,
            "node_action.html",
            f"Node {name}",
            status=400,
            error=f"unknown node action {action!r}: one of {choices}",
            node_name=name,
        )
    if request.method == "POST":
        try:
            outcome = change_node(name, chosen, staff_trigger(request.user.get_username()))
        except NodeActionError as exc:
            messages.error(request, str(exc))
        else:
            messages.add_message(request, LEVELS[outcome.level], outcome.message)
        # Post/redirect/get: a reload must not write again.
        return HttpResponseRedirect(node_url(name))
    try:
        preview = node_preview(name, chosen)
    except PreviewError as exc:
        return _render(
            request,
            site,
            "node_action.html",
            f"Node {name}",
            status=404,
            error=f"{exc}: nothing to preview",
            node_name=name,
        )
    return _render(
        request,
        site,
        "node_action.html",
        f"{title(chosen)} {name}?",
        preview=preview,
        effect=EFFECT[chosen],
        node_name=name,
        action=chosen.value,
        action_title=title(chosen),
        writes_to="the API server (a merge patch with the node's resourceVersion)"
        if apiserver.cluster_mode()
        else "the mirror (standalone: the database is the source of truth)",
    )

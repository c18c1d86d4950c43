"""The placement board: every node, every unit of every GPU resource, and who holds it.

Staff ask "where is every GPU?" of clusters with a thousand nodes, so the board is built
from one snapshot of the mirror (``read_cluster``: a fixed number of queries, however
many nodes) and the engine's one ledger, never from per-node queries. Who books a unit
is the engine's answer too: devices Bound on the node, and pods' raw usage for
capacity as the shared launcher reader (``binder.engine.launcher``) decides it, so the
board always adds up to the booked figures the binder placed by.

The cells are rendered to HTML here, in Python, rather than in a template loop: a
thousand nodes are tens of thousands of cells, and string building is an order of
magnitude faster than the template engine for that.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from html import escape

from django.utils.safestring import SafeString, mark_safe

from binder.engine import Holding, ledger_for
from binder.engine import types as e
from binder.engine.explain import Explainer, Explanation
from binder.reports.explanations import explanation_html
from gpuplane.staff.palette import tenant_colour

#: Cells drawn per strip (one node's resource) and per Lost set; past it a count stands in
#: for the rest. A node has at most a few dozen units of a GPU resource, but a pod may
#: request 200,000 (a 37 MiB page) and a node may claim a million allocatable.
MAX_CELLS = 256


def _more(units: int, what: str) -> str:
    return f'<b class="more" title="{units} {what} not drawn">+{units}</b>' if units > 0 else ""


class BoardFilterError(ValueError):
    """A filter names something the cluster does not have (shown to staff, never a 500)."""


@dataclass(frozen=True, slots=True)
class Filters:
    """What the board is narrowed to: a class (its resource) and/or a tenant."""

    class_name: str = ""
    tenant: str = ""


@dataclass(slots=True)
class Strip:
    """One GPU resource of one node: a cell per unit (``max(allocatable, booked)`` cells)."""

    resource: str
    label: str
    allocatable: int
    booked: int
    free: int
    cells: SafeString
    over_booked: bool = False


@dataclass(slots=True)
class Row:
    """One node: its markers (cordoned, draining, NotReady, over-booked, deleted) and strips."""

    node: str
    markers: list[tuple[str, str]]
    strips: list[Strip]
    css: str = ""

    def html(self) -> str:
        """The row as a table row (escaped here: a thousand rows through the template
        engine cost more than building the whole board)."""
        badges = "".join(f'<span class="badge {css}">{escape(text)}</span>' for css, text in self.markers)
        strips = "".join(
            f'<span class="strip{" over" if s.over_booked else ""}" data-resource="{escape(s.resource)}" '
            f'title="{escape(s.resource)}: {s.allocatable} allocatable, {s.booked} booked, {s.free} free">'
            f"<b>{escape(s.label)}</b>{s.cells}<small>{s.booked}/{s.allocatable}</small></span>"
            for s in self.strips
        )
        node = escape(self.node)
        return f'<tr class="node {self.css}" data-node="{node}"><th>{node}</th><td>{badges}</td><td>{strips}</td></tr>'


@dataclass(slots=True)
class LostSetCells:
    """A Lost set: on no node, so drawn apart, one cell per unit it still holds in budgets."""

    namespace: str
    vm: str
    devices: int
    units: int
    since: datetime | None
    reason: str
    cells: SafeString
    explanation: Explanation | None = None

    @property
    def explained(self) -> SafeString:
        return explanation_html(self.explanation) if self.explanation else SafeString("")


@dataclass(slots=True)
class Legend:
    """A tenant on the board: its colour class and the units it books on the shown nodes."""

    namespace: str
    css: str
    colour: str
    units: int = 0
    lost_units: int = 0


@dataclass(slots=True)
class Board:
    """Everything the board page shows, built from one snapshot."""

    rows: list[Row]
    legend: list[Legend]
    lost: list[LostSetCells]
    filters: Filters
    classes: list[str]
    tenants: list[str]
    resources: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """resource -> (allocatable, booked, free) summed over the shown rows."""
    nodes_total: int = 0
    cells: int = 0
    pending_devices: int = 0
    pending: list[Explanation] = field(default_factory=list)
    """Sets with Pending devices (and none Lost), explained now."""

    @property
    def rows_html(self) -> SafeString:
        return mark_safe("\n".join(row.html() for row in self.rows))  # noqa: S308 - Row.html escapes


def _title(*lines: str) -> str:
    return escape("\n".join(line for line in lines if line), quote=True)


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%SZ") if moment else "-"


def build_board(
    cluster: e.Cluster,
    ids: dict[tuple[str, str], int],
    filters: Filters,
    *,
    device_url: str,
    pod_url: str,
    namespaces: list[str] | None = None,
) -> Board:
    """The board of ``cluster`` narrowed by ``filters``.

    ``ids`` maps (namespace, device name) to the device's row id (as ``read_cluster``
    returns it); ``device_url`` is the device admin's URL prefix (``…/gpudevice/``) and
    ``pod_url`` the pod changelist. Raises :class:`BoardFilterError` for an unknown
    class or tenant.
    """
    classes = {c.name: c for c in cluster.classes}
    tenants = sorted(
        set(namespaces or ()) | {d.namespace for d in cluster.devices} | {p.namespace for p in cluster.pods}
    )
    if filters.class_name and filters.class_name not in classes:
        known = ", ".join(sorted(classes)) or "none"
        raise BoardFilterError(f"unknown class {filters.class_name!r}; the classes are: {known}")
    if filters.tenant and filters.tenant not in tenants:
        raise BoardFilterError(f"unknown tenant {filters.tenant!r}: no namespace, device or pod has that name")

    ledger = ledger_for(cluster)
    nodes = {n.name: n for n in cluster.nodes}
    only_resource = classes[filters.class_name].resource_name if filters.class_name else ""
    class_resources: dict[str, list[str]] = defaultdict(list)
    for cls in sorted(classes.values(), key=lambda c: c.name):
        class_resources[cls.resource_name].append(cls.name)
    # Who books each unit, from the ledger (the binder's own count): devices Bound on the
    # node, then pods' raw usage for capacity.
    holdings = ledger.holdings()

    css = {ns: f"t{i}" for i, ns in enumerate(tenants)}
    legend = {ns: Legend(ns, css[ns], tenant_colour(ns)) for ns in tenants}
    wanted = filters.tenant

    def tenant_css(namespace: str) -> str:
        return css[namespace] if not wanted or namespace == wanted else "o"

    cells = _Cells(device_url, pod_url, tenant_css, legend, wanted)
    rows: list[Row] = []
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    cell_count = 0
    node_names = sorted(set(nodes) | {n for n, booked in ledger.booked.items() if n and any(booked.values())})
    for name in node_names:
        node = nodes.get(name)
        allocatable = node.allocatable if node else {}
        booked: Mapping[str, int] = ledger.booked.get(name, {})
        resources = {r for r in allocatable if r in class_resources and allocatable[r] > 0}
        resources |= {r for r, units in booked.items() if units > 0}
        if only_resource:
            resources &= {only_resource}
        held = [h for h in holdings.get(name, ()) if h.resource in resources]
        if not resources or (wanted and wanted not in {_holder(h).namespace for h in held}):
            continue
        strips = []
        for resource in sorted(resources):
            alloc, used = allocatable.get(resource, 0), booked.get(resource, 0)
            html, index = cells.strip(name, resource, alloc, [h for h in held if h.resource == resource], ids)
            cell_count += index
            label = ", ".join(class_resources.get(resource, ())) or resource.rsplit("/", 1)[-1]
            strips.append(
                Strip(
                    resource=resource,
                    label=label,
                    allocatable=alloc,
                    booked=used,
                    free=alloc - used,
                    cells=html,
                    over_booked=used > alloc,
                )
            )
            total = totals[resource]
            total[0] += alloc
            total[1] += used
            total[2] += alloc - used
        markers = _markers(node, strips)
        rows.append(Row(name, markers, strips, " ".join(m for m, _ in markers)))

    explainer = Explainer(cluster, ledger, holdings)
    lost = _lost_sets(cluster, classes, filters, tenant_css, legend, explainer)
    pending_keys = sorted({d.set_key for d in cluster.devices if d.phase is e.Phase.PENDING})
    pending = [
        why
        for key in pending_keys
        if (not wanted or key[0] == wanted)
        and (why := explainer.explain(key)).phase is e.Phase.PENDING
        and (not filters.class_name or any(d.class_name == filters.class_name for d in explainer.ledger.devices(key)))
    ]
    shown = [legend[ns] for ns in tenants if legend[ns].units or legend[ns].lost_units or ns == wanted]
    return Board(
        rows=rows,
        legend=shown,
        lost=lost,
        filters=filters,
        classes=sorted(classes),
        tenants=tenants,
        resources={r: (t[0], t[1], t[2]) for r, t in sorted(totals.items())},
        nodes_total=len(node_names),
        cells=cell_count,
        pending_devices=sum(1 for d in cluster.devices if d.phase is e.Phase.PENDING),
        pending=pending,
    )


def _holder(holding: Holding) -> e.Device | e.Pod:
    holder = holding.device or holding.pod
    assert holder is not None  # noqa: S101 - a Holding always names its device or pod
    return holder


def _markers(node: e.Node | None, strips: list[Strip]) -> list[tuple[str, str]]:
    """The node's state marks: deleted, NotReady, cordoned, draining, over-booked."""
    markers: list[tuple[str, str]] = []
    if node is None:
        markers.append(("deleted", "deleted (not in the mirror)"))
    else:
        if not node.ready:
            markers.append(("notready", f"NotReady since {_when(node.ready_since)}"))
        if node.unschedulable:
            markers.append(("cordoned", "cordoned"))
        if node.draining:
            markers.append(("draining", "draining"))
    if any(s.over_booked for s in strips):
        markers.append(("overbooked", "over-booked"))
    return markers


@dataclass
class _Cells:
    """Draws one resource strip of a node: a cell per unit, linked to who holds it."""

    device_url: str
    pod_url: str
    tenant_css: Callable[[str], str]
    legend: dict[str, Legend]
    wanted: str

    def strip(
        self, node: str, resource: str, alloc: int, held: list[Holding], ids: dict[tuple[str, str], int]
    ) -> tuple[SafeString, int]:
        """The strip's cells (units past ``alloc`` marked over-booked) and how many there are.

        At most :data:`MAX_CELLS` cells: the booked units past the cap, and the free units
        past it, are counted in one "+N" mark each instead of drawn."""
        parts: list[str] = []
        unit = drawn = hidden = 0  # the unit index (cells past ``alloc`` are over-booked) and cells drawn
        for holding in held:
            css, attrs = self._device(node, holding, ids) if holding.device else self._pod(holding)
            shown = min(holding.units, max(0, MAX_CELLS - drawn))
            parts.extend(f'<a class="u {css}{" ob" if i >= alloc else ""}" {attrs}></a>'
                         for i in range(unit, unit + shown))  # fmt: skip
            unit, drawn, hidden = unit + holding.units, drawn + shown, hidden + holding.units - shown
            holder = _holder(holding)
            if not self.wanted or holder.namespace == self.wanted:
                self.legend[holder.namespace].units += holding.units
        parts.append(_more(hidden, "booked units"))
        free = max(0, alloc - unit)
        shown = min(free, max(0, MAX_CELLS - drawn))
        parts.extend('<i class="u"></i>' for _ in range(shown))
        parts.append(_more(free - shown, "free units"))
        return mark_safe("".join(parts)), drawn + shown  # noqa: S308 - every value is escaped

    def _device(self, node: str, holding: Holding, ids: dict[tuple[str, str], int]) -> tuple[str, str]:
        """A device's cell class and attributes (link, set, title)."""
        device = holding.device
        assert device is not None  # noqa: S101 - called for device holdings only
        pk = ids.get(device.key)
        href = f"{self.device_url}{pk}/change/" if pk else self.device_url
        title = _title(
            f"device {device.namespace}/{device.name}",
            f"VM {device.vm_name} · tenant {device.namespace} · class {device.class_name}",
            f"{device.phase.value} on {node} since {_when(device.since)}",
            f"reason: {device.reason}",
        )
        data_set = escape(f"{device.namespace}/{device.vm_name}", quote=True)
        return self.tenant_css(device.namespace), f'href="{href}" data-set="{data_set}" title="{title}"'

    def _pod(self, holding: Holding) -> tuple[str, str]:
        """A pod's cell class and attributes (link, title)."""
        pod, launcher, resource = holding.pod, holding.launcher, holding.resource
        assert pod is not None  # noqa: S101 - called for pod holdings only
        why = (
            f"launcher of VMI {launcher.name}: requests units its devices do not hold on this node"
            if launcher
            else "not a VMI's launcher: its whole request is raw usage"
        )
        title = _title(
            f"pod {pod.namespace}/{pod.name} ({holding.units} raw {resource})",
            f"VM {launcher.name if launcher else '-'} · tenant {pod.namespace}",
            f"reason: {why}",
        )
        href = escape(f"{self.pod_url}?q={pod.name}", quote=True)
        return f"p {self.tenant_css(pod.namespace)}", f'href="{href}" title="{title}"'


def _lost_sets(
    cluster: e.Cluster,
    classes: dict[str, e.GpuClass],
    filters: Filters,
    tenant_css: Callable[[str], str],
    legend: dict[str, Legend],
    explainer: Explainer,
) -> list[LostSetCells]:
    """Lost sets hold no node but still count in budgets: one hatched cell per unit."""
    sets: dict[tuple[str, str], list[e.Device]] = defaultdict(list)
    for device in cluster.devices:
        if device.phase is e.Phase.LOST:
            sets[device.set_key].append(device)
    out = []
    for (namespace, vm), devices in sorted(sets.items()):
        if filters.tenant and namespace != filters.tenant:
            continue
        if filters.class_name and all(d.class_name != filters.class_name for d in devices):
            continue
        devices.sort(key=lambda d: d.name)
        units = sum(classes[d.class_name].units_per_device for d in devices if d.class_name in classes)
        title = _title(
            f"Lost set {namespace}/{vm}: {len(devices)} devices, {units} units",
            f"VM {vm} · tenant {namespace}",
            f"Lost since {_when(min((d.since for d in devices if d.since), default=None))}",
            f"reason: {devices[0].reason}",
        )
        tcss = tenant_css(namespace)
        cells = f'<i class="u lost {tcss}" title="{title}"></i>' * min(units, MAX_CELLS)
        cells += _more(units - min(units, MAX_CELLS), "units of this Lost set")
        legend[namespace].lost_units += units
        out.append(
            LostSetCells(
                namespace=namespace,
                vm=vm,
                devices=len(devices),
                units=units,
                since=min((d.since for d in devices if d.since), default=None),
                reason=devices[0].reason,
                cells=mark_safe(cells),  # noqa: S308 - the title is escaped
                explanation=explainer.explain((namespace, vm)),
            )
        )
    return out

"""The placement board: every node, every unit of every GPU resource, and who holds it.

Staff ask "where is every GPU?" of clusters with ten thousand nodes, so the board is built
from one snapshot of the mirror (``read_cluster``: a fixed number of queries, however
many nodes) and the engine's one ledger, never from per-node queries. Who books a unit
is the engine's answer too: devices Bound on the node, and pods' raw usage for
capacity as the shared launcher reader (``binder.engine.launcher``) decides it, so the
board always adds up to the booked figures the binder placed by.

Every node is summed (free units, state) so the rows can be sorted and filtered over the
whole cluster, but cells are drawn only for the page shown (:data:`PAGE_SIZE` rows): at
10,000 nodes drawing them all was an 18 MB page. Cells are rendered to HTML here, in
Python, rather than in a template loop: string building is an order of magnitude faster.

Free means free for new units: a NotReady, cordoned or draining node, or one whose taints
or labels keep the class out, counts nothing free (its idle units are drawn hatched), as
the binder and the catalog count (``refuses_new``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import urlencode

from django.utils.safestring import SafeString, mark_safe

from binder.engine import Holding, Ledger, ledger_for
from binder.engine import types as e
from binder.engine.explain import ClassGap, Explainer, Explanation, class_gaps
from binder.engine.placement import refuses_new
from binder.reports.explanations import explanation_html
from gpuplane.staff.palette import PALETTE, ranked_colours

#: Cells drawn per strip (one node's resource) and per Lost set; past it a count stands in
#: for the rest. A node has at most a few dozen units of a GPU resource, but a pod may
#: request 200,000 (a 37 MiB page) and a node may claim a million allocatable.
MAX_CELLS = 256
#: Node rows per page.
PAGE_SIZE = 100
#: ``?sort=``: by node name, by free units (for new units), by state (the worst first).
#: Lost sets drawn and explained on the board (all of them are on the Lost sets page).
MAX_LOST = 20
#: Summaries kept per snapshot (filter and order combinations) before the memo is emptied.
MEMO_SIZE = 16
SORTS = ("name", "-name", "free", "-free", "state", "-state")
#: How bad a node state is, for ``sort=state`` (worst first) and "only problem nodes".
SEVERITY = {"deleted": 5, "notready": 4, "overbooked": 3, "draining": 2, "cordoned": 1}


def _more(units: int, what: str) -> str:
    return f'<b class="more" title="{units} {what} not drawn">+{units}</b>' if units > 0 else ""


class BoardFilterError(ValueError):
    """A filter names something the cluster does not have (shown to staff, never a 500)."""


@dataclass(frozen=True, slots=True)
class Filters:
    """What the board shows: a class (its resource), a tenant, only problem nodes, an
    order, a page (0: the first, or the page of ``q``), and ``q``: a set (``ns/vm``) or a
    node to highlight and jump to."""

    class_name: str = ""
    tenant: str = ""
    problems: bool = False
    sort: str = "name"
    page: int = 0
    q: str = ""

    def query(self, **changes: object) -> str:
        """This board's query string with ``changes`` (empty values left out)."""
        values: dict[str, object] = {
            "class": self.class_name,
            "tenant": self.tenant,
            "problems": "1" if self.problems else "",
            "sort": "" if self.sort == "name" else self.sort,
            "q": self.q,
            "page": self.page or "",
        }
        values.update(changes)
        return urlencode({k: v for k, v in values.items() if v not in ("", None, 0)})


@dataclass(slots=True)
class Strip:
    """One GPU resource of one node: a cell per unit (``max(allocatable, booked)`` cells)."""

    resource: str
    label: str
    allocatable: int
    booked: int
    free: int
    """Free for new units: 0 when the node takes none of the resource's classes now."""
    held: list[Holding]
    blocked: str = ""
    """Why the node takes no new units of this resource ("" when it may)."""
    cells: SafeString = SafeString("")

    @property
    def over_booked(self) -> bool:
        return self.booked > self.allocatable

    @property
    def idle(self) -> int:
        return max(0, self.allocatable - self.booked)


@dataclass(slots=True)
class Row:
    """One node: its markers (cordoned, draining, NotReady, over-booked, deleted) and strips."""

    node: str
    markers: list[tuple[str, str]]
    strips: list[Strip]
    css: str = ""
    href: str = ""

    @property
    def free(self) -> int:
        return sum(s.free for s in self.strips)

    @property
    def severity(self) -> int:
        return max((SEVERITY.get(css, 0) for css, _ in self.markers), default=0)

    def html(self) -> str:
        """The row as a table row (escaped here: a thousand rows through the template
        engine cost more than building the whole board)."""
        badges = "".join(f'<span class="badge {css}">{escape(text)}</span>' for css, text in self.markers)
        strips = "".join(
            f'<span class="strip{" over" if s.over_booked else ""}{" blocked" if s.blocked else ""}" '
            f'data-resource="{escape(s.resource)}" '
            f'title="{escape(s.resource)}: {s.allocatable} allocatable, {s.booked} booked, {s.free} free'
            f'{escape(f" (none for new units: {s.blocked})") if s.blocked else ""}">'
            f"<b>{escape(s.label)}</b>{s.cells}<small>{s.booked}/{s.allocatable}"
            f"{f' · {s.free} free' if s.free else ''}</small></span>"
            for s in self.strips
        )
        node = escape(self.node)
        link = f'<a href="{escape(self.href)}">{node}</a>' if self.href else node
        return (
            f'<tr class="node {self.css}" data-node="{node}" data-free="{self.free}">'
            f"<th>{link}</th><td>{badges}</td><td>{strips}</td></tr>"
        )


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
    css: str = "tz"
    colour: str = ""
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
    """resource -> (allocatable, booked, free for new units) summed over the matching rows."""
    gaps: list[ClassGap] = field(default_factory=list)
    nodes_total: int = 0
    nodes_matching: int = 0
    cells: int = 0
    pending_devices: int = 0
    lost_total: int = 0
    pending: list[Explanation] = field(default_factory=list)
    """Sets with Pending devices (and none Lost), explained now."""
    page: int = 1
    pages: int = 1
    other_tenants: int = 0
    """Tenants with units on the board but past the palette (drawn grey, hatched)."""
    found: str = ""
    """What ``q`` found (a sentence), or why it found nothing."""

    @property
    def rows_html(self) -> SafeString:
        return mark_safe("\n".join(row.html() for row in self.rows))  # noqa: S308 - Row.html escapes

    @property
    def first_row(self) -> int:
        return (self.page - 1) * PAGE_SIZE + 1 if self.rows else 0

    @property
    def last_row(self) -> int:
        return self.first_row + len(self.rows) - 1 if self.rows else 0

    def page_url(self, page: int) -> str:
        return "?" + self.filters.query(page=page)

    @property
    def prev_url(self) -> str:
        return self.page_url(self.page - 1) if self.page > 1 else ""

    @property
    def next_url(self) -> str:
        return self.page_url(self.page + 1) if self.page < self.pages else ""

    def sort_url(self, key: str) -> str:
        """The link of a column header: ``key`` ascending, or descending when it is the order now."""
        return "?" + self.filters.query(sort=f"-{key}" if self.filters.sort == key else key, page="")

    @property
    def sort_links(self) -> dict[str, tuple[str, str]]:
        """Column -> (its link, the arrow shown: ▲ ascending, ▼ descending, "" not sorted by)."""
        out = {}
        for key in ("name", "free", "state"):
            arrow = "▲" if self.filters.sort == key else "▼" if self.filters.sort == f"-{key}" else ""
            out[key] = (self.sort_url(key), arrow)
        return out


def _title(*lines: str) -> str:
    return escape("\n".join(line for line in lines if line), quote=True)


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%SZ") if moment else "-"


def _sort_key(sort: str) -> Callable[[Row], tuple[object, ...]]:
    """Rows by ``sort``: descending orders put the most free (the worst state) first, ties
    by name either way."""
    column, descending = sort.lstrip("-"), sort.startswith("-")
    sign = -1 if descending else 1
    if column == "free":
        return lambda r: (sign * r.free, r.node)
    if column == "state":
        return lambda r: (sign * r.severity, r.node)
    return lambda r: (r.node,)


def find_tenant(wanted: str, tenants: list[str]) -> str:
    """The tenant ``wanted`` names: itself, else the one tenant whose name contains it.

    Raises :class:`BoardFilterError` naming the matches when there are several or none."""
    if not wanted or wanted in tenants:
        return wanted
    matches = [t for t in tenants if wanted.lower() in t.lower()]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise BoardFilterError(f"unknown tenant {wanted!r}: no namespace, device or pod has that name")
    shown = ", ".join(matches[:10]) + (f" and {len(matches) - 10} more" if len(matches) > 10 else "")
    raise BoardFilterError(f"tenant {wanted!r} matches {len(matches)} tenants: {shown}; say which")


def build_board(
    cluster: e.Cluster,
    ids: dict[tuple[str, str], int],
    filters: Filters,
    *,
    device_url: str,
    pod_url: str,
    namespaces: list[str] | None = None,
    node_url: Callable[[str], str] | None = None,
    ledger: Ledger | None = None,
    holdings: Mapping[str, list[Holding]] | None = None,
    memo: dict[object, Any] | None = None,
) -> Board:
    """The board of ``cluster`` narrowed by ``filters``, one page of it drawn.

    ``ids`` maps (namespace, device name) to the device's row id (as ``read_cluster``
    returns it); ``device_url`` is the device admin's URL prefix (``…/gpudevice/``),
    ``pod_url`` the pod changelist and ``node_url`` a node's page. ``ledger`` and
    ``holdings`` may come from a cache of the same snapshot, and ``memo`` (a dict kept
    with that snapshot) keeps the summed rows per filter and order, so paging a 10,000-node
    board draws one page without summing every node again. Raises
    :class:`BoardFilterError` for an unknown class, tenant or order.
    """
    classes = {c.name: c for c in cluster.classes}
    tenants = sorted(
        set(namespaces or ()) | {d.namespace for d in cluster.devices} | {p.namespace for p in cluster.pods}
    )
    if filters.class_name and filters.class_name not in classes:
        known = ", ".join(sorted(classes)) or "none"
        raise BoardFilterError(f"unknown class {filters.class_name!r}; the classes are: {known}")
    if filters.sort not in SORTS:
        raise BoardFilterError(f"unknown order {filters.sort!r}; the orders are: {', '.join(SORTS)}")
    wanted = find_tenant(filters.tenant, tenants)
    if wanted != filters.tenant:
        filters = Filters(filters.class_name, wanted, filters.problems, filters.sort, filters.page, filters.q)

    ledger = ledger if ledger is not None else ledger_for(cluster)
    holdings = holdings if holdings is not None else ledger.holdings()
    work = _remembered(memo, cluster, ledger, holdings, filters, wanted)
    rows, totals, units_by_tenant, node_count = work.rows, work.totals, work.units_by_tenant, work.node_count
    lost_sets = work.lost_sets
    lost_units = Counter[str]()
    for (namespace, _vm), devices in lost_sets.items():
        lost_units[namespace] += sum(classes[d.class_name].units_per_device for d in devices if d.class_name in classes)
    # The palette goes to the tenants with the most units on the board, Lost ones included.
    ranked = sorted(
        set(units_by_tenant) | set(lost_units) | ({wanted} if wanted else set()),
        key=lambda t: (-(units_by_tenant[t] + lost_units[t]), t),
    )
    colours = ranked_colours(ranked)
    legend = {
        ns: Legend(ns, f"t{i}" if i < len(PALETTE) else "tz", colours[ns], units_by_tenant[ns], lost_units[ns])
        for i, ns in enumerate(ranked)
    }

    def tenant_css(namespace: str) -> str:
        if wanted and namespace != wanted:
            return "o"
        found = legend.get(namespace)
        return found.css if found else "tz"

    pages = max(1, -(-len(rows) // PAGE_SIZE))
    found, target = _find(filters.q, rows, lost_sets, holdings)
    page = filters.page or (target // PAGE_SIZE + 1 if target is not None else 1)
    page = min(max(page, 1), pages)
    # Copies: the summarised rows may be shared with other requests (``memo``).
    shown = [
        replace(row, strips=[replace(strip) for strip in row.strips])
        for row in rows[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
    ]
    cells = _Cells(device_url, pod_url, tenant_css, filters.q)
    cell_count = 0
    for row in shown:
        row.href = node_url(row.node) if node_url else ""
        for strip in row.strips:
            strip.cells, count = cells.strip(row.node, strip.allocatable, strip.held, ids)
            cell_count += count

    # The first Lost sets (and the one ``q`` names): the Lost sets page lists them all.
    shown_lost = dict(list(lost_sets.items())[:MAX_LOST])
    if filters.q in {f"{ns}/{vm}" for ns, vm in lost_sets}:
        key = tuple(filters.q.split("/", 1))
        shown_lost[(key[0], key[1])] = lost_sets[(key[0], key[1])]
    lost = _lost_sets(shown_lost, classes, tenant_css, work.explainer, filters.q)
    top = [legend[ns] for ns in ranked[: len(PALETTE)]]
    if wanted and legend[wanted] not in top:
        top.append(legend[wanted])
    return Board(
        rows=shown,
        legend=top,
        lost=lost,
        filters=filters,
        classes=sorted(classes),
        tenants=tenants,
        resources={r: (t[0], t[1], t[2]) for r, t in sorted(totals.items())},
        gaps=[g for g in work.gaps if not filters.class_name or g.class_name == filters.class_name],
        nodes_total=node_count,
        nodes_matching=len(rows),
        cells=cell_count,
        pending_devices=work.pending_devices,
        lost_total=len(lost_sets),
        pending=work.pending,
        page=page,
        pages=pages,
        other_tenants=max(0, len(ranked) - len(PALETTE)),
        found=found,
    )


@dataclass(frozen=True, slots=True)
class _Work:
    """What a board's pages share for one snapshot, filter and order: every matching row
    summed and sorted, and the Lost and Pending sets explained."""

    rows: list[Row]
    totals: dict[str, list[int]]
    units_by_tenant: Counter[str]
    node_count: int
    lost_sets: dict[tuple[str, str], list[e.Device]]
    explainer: Explainer
    pending: list[Explanation]
    pending_devices: int
    gaps: list[ClassGap]


def _remembered(
    memo: dict[object, Any] | None,
    cluster: e.Cluster,
    ledger: Ledger,
    holdings: Mapping[str, list[Holding]],
    filters: Filters,
    wanted: str,
) -> _Work:
    key = ("board", filters.class_name, wanted, filters.problems, filters.sort)
    work = memo.get(key) if memo is not None else None
    if work is None:
        work = _summarise(cluster, ledger, holdings, filters, wanted)
        if memo is not None:
            if len(memo) >= MEMO_SIZE:
                memo.clear()
            memo[key] = work
    assert isinstance(work, _Work)  # noqa: S101 - only _Work is stored under a board key
    return work


def _summarise(
    cluster: e.Cluster, ledger: Ledger, holdings: Mapping[str, list[Holding]], filters: Filters, wanted: str
) -> _Work:
    rows, totals, units_by_tenant, node_count = _rows(cluster, ledger, holdings, filters, wanted)
    rows.sort(key=_sort_key(filters.sort), reverse=filters.sort == "-name")
    explainer = Explainer(cluster, ledger, holdings)
    lost_sets = _lost_devices(cluster, filters)
    pending = [
        why
        for key in sorted({d.set_key for d in cluster.devices if d.phase is e.Phase.PENDING})
        if (not wanted or key[0] == wanted)
        and (not filters.class_name or any(d.class_name == filters.class_name for d in ledger.devices(key)))
        and (why := explainer.explain(key)).phase is e.Phase.PENDING
    ]
    return _Work(
        rows=rows,
        totals=totals,
        units_by_tenant=units_by_tenant,
        node_count=node_count,
        lost_sets=lost_sets,
        explainer=explainer,
        pending=pending,
        pending_devices=sum(1 for d in cluster.devices if d.phase is e.Phase.PENDING),
        gaps=class_gaps(cluster, ledger),
    )


def _rows(
    cluster: e.Cluster, ledger: Ledger, holdings: Mapping[str, list[Holding]], filters: Filters, wanted: str
) -> tuple[list[Row], dict[str, list[int]], Counter[str], int]:
    """Every matching node's row (no cells yet), the totals per resource, the units per
    tenant on them, and how many nodes the board has in all."""
    classes = {c.name: c for c in cluster.classes}
    nodes = {n.name: n for n in cluster.nodes}
    only_resource = classes[filters.class_name].resource_name if filters.class_name else ""
    class_resources: dict[str, list[str]] = defaultdict(list)
    for cls in sorted(classes.values(), key=lambda c: c.name):
        class_resources[cls.resource_name].append(cls.name)

    rows: list[Row] = []
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    units_by_tenant: Counter[str] = Counter()
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
            blocked = _blocked(node, [classes[c] for c in class_resources.get(resource, ())])
            strips.append(
                Strip(
                    resource=resource,
                    label=", ".join(class_resources.get(resource, ())) or resource.rsplit("/", 1)[-1],
                    allocatable=alloc,
                    booked=used,
                    free=0 if blocked else max(0, alloc - used),
                    held=[h for h in held if h.resource == resource],
                    blocked=blocked,
                )
            )
        markers = _markers(node, strips)
        if filters.problems and not markers:
            continue
        for strip in strips:
            total = totals[strip.resource]
            total[0] += strip.allocatable
            total[1] += strip.booked
            total[2] += strip.free
        for holding in held:
            namespace = _holder(holding).namespace
            if not wanted or namespace == wanted:
                units_by_tenant[namespace] += holding.units
        rows.append(Row(name, markers, strips, " ".join(m for m, _ in markers)))

    return rows, totals, units_by_tenant, len(node_names)


def _blocked(node: e.Node | None, classes: list[e.GpuClass]) -> str:
    """Why ``node`` takes no new units of any of ``classes`` ("" when one of them may go there)."""
    if node is None:
        return "deleted"
    if not classes:
        return "no class uses this resource"
    reasons = [refuses_new(node, (cls,)) for cls in classes]
    return "" if any(r is None for r in reasons) else str(reasons[0])


def _find(
    q: str,
    rows: list[Row],
    lost_sets: Mapping[tuple[str, str], list[e.Device]],
    holdings: Mapping[str, list[Holding]],
) -> tuple[str, int | None]:
    """What ``q`` (``ns/vm`` or a node name) names and the index of its row, if it has one."""
    if not q:
        return "", None
    index = {row.node: i for i, row in enumerate(rows)}
    if q in index:
        return f"node {q}", index[q]
    namespace, _, vm = q.partition("/")
    if vm:
        where = sorted(
            {
                name
                for name, held in holdings.items()
                for h in held
                if h.device is not None and h.device.set_key == (namespace, vm)
            }
        )
        shown = [n for n in where if n in index]
        if shown:
            return f"set {q}: Bound on {', '.join(where)}", index[shown[0]]
        if (namespace, vm) in lost_sets:
            return f"set {q} is Lost (on no node): see Lost sets below", None
        if where:
            return f"set {q} is Bound on {', '.join(where)}, which the filters hide", None
    return f"no node or set {q!r} on this board (a set is namespace/VM)", None


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
    q: str

    def strip(
        self, node: str, alloc: int, held: list[Holding], ids: dict[tuple[str, str], int]
    ) -> tuple[SafeString, int]:
        """The strip's cells (units past ``alloc`` marked over-booked) and how many there are.

        At most :data:`MAX_CELLS` cells: the booked units past the cap, and the free units
        past it, are counted in one "+N" mark each instead of drawn. The first cell of each
        holder is marked (``gs``) so a gap separates one set from the next."""
        parts: list[str] = []
        unit = drawn = hidden = 0  # the unit index (cells past ``alloc`` are over-booked) and cells drawn
        for holding in held:
            css, attrs = self._device(node, holding, ids) if holding.device else self._pod(holding)
            shown = min(holding.units, max(0, MAX_CELLS - drawn))
            parts.extend(
                f'<a class="u {css}{" gs" if i == unit and unit else ""}{" ob" if i >= alloc else ""}" {attrs}></a>'
                for i in range(unit, unit + shown)
            )
            unit, drawn, hidden = unit + holding.units, drawn + shown, hidden + holding.units - shown
        parts.append(_more(hidden, "booked units"))
        free = max(0, alloc - unit)
        shown = min(free, max(0, MAX_CELLS - drawn))
        if shown:
            if unit:
                parts.append('<span class="sg"></span>')  # the gap after the last holder
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
        key = f"{device.namespace}/{device.vm_name}"
        css = self.tenant_css(device.namespace) + (" hl pin" if key == self.q else "")
        return css, f'href="{href}" data-set="{escape(key, quote=True)}" title="{title}"'

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
        data_set = f' data-set="{escape(f"{launcher.namespace}/{launcher.name}", quote=True)}"' if launcher else ""
        return f"p {self.tenant_css(pod.namespace)}", f'href="{href}"{data_set} title="{title}"'


def _lost_devices(cluster: e.Cluster, filters: Filters) -> dict[tuple[str, str], list[e.Device]]:
    sets: dict[tuple[str, str], list[e.Device]] = defaultdict(list)
    for device in cluster.devices:
        if device.phase is e.Phase.LOST:
            sets[device.set_key].append(device)
    return {
        key: sorted(devices, key=lambda d: d.name)
        for key, devices in sorted(sets.items())
        if (not filters.tenant or key[0] == filters.tenant)
        and (not filters.class_name or any(d.class_name == filters.class_name for d in devices))
    }


def _lost_sets(
    sets: Mapping[tuple[str, str], list[e.Device]],
    classes: dict[str, e.GpuClass],
    tenant_css: Callable[[str], str],
    explainer: Explainer,
    q: str,
) -> list[LostSetCells]:
    """Lost sets hold no node but still count in budgets: one hatched cell per unit."""
    out = []
    for (namespace, vm), devices in sets.items():
        units = sum(classes[d.class_name].units_per_device for d in devices if d.class_name in classes)
        since = min((d.since for d in devices if d.since), default=None)
        title = _title(
            f"Lost set {namespace}/{vm}: {len(devices)} devices, {units} units",
            f"VM {vm} · tenant {namespace}",
            f"Lost since {_when(since)}",
            f"reason: {devices[0].reason}",
        )
        key = escape(f"{namespace}/{vm}", quote=True)
        tcss = tenant_css(namespace) + (" hl pin" if f"{namespace}/{vm}" == q else "")
        cells = f'<i class="u lost {tcss}" data-set="{key}" title="{title}"></i>' * min(units, MAX_CELLS)
        cells += _more(units - min(units, MAX_CELLS), "units of this Lost set")
        out.append(
            LostSetCells(
                namespace=namespace,
                vm=vm,
                devices=len(devices),
                units=units,
                since=since,
                reason=devices[0].reason,
                cells=mark_safe(cells),  # noqa: S308 - the title is escaped
                explanation=explainer.explain((namespace, vm)),
            )
        )
    return out

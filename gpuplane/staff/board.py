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

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from html import escape
from typing import Any

from django.utils.safestring import SafeString, mark_safe

from binder.engine import Holding, Ledger, ledger_for
from binder.engine import types as e
from binder.engine.explain import ClassGap, Explainer, Explanation
from binder.reports.explanations import explanation_html
from gpuplane.staff.board_rows import (
    MEMO_SIZE,
    SEVERITY,
    SORTS,
    Filters,
    Row,
    Strip,
    _remembered,
    _when,
)
from gpuplane.staff.palette import PALETTE, ranked_colours

__all__ = [
    "MAX_CELLS",
    "MAX_LOST",
    "MEMO_SIZE",
    "PAGE_SIZE",
    "SEVERITY",
    "SORTS",
    "Board",
    "BoardFilterError",
    "Filters",
    "Legend",
    "LostSetCells",
    "Row",
    "Strip",
    "build_board",
    "find_tenant",
]

#: Cells drawn per strip (one node's resource) and per Lost set; past it a count stands in
#: for the rest. A node has at most a few dozen units of a GPU resource, but a pod may
#: request 200,000 (a 37 MiB page) and a node may claim a million allocatable.
MAX_CELLS = 256
#: Node rows per page.
PAGE_SIZE = 100
#: Lost sets drawn and explained on the board (all of them are on the Lost sets page).
MAX_LOST = 20


def _more(units: int, what: str) -> str:
    return f'<b class="more" title="{units} {what} not drawn">+{units}</b>' if units > 0 else ""


class BoardFilterError(ValueError):
    """A filter names something the cluster does not have (shown to staff, never a 500)."""


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
    borrowed_units: int = 0
    """Units held by borrowed sets (lent beyond budgets), drawn dotted; the legend says so."""
    marked_sets: int = 0
    """Borrowed sets marked for reclaim (drawn with a dashed border): each waits for its VM to stop."""

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


def _class_words(device: e.Device) -> str:
    """``class h100``, or for a device with alternatives the class it is held as and every
    choice in order: ``held as a100 (choices h100, a100)``."""
    if len(device.choices) > 1:
        return f"held as {device.class_name} (choices {', '.join(device.choices)})"
    return f"class {device.class_name}"


def _title(*lines: str) -> str:
    return escape("\n".join(line for line in lines if line), quote=True)


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
    found, target = _find(filters.q, rows, lost_sets, ledger)
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
        held = holdings.get(row.node, ())
        for strip in row.strips:
            strip.held = [h for h in held if h.resource == strip.resource]
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
        borrowed_units=sum(units for lent in ledger.borrowed.values() for k, units in lent.items() if "/" in k),
        marked_sets=sum(1 for key in ledger.borrowed_sets if any(d.reclaim_for for d in ledger.devices(key))),
    )


def _find(
    q: str,
    rows: list[Row],
    lost_sets: Mapping[tuple[str, str], list[e.Device]],
    ledger: Ledger,
) -> tuple[str, int | None]:
    """What ``q`` (``ns/vm`` or a node name) names and the index of its row, if it has one."""
    if not q:
        return "", None
    index = {row.node: i for i, row in enumerate(rows)}
    if q in index:
        return f"node {q}", index[q]
    namespace, _, vm = q.partition("/")
    if vm:
        # The nodes where the set's devices are held (as the ledger itemises holdings).
        where = sorted(
            {
                d.node
                for d in ledger.devices((namespace, vm))
                if d.phase is e.Phase.BOUND and d.node and d.class_name in ledger.classes
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
            f"VM {device.vm_name} · tenant {device.namespace} · {_class_words(device)}",
            f"{device.phase.value} on {node} since {_when(device.since)}",
            f"reason: {device.reason}",
            *(["borrowed: lent beyond the tenant's limit, taken back only while its VM is stopped"]
              if device.borrowed else []),
            *([f"marked for reclaim by {device.reclaim_for}: waits for its VM to stop"] if device.reclaim_for else []),
        )  # fmt: skip
        key = f"{device.namespace}/{device.vm_name}"
        css = self.tenant_css(device.namespace) + (" hl pin" if key == self.q else "")
        css += (" bw" if device.borrowed else "") + (" rc" if device.reclaim_for else "")
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
            f"VM {vm} · tenant {namespace} · {_class_words(devices[0])}",
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

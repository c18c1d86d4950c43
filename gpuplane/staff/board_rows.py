"""The board's rows: every node summed for one snapshot, filter and order.

Each node's strips (one per GPU resource: allocatable, booked, free for new units; who
holds them is filled in for the rows a page draws), its state markers, the totals and the
units per tenant are summed over the whole cluster so the rows can be sorted and filtered,
and kept per snapshot (``memo``) so paging does not sum every node again. A node's strips,
markers and row are also kept across snapshots while its record, booked units and the
classes are equal, so the first board after a change rebuilds only the nodes it touched.
Free means free for new units, as the binder and the catalog count it (``refuses_new``).
The page's drawing is ``gpuplane.staff.board``.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import urlencode

from django.utils.safestring import SafeString

from binder.engine import Holding, Ledger
from binder.engine import types as e
from binder.engine.explain import ClassGap, Explainer, Explanation, class_gaps
from binder.engine.fit import refuses_new
from gpuplane.staff.snapshot import node_units, on_forget

#: The memo's key of the units per node, tenant and resource (every filter sums them).
_UNITS = ("board", "units")
#: Summaries kept per snapshot (filter and order combinations) before the memo is emptied.
MEMO_SIZE = 16
#: ``?sort=``: by node name, by free units (for new units), by state (the worst first).
SORTS = ("name", "-name", "free", "-free", "state", "-state")
#: How bad a node state is, for ``sort=state`` (worst first) and "only problem nodes".
SEVERITY = {"deleted": 5, "notready": 4, "overbooked": 3, "draining": 2, "cordoned": 1}


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
    """Who holds its units (filled for the rows a page draws)."""
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
        units = memo.get(_UNITS) if memo is not None else None
        if units is None:
            units = node_units(ledger)
        work = _summarise(cluster, ledger, holdings, units, filters, wanted)
        if memo is not None:
            if len(memo) >= MEMO_SIZE:
                memo.clear()
            memo[_UNITS] = units
            memo[key] = work
    assert isinstance(work, _Work)  # noqa: S101 - only _Work is stored under a board key
    return work


def _summarise(
    cluster: e.Cluster,
    ledger: Ledger,
    holdings: Mapping[str, list[Holding]],
    units: Mapping[str, Mapping[tuple[str, str], int]],
    filters: Filters,
    wanted: str,
) -> _Work:
    rows, totals, units_by_tenant, node_count = _rows(cluster, ledger, units, filters, wanted)
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
    cluster: e.Cluster,
    ledger: Ledger,
    units: Mapping[str, Mapping[tuple[str, str], int]],
    filters: Filters,
    wanted: str,
) -> tuple[list[Row], dict[str, list[int]], Counter[str], int]:
    """Every matching node's row (no cells, and no holdings: the page's rows get theirs
    when drawn), the totals per resource, the units per tenant on them (``units``: node ->
    (tenant, resource) -> units, see ``snapshot.node_units``), and how many nodes the
    board has in all."""
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
    with _node_rows_lock:
        before = _node_rows.get(only_resource, {})
    kept: dict[str, _NodeRow] = {}
    for name in node_names:
        node = nodes.get(name)
        booked: Mapping[str, int] = ledger.booked.get(name, {})
        old = before.get(name)
        if (
            old is not None
            and (old.node is node or old.node == node)
            and (old.classes is cluster.classes or old.classes == cluster.classes)
            and old.only_resource == only_resource
            and old.booked == booked
        ):
            found = old
        else:
            found = _node_row(name, node, booked, cluster.classes, classes, class_resources, only_resource)
        kept[name] = found
        resources = found.resources
        here = units.get(name, {})
        if not resources or (wanted and not any(ns == wanted and r in resources for ns, r in here)):
            continue
        if filters.problems and not any(css != "taint" for css, _ in found.markers):
            continue
        for strip in found.strips:
            total = totals[strip.resource]
            total[0] += strip.allocatable
            total[1] += strip.booked
            total[2] += strip.free
        for (namespace, resource), count in here.items():
            if resource in resources and (not wanted or namespace == wanted):
                units_by_tenant[namespace] += count
        rows.append(found.row)
    with _node_rows_lock:
        _node_rows[only_resource] = kept

    return rows, totals, units_by_tenant, len(node_names)


@dataclass(frozen=True, slots=True)
class _NodeRow:
    """A node's strips and markers, with what they were worked out from."""

    node: e.Node | None
    booked: Mapping[str, int]
    classes: tuple[e.GpuClass, ...]
    only_resource: str
    resources: frozenset[str]
    strips: tuple[Strip, ...]
    markers: list[tuple[str, str]]
    row: Row
    """The node's row, shared by every board that shows the node unchanged (the page
    draws copies of it: ``build_board``)."""


#: Per class filter's resource ("" for all), the last board's strips and markers per
#: node, reused for a node whose record, booked units and classes are equal to those they
#: were worked out from: most nodes, after a change (the read model keeps the records a
#: follow does not touch, so the comparison is mostly of identical objects).
_node_rows: dict[str, dict[str, _NodeRow]] = {}
_node_rows_lock = threading.Lock()


def _forget_rows() -> None:
    with _node_rows_lock:
        _node_rows.clear()


on_forget.append(_forget_rows)


def _node_row(
    name: str,
    node: e.Node | None,
    booked: Mapping[str, int],
    class_records: tuple[e.GpuClass, ...],
    classes: Mapping[str, e.GpuClass],
    class_resources: Mapping[str, list[str]],
    only_resource: str,
) -> _NodeRow:
    allocatable = node.allocatable if node else {}
    resources = {r for r in allocatable if r in class_resources and allocatable[r] > 0}
    resources |= {r for r, units in booked.items() if units > 0}
    if only_resource:
        resources &= {only_resource}
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
                held=[],
                blocked=blocked,
            )
        )
    markers = _markers(node, strips)
    return _NodeRow(
        node=node,
        booked=dict(booked),
        classes=class_records,
        only_resource=only_resource,
        resources=frozenset(resources),
        strips=tuple(strips),
        markers=markers,
        row=Row(name, markers, strips, " ".join(m for m, _ in markers)),
    )


def _blocked(node: e.Node | None, classes: list[e.GpuClass]) -> str:
    """Why ``node`` takes no new units of any of ``classes`` ("" when one of them may go there)."""
    if node is None:
        return "deleted"
    if not classes:
        return "no class uses this resource"
    reasons = [refuses_new(node, (cls,)) for cls in classes]
    return "" if any(r is None for r in reasons) else str(reasons[0])


def _markers(node: e.Node | None, strips: list[Strip]) -> list[tuple[str, str]]:
    """The node's state marks: deleted, NotReady, cordoned, draining, over-booked, its taints."""
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
    if node is not None:
        # Last, and no problem by itself: a taint keeps out only the classes that do not
        # tolerate it (the strips say which resources take nothing new). Those under
        # node.kubernetes.io/ say what NotReady and cordoned already say, and the binder
        # leaves them to those rules.
        markers += [("taint", f"taint {t}") for t in node.taints if not t.key.startswith(e.NODE_LIFECYCLE_TAINT_PREFIX)]
    return markers


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

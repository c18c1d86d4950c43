"""The staff search: one box for "where is tenant X's VM Y" and everything around it.

A query is a tenant (namespace), a VM, a device, a node or a pod name, or part of one;
``ns/name`` narrows the name to that tenant (exact namespace first, else namespaces
containing it). Matching is case-insensitive substring, every group capped at ``limit``
hits with the total kept, so a one-letter query at 10,000 nodes is still one short page
(each group is one indexed or scanned query with a LIMIT, never a whole table in Python).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from django.db.models import Count, Max, Min, Q, QuerySet

from binder import models
from binder.reports.formatting import class_words

#: Hits per group on the results page.
LIMIT = 25
MAX_QUERY = 300


class SearchQueryError(ValueError):
    """The query cannot be searched (too long); the message says why."""


@dataclass(frozen=True, slots=True)
class Hit:
    kind: str
    """tenant, vm, device, node or pod."""
    namespace: str
    name: str
    detail: str = ""
    pk: int | None = None
    node: str = ""

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace and self.kind != "tenant" else self.name


@dataclass(frozen=True, slots=True)
class Group:
    kind: str
    title: str
    hits: tuple[Hit, ...]
    total: int

    @property
    def more(self) -> int:
        return self.total - len(self.hits)


@dataclass(frozen=True, slots=True)
class Results:
    query: str
    namespace: str = ""
    """With ``ns/name``: the tenant part."""
    term: str = ""
    groups: tuple[Group, ...] = field(default=())

    @property
    def total(self) -> int:
        return sum(g.total for g in self.groups)


def _capped(queryset: QuerySet, limit: int) -> tuple[list, int]:  # type: ignore[type-arg]
    rows = list(queryset[: limit + 1])
    total = len(rows) if len(rows) <= limit else queryset.count()
    return rows[:limit], total


def _namespaces(part: str) -> list[str]:
    exact = list(models.Namespace.objects.filter(name__iexact=part).values_list("name", flat=True))
    if exact:
        return exact
    return list(models.Namespace.objects.filter(name__icontains=part).values_list("name", flat=True)[:100])


@dataclass(frozen=True, slots=True)
class _Scope:
    """A parsed query: the name part, and the tenants it is narrowed to (None: all)."""

    term: str
    namespaces: list[str] | None
    limit: int

    def narrow(self, queryset: QuerySet, lookup: str = "namespace__name") -> QuerySet:  # type: ignore[type-arg]
        return queryset.filter(**{f"{lookup}__in": self.namespaces}) if self.namespaces is not None else queryset

    def named(self, *lookups: str) -> Q:
        """Rows whose name matches, or (a bare query naming a tenant exactly) of that tenant:
        "team-vision" lists what the tenant has, not only the tenant itself."""
        if not self.term:
            return Q()
        match = Q(namespace__name__iexact=self.term) if self.namespaces is None else Q(pk__in=[])
        for lookup in lookups:
            match |= Q(**{lookup: self.term})
        return match


def search(query: str, kinds: set[str] | None = None, limit: int = LIMIT) -> Results:
    """Hits of ``query`` per kind (``kinds``: the ones the caller may see; None: all)."""
    query = query.strip()
    if len(query) > MAX_QUERY:
        raise SearchQueryError(f"the query has {len(query)} characters; at most {MAX_QUERY} are searched")
    if not query:
        return Results(query)
    wanted = kinds if kinds is not None else set(_GROUPS)
    namespace, slash, term = (part.strip() for part in query.partition("/"))
    if not slash:
        namespace, term = "", query
    scope = _Scope(term, _namespaces(namespace) if namespace else None, limit)
    if scope.namespaces == []:
        return Results(query, namespace, term)
    groups = tuple(group for kind, find in _GROUPS.items() if kind in wanted and (group := find(scope)) is not None)
    return Results(query, namespace, term, groups)


def _tenants(scope: _Scope) -> Group:
    if scope.namespaces is None:
        tenants = models.Namespace.objects.filter(name__icontains=scope.term)
    elif not scope.term:
        tenants = models.Namespace.objects.filter(name__in=scope.namespaces)
    else:
        tenants = models.Namespace.objects.none()  # "ns/vm" asks for the VM, not the tenant
    rows, total = _capped(tenants.annotate(n_devices=Count("devices")).order_by("name"), scope.limit)
    hits = tuple(Hit("tenant", t.name, t.name, f"{t.n_devices} devices", t.pk) for t in rows)
    return Group("tenant", "Tenants", hits, total)


def _vms(scope: _Scope) -> Group:
    sets = scope.narrow(models.GpuDevice.objects.filter(scope.named("vm_name__icontains")))
    per_set = (
        sets.values("namespace__name", "vm_name")
        .annotate(
            n=Count("id"),
            bound=Count("id", filter=Q(phase=models.Phase.BOUND)),
            lost=Count("id", filter=Q(phase=models.Phase.LOST)),
            pending=Count("id", filter=Q(phase=models.Phase.PENDING)),
            first_node=Min("node"),
            last_node=Max("node"),
        )
        .order_by("namespace__name", "vm_name")
    )
    rows, total = _capped(per_set, scope.limit)
    hits = []
    for s in rows:
        phases = ", ".join(f"{s[p]} {p.title()}" for p in ("bound", "lost", "pending") if s[p])
        node = s["first_node"] if s["first_node"] and s["first_node"] == s["last_node"] else ""
        where = f" on {node}" if node else ""
        hits.append(Hit("vm", s["namespace__name"], s["vm_name"], f"{s['n']} devices: {phases}{where}", node=node))
    # a VMI without gpuplane devices still answers "where is VM Y"
    known = {(h.namespace, h.name) for h in hits}
    vmis = scope.narrow(models.VirtualMachineInstance.objects.filter(scope.named("name__icontains")))
    vmi_rows, _ = _capped(vmis.select_related("namespace").order_by("namespace__name", "name"), scope.limit)
    extra = [
        Hit("vm", v.namespace.name, v.name, f"VMI {v.phase or '?'}, no GPU devices", v.pk, v.node)
        for v in vmi_rows
        if (v.namespace.name, v.name) not in known
    ]
    hits.extend(extra[: max(0, scope.limit - len(hits))])
    return Group("vm", "VMs (sets)", tuple(hits), total + len(extra))


def _devices(scope: _Scope) -> Group:
    devices = scope.narrow(models.GpuDevice.objects.filter(scope.named("name__icontains")))
    rows, total = _capped(devices.select_related("namespace").order_by("namespace__name", "name"), scope.limit)
    hits = tuple(
        Hit(
            "device",
            d.namespace.name,
            d.name,
            f"{class_words(d)}, VM {d.vm_name}: {d.phase}" + (f" on {d.node}" if d.node else ""),
            d.pk,
            d.node,
        )
        for d in rows
    )
    return Group("device", "GPU devices", hits, total)


def _nodes(scope: _Scope) -> Group | None:
    if scope.namespaces is not None:
        return None  # nodes belong to no tenant
    rows, total = _capped(models.Node.objects.filter(name__icontains=scope.term).order_by("name"), scope.limit)
    return Group("node", "Nodes", tuple(Hit("node", "", n.name, _node_words(n), n.pk, n.name) for n in rows), total)


def _pods(scope: _Scope) -> Group:
    pods = scope.narrow(models.Pod.objects.filter(scope.named("name__icontains", "uid")))
    rows, total = _capped(pods.select_related("namespace").order_by("namespace__name", "name"), scope.limit)
    hits = tuple(
        Hit("pod", p.namespace.name, p.name, (p.phase or "?") + (f" on {p.node}" if p.node else ""), p.pk, p.node)
        for p in rows
    )
    return Group("pod", "Pods", hits, total)


_GROUPS: dict[str, Callable[[_Scope], Group | None]] = {
    "tenant": _tenants,
    "vm": _vms,
    "device": _devices,
    "node": _nodes,
    "pod": _pods,
}


def _node_words(node: models.Node) -> str:
    words = ["Ready" if node.ready else "NotReady"]
    if node.unschedulable:
        words.append("cordoned")
    if node.draining:
        words.append("draining")
    resources = ", ".join(f"{r} ×{n}" for r, n in sorted((node.allocatable or {}).items()))
    return ", ".join(words) + (f"; {resources}" if resources else "")

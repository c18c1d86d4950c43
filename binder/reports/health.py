"""The health of the fleet, for the admin's home page: what needs a person now.

Lost sets, Pending sets with their reasons, nodes that are NotReady, cordoned or
draining, and budgets at their limit, each capped at ``limit`` rows with the total kept.
Each list is one aggregate or filtered query over the mirror (the budgets' ``used`` is the
status the last full pass wrote; budgets are one or two per tenant), never the whole
cluster read into Python, so the page costs about the same at 10 nodes as at 10,000.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Count, Max, Min, Q
from django.utils import timezone

from binder import models
from binder.engine.types import DRAIN_LABEL

LIMIT = 20


@dataclass(frozen=True, slots=True)
class SetLine:
    namespace: str
    vm: str
    devices: int
    since: datetime | None
    reason: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.vm}"


@dataclass(frozen=True, slots=True)
class NodeLine:
    name: str
    states: tuple[str, ...]
    since: datetime | None
    """NotReady since (the Ready condition's last transition), when NotReady."""


@dataclass(frozen=True, slots=True)
class BudgetLine:
    namespace: str
    name: str
    key: str
    used: int
    limit: int

    @property
    def over(self) -> bool:
        return self.used > self.limit

    @property
    def excess(self) -> int:
        return max(0, self.used - self.limit)


@dataclass(frozen=True, slots=True)
class Listing[T]:
    rows: tuple[T, ...] = ()
    total: int = 0

    @property
    def more(self) -> int:
        return self.total - len(self.rows)


@dataclass(frozen=True, slots=True)
class FleetHealth:
    at: datetime
    lost: Listing[SetLine] = field(default_factory=Listing)
    pending: Listing[SetLine] = field(default_factory=Listing)
    nodes: Listing[NodeLine] = field(default_factory=Listing)
    budgets: Listing[BudgetLine] = field(default_factory=Listing)

    @property
    def healthy(self) -> bool:
        return not (self.lost.total or self.pending.total or self.nodes.total or self.budgets.total)


def _sets(phase: str, limit: int) -> Listing[SetLine]:
    grouped = (
        models.GpuDevice.objects.filter(phase=phase)
        .values("namespace__name", "vm_name")
        .annotate(n=Count("id"), since=Min("since"), created=Min("created"), reason=Max("reason"))
        .order_by("since", "created", "namespace__name", "vm_name")
    )
    total = grouped.count()
    rows = tuple(
        SetLine(g["namespace__name"], g["vm_name"], g["n"], g["since"] or g["created"], g["reason"])
        for g in grouped[:limit]
    )
    return Listing(rows, total)


def _nodes(limit: int) -> Listing[NodeLine]:
    draining = Q(**{f"labels__{DRAIN_LABEL}__iexact": "true"})
    problems = models.Node.objects.filter(Q(ready=False) | Q(unschedulable=True) | draining).order_by("ready", "name")
    total = problems.count()
    rows = []
    for node in problems[:limit]:
        states = [s for s, on in (("NotReady", not node.ready), ("cordoned", node.unschedulable)) if on]
        if node.draining:
            states.append("draining")
        rows.append(NodeLine(node.name, tuple(states), node.ready_since if not node.ready else None))
    return Listing(tuple(rows), total)


def _budgets(limit: int) -> Listing[BudgetLine]:
    """Keys whose use (the last full pass's status) has reached the limit: the tenant's next
    order of that key is refused."""
    full = []
    for budget in models.GpuBudget.objects.select_related("namespace").order_by("namespace__name", "name"):
        used = budget.used or {}
        for key, value in sorted((budget.limits or {}).items()):
            if int(used.get(key, 0)) >= int(value):
                full.append(BudgetLine(budget.namespace.name, budget.name, key, int(used.get(key, 0)), int(value)))
    return Listing(tuple(full[:limit]), len(full))


def fleet_health(limit: int = LIMIT) -> FleetHealth:
    return FleetHealth(
        at=timezone.now(),
        lost=_sets(models.Phase.LOST, limit),
        pending=_sets(models.Phase.PENDING, limit),
        nodes=_nodes(limit),
        budgets=_budgets(limit),
    )

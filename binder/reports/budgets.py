"""Budgets as staff read them: usage against limit per tenant and key, raw keys included.

The numbers are the engine's: usage from the one ledger (devices Bound or Lost, plus
pods' raw usage as the shared launcher reader decides it) and limits merged by
``effective_limits`` (the smallest limit per key wins; ``GPUPLANE_DEFAULT_BUDGET=deny``
limits every key of a tenant without a budget to zero). The binder enforces exactly
these, so a bar at 100 % means the next order of that key is refused, unless the budget
lets the tenant borrow idle GPUs beyond it (shown beside: the allowance and what its
borrowed sets hold now).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from binder.engine import effective_limits, ledger_for, tenant_usage
from binder.engine import types as e
from binder.engine.limits import is_raw_key, remaining


@dataclass(frozen=True, slots=True)
class KeyBar:
    """One key of one tenant: used units, the limit (``None``: unlimited) and the bar."""

    key: str
    raw: bool
    used: int
    limit: int | None
    borrowing: int = 0
    """Units the tenant may hold beyond the limit on idle GPUs (lending; 0: none)."""
    borrowed: int = 0
    """Units of ``used`` held by borrowed sets (lent beyond the limit, taken back only while
    their VM is stopped)."""

    @property
    def percent(self) -> int:
        """Bar length: used / limit, capped at 100 (unlimited keys draw no bar)."""
        if self.limit is None:
            return 0
        if self.limit <= 0:
            return 100 if self.used else 0
        return min(100, round(100 * self.used / self.limit))

    @property
    def over(self) -> bool:
        """Usage above the limit (the cluster changed under the budget, or it was lowered)."""
        return self.limit is not None and self.used > self.limit

    @property
    def full(self) -> bool:
        return self.limit is not None and self.used >= self.limit

    @property
    def excess(self) -> int:
        return 0 if self.limit is None else max(0, self.used - self.limit)

    @property
    def remaining(self) -> int | None:
        return remaining(self.limit, self.used)


@dataclass(frozen=True, slots=True)
class TenantBudget:
    """A tenant's keys, class keys first, then raw keys; ``budgets`` names its GPUBudgets."""

    namespace: str
    budgets: tuple[str, ...]
    keys: tuple[KeyBar, ...]
    denied_by_default: bool


def budget_bars(cluster: e.Cluster, namespaces: Iterable[str] = ()) -> list[TenantBudget]:
    """Every tenant (a namespace, or anything with devices, pods or budgets) with its keys."""
    ledger = ledger_for(cluster)
    budgets: dict[str, list[e.Budget]] = defaultdict(list)
    for budget in cluster.budgets:
        budgets[budget.namespace].append(budget)
    tenants = (
        set(namespaces) | set(budgets) | {d.namespace for d in cluster.devices} | {p.namespace for p in cluster.pods}
    )
    out = []
    for namespace in sorted(tenants):
        used = tenant_usage(ledger, namespace)
        limits = effective_limits(budgets.get(namespace, ()), cluster.settings.default_budget)
        lent: Mapping[str, int] = ledger.borrowed.get(namespace, {})
        keys = sorted(set(used) | set(limits.per_key), key=lambda k: (is_raw_key(k), k))
        out.append(
            TenantBudget(
                namespace=namespace,
                budgets=tuple(sorted(b.name for b in budgets.get(namespace, ()))),
                keys=tuple(
                    KeyBar(k, is_raw_key(k), used.get(k, 0), limits.limit(k), limits.allowance(k), lent.get(k, 0))
                    for k in keys
                ),
                denied_by_default=limits.deny_rest,
            )
        )
    return out

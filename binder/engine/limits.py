"""Budget keys and a tenant's effective limits, computed one way for every reader of a
budget: the pass, the catalog, the budget bars, the tenant usage API.

Apart from the ledger (``binder.engine.accounting``) because they need no ledger: a limit
and what it leaves are arithmetic on a tenant's budgets and a set's devices.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

from binder.engine.types import Budget, DefaultBudget, Device, GpuClass, Phase, quick_records


def is_raw_key(key: str) -> bool:
    """A budget key with a ``/`` is a raw resource name; any other key is a class name."""
    return "/" in key


def class_units(
    members: Iterable[Device], classes: Mapping[str, GpuClass], placed: Container[str] = ()
) -> dict[str, int]:
    """The units a set's devices use, per class name and per class resource name: Bound and
    Lost devices, and the Pending ones named in ``placed`` (a new order counted as if it
    were placed). Budgets count both keys; one loop for every caller that sums them."""
    used: dict[str, int] = {}
    for device in members:
        if device.phase is Phase.PENDING and device.name not in placed:
            continue
        cls = classes.get(device.class_name)
        if cls is None:
            continue
        units = cls.units_per_device
        used[cls.name] = used.get(cls.name, 0) + units
        used[cls.resource_name] = used.get(cls.resource_name, 0) + units
    return used


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's effective limits: the smallest limit per key over its budgets.

    ``deny_rest`` is set when the tenant has no budget and ``GPUPLANE_DEFAULT_BUDGET=deny``:
    every key is then limited to zero.
    """

    per_key: Mapping[str, int] = field(default_factory=dict)
    deny_rest: bool = False
    borrowing: Mapping[str, int] = field(default_factory=dict)
    """The effective borrowing per limited key named in some budget's ``borrowing``: the
    smallest over the budgets that limit the key, one limiting it without an entry
    counting 0. A key not here cannot borrow."""

    @property
    def unlimited(self) -> bool:
        """No key is limited: no change can exceed a budget."""
        return not self.per_key and not self.deny_rest

    def limit(self, key: str) -> int | None:
        if key in self.per_key:
            return self.per_key[key]
        return 0 if self.deny_rest else None

    def remaining(self, key: str, used: int) -> int | None:
        """Units of ``key`` still allowed after ``used`` (never negative); None: unlimited."""
        return remaining(self.limit(key), used)

    def allowance(self, key: str) -> int:
        """Units of ``key`` the tenant may hold beyond its limit by borrowing (0: none)."""
        return self.borrowing.get(key, 0)


def remaining(limit: int | None, used: int) -> int | None:
    """What a limit leaves after ``used``: ``max(0, limit - used)``, None when unlimited.
    The catalog, the budget bars and the tenant usage API all show this one number."""
    return None if limit is None else max(0, limit - used)


def effective_limits(budgets: Iterable[Budget], default: DefaultBudget) -> Limits:
    """Merge a namespace's budgets: the smallest limit per key wins, and likewise the
    smallest borrowing, where a budget that limits a key without a borrowing entry for it
    counts 0 (the strictest budget decides, as for limits)."""
    merged: dict[str, int] = {}
    budgets = tuple(budgets)
    for budget in budgets:
        for key, value in budget.limits.items():
            merged[key] = min(merged.get(key, value), value)
    named = {key for budget in budgets for key in budget.borrowing if key in merged}
    borrowing: dict[str, int] = {}
    for key in sorted(named):
        borrowing[key] = min(b.borrowing.get(key, 0) for b in budgets if key in b.limits)
    return Limits(per_key=merged, deny_rest=not budgets and default is DefaultBudget.DENY, borrowing=borrowing)


quick_records(Limits)

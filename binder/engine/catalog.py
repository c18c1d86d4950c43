"""The catalog of GPU options a tenant may pick (SPEC §8), computed from one snapshot.

Every number comes from the engine's one :class:`~binder.engine.accounting.Ledger`:
free units per node and the tenant's usage per key already count pods' raw usage by
the shared launcher reader, so a pod that forges a launcher's owner reference and
labels lowers the free capacity and the remaining raw budget here exactly as it does
for the binder. Nothing here counts units a second way.

Units and devices: ``limit``, ``used`` and ``cluster_free`` are units (as in budgets
and ``dump_state``); ``remaining`` and ``largest_set`` are devices of the class
(units // unitsPerDevice), since that is what a tenant orders.

Which classes are listed: every class whose class key and raw key both allow the
tenant something (limit > 0 or no limit). A key limited to 0, including every key of a
tenant with no GPUBudget under ``GPUPLANE_DEFAULT_BUDGET=deny``, hides the class.
"""

from __future__ import annotations

from dataclasses import dataclass

from binder.engine.accounting import Ledger, effective_limits, ledger_for, remaining
from binder.engine.placement import refuses_new
from binder.engine.types import Cluster, GpuClass, Node


@dataclass(frozen=True, slots=True)
class GpuOption:
    """One class as the catalog offers it to one tenant."""

    name: str
    display_name: str
    resource_name: str
    units_per_device: int
    limit: int | None
    """The tenant's limit of the class key, in units; None when unlimited."""
    used: int
    """The tenant's usage of the class key, in units (Bound or Lost devices)."""
    remaining: int | None
    """Devices the budget still allows: min over the class key and the raw key of
    (limit − usage) // unitsPerDevice, never below 0; None when neither key is limited."""
    cluster_free: int
    """Free units of the class's resource on nodes that may take new devices of it."""
    largest_set: int
    """The most devices of this class one node could take now (capped by ``remaining``)."""


def takes_new(node: Node, cls: GpuClass) -> bool:
    """May ``node`` take new devices of ``cls`` now? The binder's own rule (``refuses_new``)."""
    return refuses_new(node, [cls]) is None


def _remaining(limits: dict[str, int | None], usage: dict[str, int], units_per_device: int) -> int | None:
    left: int | None = None
    for key, limit in limits.items():
        if limit is None:
            continue
        units = remaining(limit, usage.get(key, 0))
        left = units if left is None or units is None else min(left, units)
    return None if left is None else left // units_per_device


def gpu_options(cluster: Cluster, namespace: str, ledger: Ledger | None = None) -> list[GpuOption]:
    """The GPU options of tenant ``namespace``, sorted by class name.

    ``ledger`` may be passed when the caller already built it from ``cluster``.
    """
    ledger = ledger if ledger is not None else ledger_for(cluster)
    limits = effective_limits((b for b in cluster.budgets if b.namespace == namespace), cluster.settings.default_budget)
    usage = dict(ledger.used.get(namespace, {}))
    options = []
    for cls in sorted(cluster.classes, key=lambda c: c.name):
        keys = {cls.name: limits.limit(cls.name), cls.resource_name: limits.limit(cls.resource_name)}
        if any(limit is not None and limit <= 0 for limit in keys.values()):
            continue
        upd = max(1, cls.units_per_device)
        remaining = _remaining(keys, usage, upd)
        free = [max(0, ledger.free(n.name, cls.resource_name)) for n in cluster.nodes if takes_new(n, cls)]
        largest = max((units // upd for units in free), default=0)
        if remaining is not None:
            largest = min(largest, remaining)
        options.append(
            GpuOption(
                name=cls.name,
                display_name=cls.display_name or cls.name,
                resource_name=cls.resource_name,
                units_per_device=cls.units_per_device,
                limit=keys[cls.name],
                used=usage.get(cls.name, 0),
                remaining=remaining,
                cluster_free=sum(free),
                largest_set=largest,
            )
        )
    return options

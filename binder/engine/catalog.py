"""The catalog of GPU options a tenant may pick (``/api/v1/catalog/gpu-options``), computed
from one snapshot.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from binder.engine.accounting import Ledger, ledger_for
from binder.engine.fit import refuses_new
from binder.engine.limits import effective_limits, remaining
from binder.engine.placement import try_order, waiting_resources
from binder.engine.reasons import refusal
from binder.engine.types import Cluster, Device, GpuClass, Node, Phase


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
    borrowing: int | None = None
    """The tenant's borrowing allowance of the class key, in units; None when it has none."""
    borrowable: int = 0
    """Devices the tenant could borrow now beyond its limits: idle units of the class no
    entitled set waits for, within limit + borrowing on every key."""


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
    waited: set[str] | None = None
    options = []
    for cls in sorted(cluster.classes, key=lambda c: c.name):
        keys = {cls.name: limits.limit(cls.name), cls.resource_name: limits.limit(cls.resource_name)}
        lends = any(limits.allowance(k) for k in keys)
        if any(limit is not None and limit + limits.allowance(k) <= 0 for k, limit in keys.items()):
            continue
        upd = max(1, cls.units_per_device)
        remaining = _remaining(keys, usage, upd)
        free = [max(0, ledger.free(n.name, cls.resource_name)) for n in cluster.nodes if takes_new(n, cls)]
        largest = max((units // upd for units in free), default=0)
        if remaining is not None:
            largest = min(largest, remaining)
        borrowable = 0
        if lends:
            if waited is None:
                waited = waiting_resources(cluster, ledger)
            if cls.resource_name not in waited:
                beyond = _beyond(keys, limits.borrowing, usage)
                borrowable = min(beyond, max((units // upd for units in free), default=0) * upd) // upd
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
                borrowing=limits.borrowing.get(cls.name),
                borrowable=borrowable,
            )
        )
    return options


def _beyond(limits: dict[str, int | None], borrowing: Mapping[str, int], usage: dict[str, int]) -> int:
    """Units the tenant may hold beyond its limits now: the least, over the limited keys,
    of limit + borrowing − max(usage, limit)."""
    room: int | None = None
    for key, limit in limits.items():
        if limit is None:
            continue
        left = max(0, limit + borrowing.get(key, 0) - max(usage.get(key, 0), limit))
        room = left if room is None else min(room, left)
    return room or 0


#: The VM name of the hypothetical order ``order_fit`` places: no Kubernetes name has a NUL.
_PROBE_VM = "\x00catalog-order"


@dataclass(frozen=True, slots=True)
class BudgetUse:
    """One budget key an order would count under: its limit (None: unlimited), the units
    used now and the units used after the order."""

    key: str
    limit: int | None
    used: int
    after: int


@dataclass(frozen=True, slots=True)
class OrderFit:
    """Whether an order of ``devices`` devices accepting ``choices`` (in that order) would
    be placed now, as which class and on which node, and why (the binder's sentence)."""

    devices: int
    choices: tuple[str, ...]
    fits: bool
    class_name: str = ""
    node: str = ""
    reason: str = ""
    budget: tuple[BudgetUse, ...] = field(default_factory=tuple)
    """The class key and raw key of ``class_name``, when it fits."""
    borrowed: bool = False
    """It would be placed by borrowing beyond the tenant's limits, so it may be taken back
    while its VM is stopped."""


def order_fit(
    cluster: Cluster, namespace: str, devices: int, choices: Sequence[str], scratch: Ledger | None = None
) -> OrderFit:
    """Would an order of ``devices`` devices of ``choices`` fit for tenant ``namespace`` now?

    Answered by placing a hypothetical order with the binder's own rules (the first
    choice with room and budget, the fullest node within it) on this snapshot; nothing
    is written. ``devices`` must be at least 1 and ``choices`` non-empty (callers check
    their input and say so). ``scratch``, a ledger of ``cluster`` that is the caller's own
    to spend (a read-model snapshot's copy), is placed into and left changed: the answer
    then costs what one order costs, not a ledger built from every device. Without it one
    is built.
    """
    names = tuple(dict.fromkeys(choices))
    if devices < 1 or not names:
        raise ValueError("an order needs at least one device and one class")
    key = (namespace, _PROBE_VM)
    alternatives = names if len(names) > 1 else ()
    order = tuple(
        Device(namespace, f"{_PROBE_VM}-{i}", names[0], _PROBE_VM, created=cluster.now, choices=alternatives)
        for i in range(devices)
    )
    work = scratch if scratch is not None else ledger_for(cluster)
    usage = dict(work.used.get(namespace, {}))
    work.commit(key, order)
    placed = try_order(cluster, key, work)
    fits = all(d.phase is Phase.BOUND for d in placed)
    if not fits:
        return OrderFit(devices, names, False, reason=refusal(placed[0]) if placed else "")
    reason = placed[0].reason
    chosen = placed[0].class_name
    cls = next(c for c in cluster.classes if c.name == chosen)
    limits = effective_limits((b for b in cluster.budgets if b.namespace == namespace), cluster.settings.default_budget)
    adds = devices * cls.units_per_device
    budget = tuple(
        BudgetUse(k, limits.limit(k), usage.get(k, 0), usage.get(k, 0) + adds) for k in (cls.name, cls.resource_name)
    )
    return OrderFit(devices, names, True, chosen, placed[0].node, reason, budget, placed[0].borrowed)

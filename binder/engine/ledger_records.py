"""The records the ledger (``binder.engine.accounting``) keeps: a set's contribution, a
holding of units on a node, the pods on each node, a change of contribution.

Apart from the ledger so that readers of what it holds (the explanations, the staff
snapshot) name these without the ledger's own machinery.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from binder.engine.types import Device, Pod, Vmi, quick_records

#: A set: (namespace, VM name).
SetKey = tuple[str, str]


@dataclass(slots=True)
class Contribution:
    """What one set (its devices plus its launcher pods) adds to nodes and to its tenant."""

    booked: dict[tuple[str, str], int] = field(default_factory=dict)
    """(node, resource) -> units."""
    used: dict[str, int] = field(default_factory=dict)
    """key (class name or raw resource) -> units, for the set's tenant."""


#: A set's bookings as the ledger keeps them: ((node, resource), units) pairs, the (node,
#: resource) tuples shared by every set booking that slot.
Booked = tuple[tuple[tuple[str, str], int], ...]
#: A set's usage as the ledger keeps it: (key, units) pairs, one tuple shared by every set
#: that uses the same (most sets of a tenant's kind use one of a few).
Used = tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Holding:
    """Units of one resource on one node and who books them: a Bound device, or a pod's
    raw usage for capacity (``launcher`` set when the pod is that VMI's launcher)."""

    resource: str
    units: int
    device: Device | None = None
    pod: Pod | None = None
    launcher: Vmi | None = None


quick_records(Holding)

#: One pod with raw usage on a node: (pod, its VMI when it is a set's launcher, that set or
#: the plain pod's capacity, the order holdings tie in).
PodOn = tuple[Pod, "Vmi | None", "SetKey | Mapping[str, int]", int]
PodsOn = dict[str, list[PodOn]]


@dataclass(slots=True)
class Delta:
    """A change of contribution; missing keys read as zero."""

    booked: Counter[tuple[str, str]]
    used: Counter[str]

"""One mirror snapshot, its ledger and holdings, reused by staff pages while the mirror is unchanged.

The mirror comes from this web process's read model (``binder.runtime.readmodel``): kept
in memory and brought current from the change feed before each use, so a page shows
every change committed before it was asked for, without reading the mirror's tables
(at 10,000 nodes that read and the ledger took about 1.3 s, more than the board may take
to show). The model's generation changes whenever a record in it changes (or it was read
again); same generation, same records: the cached snapshot, its ledger and what pages
derived from it (``memo``) are what a fresh read would give.

The cache holds one snapshot per process and also expires after :data:`MAX_AGE_SECONDS`,
so settings read at snapshot time (the grace period, the default budget) are never old
for long.

A fresh snapshot does as little as it can for the first board after a change: who holds
each node's units (:class:`NodeHoldings`, ``Ledger.holdings`` itemised) is worked out per
node when a page asks for that node (the board draws 100 rows), not for every node; what
the board sums over every node is the units per node, tenant and resource
(:func:`node_units`), from each set's contribution, and a set whose devices, launcher
pods and classes equal those of the previous snapshot keeps the contribution worked out
then. The read model's records are immutable values and survive follows that do not
touch them, so that comparison is mostly one of identical objects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.core.signals import setting_changed

from binder.engine import Holding, Ledger
from binder.engine import types as e
from binder.engine.ledger_records import PodsOn
from binder.runtime.readmodel import read_model

MAX_AGE_SECONDS = 60.0

SetKey = tuple[str, str]


class NodeHoldings(Mapping[str, list[Holding]]):
    """Node -> who books its units, as ``Ledger.holdings`` gives it (the same holdings in
    the same order: Bound devices by set and name, then pods' raw usage by tenant, name
    and resource), each node worked out when first asked for and kept.

    ``Ledger.holdings`` itemises every node at once: at 10,000 nodes and 100,000 devices
    0.6 s, for a page that draws 100 rows. Iterating (or ``len``) works out every node."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._pods_on = _pods_on(ledger)
        self._done: dict[str, list[Holding]] = {}

    def _candidates(self) -> set[str]:
        return set(self._ledger.sets_on) | set(self._pods_on)

    def _work_out(self, node: str) -> list[Holding]:
        return self._ledger.holdings_on(node, self._pods_on)

    def __getitem__(self, node: str) -> list[Holding]:
        found = self._done.get(node)
        if found is None:
            found = self._done[node] = self._work_out(node)
        if not found:
            raise KeyError(node)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(n for n in self._candidates() if n in self))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        """Whether any node may have holdings (without working any out): an empty mapping
        stays empty, and a mapping this calls true answers ``get`` as the ledger would."""
        return bool(self._ledger.sets_on) or bool(self._pods_on)


#: The last ledger's launcher and plain pods and the index made of them.
_last_pods: tuple[Mapping[SetKey, list[tuple[e.Pod, e.Vmi]]], list[tuple[e.Pod, Mapping[str, int]]], PodsOn] = (
    {},
    [],
    {},
)


def _pods_on(ledger: Ledger) -> PodsOn:
    """``Ledger.pods_on``, or the last ledger's index while its pods are equal (a copy of
    the same ledger: a comparison of identical objects); the raw usage itself is worked out
    per node, from the devices."""
    global _last_pods
    launchers, plain, index = _last_pods
    if ledger.launcher_pods == launchers and ledger.plain_pods == plain:
        return index
    index = ledger.pods_on()
    _last_pods = (ledger.launcher_pods, ledger.plain_pods, index)
    return index


#: What one set adds to nodes: its devices, launcher pods and classes, and (node,
#: resource) -> units, the units its holdings have there.
_Kept = tuple[tuple[e.Device, ...], list[tuple[e.Pod, e.Vmi]], Mapping[str, e.GpuClass], Mapping[tuple[str, str], int]]
NodeUnits = dict[str, dict[tuple[str, str], int]]
#: The previous call's sets and its sum over them (plain pods left out).
_previous: tuple[dict[SetKey, _Kept], NodeUnits] = ({}, {})
_previous_lock = threading.Lock()
#: Past this many changed sets the sum is made again rather than amended.
_AMEND_AT_MOST = 2000


def node_units(ledger: Ledger) -> NodeUnits:
    """Node -> (tenant, resource) -> units booked there (never 0): the units of every
    node's holdings, summed by tenant and resource, without itemising them.

    Each set's units are ``Ledger.contribution`` (its Bound devices and its launcher pods'
    raw usage: exactly its holdings), a function of those records' values. The previous
    call's sum is amended by the sets that changed since: a set whose devices, launcher
    pods and classes equal those of then keeps its contribution (the read model's records
    are immutable and kept across follows, so this compares mostly identical objects, also
    in a ledger built again); plain pods add their raw usage on top."""
    global _previous
    with _previous_lock:
        before, summed = _previous
    classes = ledger.classes
    launcher_pods = ledger.launcher_pods
    kept: dict[SetKey, _Kept] = {}
    changed: list[tuple[SetKey, Mapping[tuple[str, str], int], Mapping[tuple[str, str], int]]] = []
    keys: set[SetKey] = set(launcher_pods).union(*ledger.sets_on.values())
    nothing: Mapping[tuple[str, str], int] = {}
    devices_of, launchers_of, old_of = ledger.devices, launcher_pods.get, before.get
    for key in keys:
        devices = devices_of(key)
        launchers = launchers_of(key, [])
        old = old_of(key)
        if old is not None and old[0] == devices and old[1] == launchers and old[2] == classes:
            kept[key] = old
            continue
        booked = ledger.contribution(key, devices).booked
        kept[key] = (devices, launchers, classes, booked)
        changed.append((key, old[3] if old is not None else nothing, booked))
    changed.extend((key, old[3], nothing) for key, old in before.items() if key not in kept)
    if len(changed) > _AMEND_AT_MOST:
        summed, made = {}, set[str]()
        for key, entry in kept.items():
            _add(summed, key[0], entry[3], 1, made)
    else:
        summed = dict(summed)  # the previous sum may be in use: amend copies of the nodes touched
        copied: set[str] = set()
        for key, was, now in changed:
            _add(summed, key[0], was, -1, copied)
            _add(summed, key[0], now, 1, copied)
    with _previous_lock:
        _previous = (kept, summed)
    out = dict(summed)
    copied = set()
    for pod, capacity in ledger.plain_pods:
        _add(out, pod.namespace, {(pod.node, r): units for r, units in capacity.items()}, 1, copied)
    return out


def _add(summed: NodeUnits, namespace: str, booked: Mapping[tuple[str, str], int], sign: int, copied: set[str]) -> None:
    """Add (``sign`` 1) or take away (-1) ``booked`` of ``namespace``; a node's entry not
    yet in ``copied`` is copied first (it may be shared), and an entry reaching 0 goes."""
    for (node, resource), units in booked.items():
        if not units:
            continue
        slot = summed.get(node)
        if node not in copied:
            slot = summed[node] = dict(slot) if slot is not None else {}
            copied.add(node)
        assert slot is not None  # noqa: S101 - made just above when missing
        total = slot.get((namespace, resource), 0) + sign * units
        if total:
            slot[(namespace, resource)] = total
        else:
            slot.pop((namespace, resource), None)


@dataclass(frozen=True, slots=True)
class Snapshot:
    cluster: e.Cluster
    ids: dict[tuple[str, str], int]
    ledger: Ledger
    holdings: Mapping[str, list[Holding]]
    memo: dict[object, Any] = field(default_factory=dict)
    """What pages derive from this snapshot (the board's summed rows per filter and order)."""


_lock = threading.Lock()
_cached: tuple[tuple[object, ...], float, Snapshot] | None = None


def snapshot(now: datetime) -> Snapshot:
    """The mirror as one engine snapshot, from the cache when the read model did not change.

    Reused snapshots keep the moment they were read at as ``cluster.now``; the board
    reads no deadline from it (a NotReady node shows since when, not for how long)."""
    global _cached
    model = read_model()
    key = (id(model), model.generation)
    with _lock:
        if _cached is not None and _cached[0] == key and time.monotonic() - _cached[1] < MAX_AGE_SECONDS:
            return _cached[2]
    taken = model.snapshot(now)
    cluster, ids, ledger = taken.cluster, taken.ids, taken.ledger
    fresh = Snapshot(cluster, ids, ledger, NodeHoldings(ledger))
    with _lock:
        _cached = ((id(model), taken.generation), time.monotonic(), fresh)
    return fresh


#: Called by :func:`forget`: what pages keep across snapshots drops it too.
on_forget: list[Callable[[], None]] = []


def forget() -> None:
    """Drop the cached snapshot and everything kept to amend the next one (tests that
    change what the feed does not see: settings; the bench's first board of a process)."""
    global _cached, _previous, _last_pods
    with _lock:
        _cached = None
    with _previous_lock:
        _previous = ({}, {})
    _last_pods = ({}, [], {})
    for drop in on_forget:
        drop()


def _on_setting_changed(**_: object) -> None:
    forget()


setting_changed.connect(_on_setting_changed)

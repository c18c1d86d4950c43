"""Usage records as the engine sees them: what is held now, and how to get there.

A usage record says "this subject held these units of this key here, from then until
then". The engine does not store records; it says which holdings are current after a
pass (:func:`holdings`) and, given the records still open, which to close and which
to open (:func:`reconcile_usage`). The Django side writes exactly that plan, so the
rules (one open record per device while Bound or Lost, a new record when node, phase
or units change, pods' raw usage by the shared launcher reader) are tested here with
plain objects.

Pods: a pod's raw usage is its requests minus what its VMI's devices already hold (only
for a proven launcher), decided by the one launcher reader. The caller supplies the VMI
lookup: usage records read the named VMI fresh (not the pass's snapshot), and only for
pods that request a raw GPU resource.
"""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from operator import attrgetter, itemgetter

from binder.engine.launcher import VmiLookup, raw_usage_of
from binder.engine.types import Device, GpuClass, Phase, Pod, quick_records


class SubjectKind(enum.StrEnum):
    """What a record is about: a GPU device, or a pod's raw-name usage."""

    GPU = "GPU"
    POD = "Pod"


class RecordPhase(enum.StrEnum):
    """The phase a record was held in: a device Bound or Lost, or a pod's raw usage."""

    BOUND = "Bound"
    LOST = "Lost"
    RAW = "Raw"


@dataclass(frozen=True, slots=True, order=True)
class UsageHolding:
    """One thing held now; an open record stands for exactly one holding.

    Two holdings are the same record only if every field is equal: a change of node,
    phase, units or key (a device's class) closes the old record and opens a new one.
    ``subject_uid`` tells apart two pods of the same name (a pod deleted and created
    again is another subject); devices leave it empty.

    ``since`` is when the holding began, where that is known: a device's ``since`` (the
    pass that bound it or made it Lost set it, perhaps an answer pass well before the full
    pass that writes records). It is not part of the identity (nor of the order), so a
    record opened at another instant still stands for the same holding and never churns.
    """

    namespace: str
    subject_kind: SubjectKind
    subject: str
    subject_uid: str
    key: str
    resource_name: str
    units: int
    node: str
    phase: RecordPhase
    vm_name: str = ""
    since: datetime | None = field(default=None, compare=False)
    borrowed: bool = False
    """Held by a borrowed set (lending): a set repaid or released starts a new record."""

    @property
    def subject_key(self) -> tuple[str, str, str, str, str]:
        """Who holds what: at most one open record per subject and resource."""
        return (self.namespace, self.subject_kind.value, self.subject, self.subject_uid, self.resource_name)


#: A holding's sort key: its fields in order, the order ``order=True`` defines, as one
#: tuple built in C. Sorting a million holdings through the generated ``__lt__`` took
#: 16M Python calls (a third of a worker's start from scratch at 1M devices).
HOLDING_ORDER = attrgetter(*(f.name for f in fields(UsageHolding) if f.compare))


@dataclass(frozen=True, slots=True)
class OpenRecord:
    """A record that is open in storage: its row id, what it says is held, and since when
    (None where the caller does not know: then no change is dated before the pass)."""

    id: int
    holding: UsageHolding
    start: datetime | None = None


# A start from scratch at 1M devices builds a million of each (the open records read, the
# holdings worked out): built through the quick constructor (binder.engine.types).
quick_records(UsageHolding, OpenRecord)


@dataclass(frozen=True, slots=True)
class UsagePlan:
    """What to write: close these open records, open records for these holdings.

    ``ends`` (beside ``close``, one each) is when each record stops and each opening
    holding's ``since`` when its record starts; None means the pass's time. A subject whose
    record is replaced has the old one ending exactly where the next begins.
    """

    close: tuple[int, ...] = ()
    open: tuple[UsageHolding, ...] = ()
    ends: tuple[datetime | None, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.close or self.open)


@dataclass(frozen=True, slots=True)
class Subjects:
    """The subjects whose usage records a pass reconciles when it knows what changed.

    ``device_keys`` and ``pod_keys`` are (namespace, name) of every subject to reconcile,
    deleted ones included (their open records close); ``devices`` and ``pods`` the ones
    that still exist, as they stand after the pass; ``set_devices`` the post-pass devices
    of the sets those pods may launch for (a launcher's raw usage is its requests minus
    what its set holds). ``everything`` asks for a full reconciliation.
    """

    device_keys: frozenset[tuple[str, str]] = frozenset()
    pod_keys: frozenset[tuple[str, str]] = frozenset()
    devices: tuple[Device, ...] = ()
    pods: tuple[Pod, ...] = ()
    set_devices: tuple[Device, ...] = ()
    everything: bool = False


def device_holdings(devices: Iterable[Device], classes: Mapping[str, GpuClass]) -> list[UsageHolding]:
    """Holdings of devices: every Bound or Lost device of an existing class.

    A device whose class does not exist holds no units (the binder releases it), so it
    has no open record; a Lost device holds its units on no node.
    """
    found = []
    for device in devices:
        if not device.held:
            continue
        cls = classes.get(device.class_name)
        if cls is None:
            continue
        bound = device.phase is Phase.BOUND
        found.append(
            UsageHolding(
                namespace=device.namespace,
                subject_kind=SubjectKind.GPU,
                subject=device.name,
                subject_uid="",
                key=cls.name,
                resource_name=cls.resource_name,
                units=cls.units_per_device,
                node=device.node if bound else "",
                phase=RecordPhase.BOUND if bound else RecordPhase.LOST,
                vm_name=device.vm_name,
                since=device.since,
                borrowed=device.borrowed,
            )
        )
    return found


def requests_raw_gpu(pod: Pod) -> bool:
    """True when the pod asks for some GPU resource by its raw name (and is not finished)."""
    return not pod.finished and any(units > 0 for units in pod.requests.values())


def pod_holdings(
    pods: Iterable[Pod],
    devices: Iterable[Device],
    classes: Mapping[str, GpuClass],
    find_vmi: VmiLookup,
) -> list[UsageHolding]:
    """Raw holdings of pods: per pod and resource, its raw usage for budgets when above 0.

    ``devices`` are the devices as they stand now (after the pass); ``find_vmi`` is the
    caller's VMI source, called only for pods that request a raw GPU resource.
    """
    pods = tuple(pods)
    # Only the sets a raw pod may launch for (a million devices at the largest scale).
    launched = {(pod.namespace, pod.owner_vmi) for pod in pods if pod.owner_vmi and requests_raw_gpu(pod)}
    sets: dict[tuple[str, str], list[Device]] = defaultdict(list)
    for device in devices:
        if (set_key := device.set_key) in launched:
            sets[set_key].append(device)

    def find_set(namespace: str, vm: str) -> Iterable[Device]:
        return sets.get((namespace, vm), ())

    found = []
    for pod in pods:
        if not requests_raw_gpu(pod):
            continue
        usage = raw_usage_of(pod, find_vmi, find_set, classes)
        for resource, units in sorted(usage.budget.items()):
            found.append(
                UsageHolding(
                    namespace=pod.namespace,
                    subject_kind=SubjectKind.POD,
                    subject=pod.name,
                    subject_uid=pod.uid,
                    key=resource,
                    resource_name=resource,
                    units=units,
                    node=pod.node,
                    phase=RecordPhase.RAW,
                )
            )
    return found


def holdings(
    devices: Iterable[Device],
    pods: Iterable[Pod],
    classes: Mapping[str, GpuClass],
    find_vmi: VmiLookup,
) -> tuple[UsageHolding, ...]:
    """Everything held now, sorted: devices' holdings and pods' raw holdings."""
    members = tuple(devices)
    return tuple(
        sorted(device_holdings(members, classes) + pod_holdings(pods, members, classes, find_vmi), key=HOLDING_ORDER)
    )


def reconcile_usage(
    open_records: Iterable[OpenRecord],
    current: Iterable[UsageHolding],
    now: datetime | None = None,
    *,
    recorded_until: datetime | None = None,
    device_since: Mapping[tuple[str, str], datetime | None] | None = None,
) -> UsagePlan:
    """Close the open records that no longer hold, open records for new holdings.

    An open record whose holding is still current stays open untouched. Should storage
    ever hold two open records of one holding, the later ones are closed, so each
    holding keeps exactly one. The plan is deterministic (ids and holdings sorted).

    With ``now`` (the pass's time) the plan is dated: a record that a subject's change
    replaces ends, and the next begins, when the change happened (the holding's
    ``since``), not when this pass ran, which may be seconds later; a device that holds
    no more (``device_since``: the devices that still exist, by namespace and name)
    stops at its own ``since``. ``recorded_until`` is the time of the previous pass that
    wrote records: every change before it has its records already, so an older ``since``
    was not set by a pass (a snapshot loaded with its own times) and dates nothing; without
    it no ``since`` is trusted. Nor does a ``since`` date a record that replaces one of the
    same phase and node (:func:`placed_elsewhere`): its placement did not change, so
    what did (a class edited) happened at a time the pass does not know. See
    :func:`change_time`. Without ``now`` every time is left to the caller.
    """
    wanted = Counter(current)
    closing: list[OpenRecord] = []
    for record in sorted(open_records, key=lambda r: r.id):
        if wanted[record.holding] > 0:
            wanted[record.holding] -= 1
        else:
            closing.append(record)
    opening = sorted((holding for holding, count in wanted.items() for _ in range(count)), key=HOLDING_ORDER)
    close = tuple(r.id for r in closing)
    if now is None:
        return UsagePlan(close=close, open=tuple(_since(h, None) if h.since else h for h in opening))
    ended: dict[tuple[str, str, str, str], list[OpenRecord]] = defaultdict(list)
    for record in closing:
        ended[_who(record.holding)].append(record)
    began: dict[tuple[str, str, str, str], datetime] = {}
    dated: list[UsageHolding] = []
    for holding in opening:
        who = _who(holding)
        if who not in began:
            replaced = ended.get(who, ())
            since = holding.since if placed_elsewhere(replaced, holding) else None
            began[who] = change_time(since, [r.start for r in replaced], now, recorded_until)
        start = began[who]
        # Usually the holding's own since (100k new orders open 250k records: replace()
        # rebuilds each through the dataclass machinery, a second and a half of them).
        dated.append(holding if holding.since == start else _since(holding, start))
    known = device_since or {}
    ends: list[datetime] = []
    for record in closing:
        who = _who(record.holding)
        if who in began:
            ends.append(began[who])  # the next record of this subject begins where this one ends
            continue
        since = known.get((who[0], who[2])) if record.holding.subject_kind is SubjectKind.GPU else None
        ends.append(change_time(since, [r.start for r in ended[who]], now, recorded_until))
    return UsagePlan(close=close, open=tuple(dated), ends=tuple(ends))


#: A holding as its open record's row stores it: the identity fields in order, the two
#: enums by value (a ``StrEnum`` member hashes by its name, which is not its value).
Identity = tuple[str, str, str, str, str, str, int, str, str, str, bool]
#: An open record as read for a full reconciliation: its id and a key of what it holds
#: (its :data:`Identity`, or its :func:`identity_text`), nothing else.
RecordRow = tuple[int, Hashable]


def identity(holding: UsageHolding) -> Identity:
    """``holding`` as its record's row stores it (see :data:`Identity`)."""
    return (
        holding.namespace,
        holding.subject_kind.value,
        holding.subject,
        holding.subject_uid,
        holding.key,
        holding.resource_name,
        holding.units,
        holding.node,
        holding.phase.value,
        holding.vm_name,
        holding.borrowed,
    )


def holding_of(row: Identity, since: datetime | None = None) -> UsageHolding:
    """The holding an open record's row stands for."""
    namespace, kind, subject, uid, key, resource, units, node, phase, vm, borrowed = row
    return UsageHolding(
        namespace, SubjectKind(kind), subject, uid, key, resource, units, node, RecordPhase(phase), vm, since,
        bool(borrowed),
    )  # fmt: skip


#: Between the fields of an :func:`identity_text` (no Kubernetes name, class name or
#: resource name can hold a control character, so the text is as exact as the tuple).
IDENTITY_SEPARATOR = "\x1f"


def identity_text(holding: UsageHolding) -> str:
    """The holding's identity as one string: its fields as text joined by
    :data:`IDENTITY_SEPARATOR`.

    The database builds the same text from a record's row (``binder.runtime.usage_records``), so a full
    reconciliation reads one string a record instead of ten and hashes one: reading and
    hashing a million rows of ten fresh strings each was most of what it cost.
    """
    h = holding  # an f-string formats the StrEnums by value in C: a third faster than a join
    lent = "true" if h.borrowed else "false"  # as PostgreSQL writes a boolean as text
    return f"{h.namespace}\x1f{h.subject_kind}\x1f{h.subject}\x1f{h.subject_uid}\x1f{h.key}\x1f{h.resource_name}\x1f{h.units}\x1f{h.node}\x1f{h.phase}\x1f{h.vm_name}\x1f{lent}"  # noqa: E501


def pair_off(
    rows: Iterable[RecordRow], current: Iterable[UsageHolding], key: Callable[[UsageHolding], Hashable] = identity
) -> tuple[list[int], list[UsageHolding]]:
    """The open records and current holdings left once every record still held is paired
    with its holding: what :func:`reconcile_usage` has to work on.

    A full reconciliation compares every open record with every holding, a million of each
    at 1M devices, and almost all of them pair up. Compared as plain tuples (hashed and
    compared in C) instead of as records, and only the few left over built into records,
    the comparison costs a fraction of what it did. Records pair in id order, as in
    :func:`reconcile_usage` (the lowest ids of a holding's open records stay open), so
    ``reconcile_usage`` on what is left gives the plan it would give on everything: a
    record left over has a holding that no current holding is left for.

    ``rows`` carry each record's id and its holding's ``key``: the :func:`identity`, or
    the :func:`identity_text` that storage builds alike. Returns the ids of the records
    left (ascending) and the holdings left (in ``current``'s order).
    """
    held = list(current)
    keys = list(map(key, held))
    rows = list(rows)
    # Storage keeps one open record per subject and resource, and no two holdings share an
    # identity, so the pairing is normally a difference of two sets, done in C.
    ids_by_key = dict(zip(map(itemgetter(1), rows), map(itemgetter(0), rows), strict=True))
    held_keys = set(keys)
    if len(ids_by_key) == len(rows) and len(held_keys) == len(keys):
        left_ids = sorted(ids_by_key[k] for k in ids_by_key.keys() - held_keys)
        new = held_keys - ids_by_key.keys()
        return left_ids, [h for h, k in zip(held, keys, strict=True) if k in new] if new else []
    wanted = Counter(keys)
    left_ids = []
    for record_id, row in sorted(rows, key=itemgetter(0)):
        count = wanted.get(row, 0)
        if count:
            wanted[row] = count - 1
        else:
            left_ids.append(record_id)
    left: list[UsageHolding] = []
    if wanted.total():
        for holding, its_key in zip(held, keys, strict=True):
            if wanted[its_key]:
                wanted[its_key] -= 1
                left.append(holding)
    return left_ids, left


def change_time(
    since: datetime | None, starts: Sequence[datetime | None], now: datetime, recorded_until: datetime | None
) -> datetime:
    """When a subject's change happened, for the records it ends and begins.

    Its ``since`` when that is known, from ``recorded_until`` up to ``now``, and later
    than the start of every record the change ends: a ``since`` no later than such a start
    was not set by this change (a class's units edited, a device of a deleted class: phase
    and node stand still) and a record of unknown start may have begun after it. Otherwise
    the pass's ``now``, or a start later than it (clocks of two processes): a record never
    ends before it began, and the next never begins before the last ended.
    """
    if (
        since is not None
        and recorded_until is not None
        and recorded_until <= since <= now
        and all(start is not None and start < since for start in starts)
    ):
        return since
    return max([now, *(start for start in starts if start is not None)])


def placed_elsewhere(replaced: Iterable[OpenRecord], holding: UsageHolding) -> bool:
    """True unless a record ``holding`` replaces already has its subject in the same phase
    on the same node: only a change of placement (phase or node), the one change that
    sets a device's ``since``, can have made the new record at that ``since``.

    The starts of those records do not tell it alone: a device deleted and created again
    under the same name and bound back to the node its still-open record names gets a
    fresh ``since`` while its record stays open (the same holding never churns). A class
    edited under it later (its units, say) would then be dated back to that binding, hours
    before the edit, billing the new units for the time the old ones were held.
    """
    return all((r.holding.phase, r.holding.node) != (holding.phase, holding.node) for r in replaced)


def _since(h: UsageHolding, since: datetime | None) -> UsageHolding:
    """``h`` beginning at ``since`` (the quick constructor: see ``quick_records``)."""
    return UsageHolding(
        h.namespace, h.subject_kind, h.subject, h.subject_uid, h.key, h.resource_name, h.units, h.node, h.phase,
        h.vm_name, since, h.borrowed,
    )  # fmt: skip


def _who(holding: UsageHolding) -> tuple[str, str, str, str]:
    """The subject, whatever resource it holds: a change of class may change the resource."""
    return (holding.namespace, holding.subject_kind.value, holding.subject, holding.subject_uid)

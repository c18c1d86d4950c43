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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from operator import attrgetter

from binder.engine.launcher import VmiLookup, raw_usage_of
from binder.engine.types import Device, GpuClass, Phase, Pod


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
class Holding:
    """One thing held now; an open record stands for exactly one holding.

    Two holdings are the same record only if every field is equal: a change of node,
    phase, units or key (a device's class) closes the old record and opens a new one.
    ``subject_uid`` tells apart two pods of the same name (a pod deleted and created
    again is another subject); devices leave it empty.
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

    @property
    def subject_key(self) -> tuple[str, str, str, str, str]:
        """Who holds what: at most one open record per subject and resource."""
        return (self.namespace, self.subject_kind.value, self.subject, self.subject_uid, self.resource_name)


#: A holding's sort key: its fields in order, the order ``order=True`` defines, as one
#: tuple built in C. Sorting a million holdings through the generated ``__lt__`` took
#: 16M Python calls (a third of a worker's start from scratch at 1M devices).
HOLDING_ORDER = attrgetter(*(f.name for f in fields(Holding)))


@dataclass(frozen=True, slots=True)
class OpenRecord:
    """A record that is open in storage: its row id and what it says is held."""

    id: int
    holding: Holding


@dataclass(frozen=True, slots=True)
class UsagePlan:
    """What to write: close these open records, open records for these holdings.

    Closing and opening happen at the same instant (the pass's time), so a device that
    moves has one record ending exactly where the next begins.
    """

    close: tuple[int, ...] = ()
    open: tuple[Holding, ...] = ()

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


def device_holdings(devices: Iterable[Device], classes: Mapping[str, GpuClass]) -> list[Holding]:
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
            Holding(
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
) -> list[Holding]:
    """Raw holdings of pods: per pod and resource, its raw usage for budgets when above 0.

    ``devices`` are the devices as they stand now (after the pass); ``find_vmi`` is the
    caller's VMI source, called only for pods that request a raw GPU resource.
    """
    sets: dict[tuple[str, str], list[Device]] = defaultdict(list)
    for device in devices:
        sets[device.set_key].append(device)

    def find_set(namespace: str, vm: str) -> Iterable[Device]:
        return sets.get((namespace, vm), ())

    found = []
    for pod in pods:
        if not requests_raw_gpu(pod):
            continue
        usage = raw_usage_of(pod, find_vmi, find_set, classes)
        for resource, units in sorted(usage.budget.items()):
            found.append(
                Holding(
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
) -> tuple[Holding, ...]:
    """Everything held now, sorted: devices' holdings and pods' raw holdings."""
    members = tuple(devices)
    return tuple(
        sorted(device_holdings(members, classes) + pod_holdings(pods, members, classes, find_vmi), key=HOLDING_ORDER)
    )


def reconcile_usage(open_records: Iterable[OpenRecord], current: Iterable[Holding]) -> UsagePlan:
    """Close the open records that no longer hold, open records for new holdings.

    An open record whose holding is still current stays open untouched. Should storage
    ever hold two open records of one holding, the later ones are closed, so each
    holding keeps exactly one. The plan is deterministic (ids and holdings sorted).
    """
    wanted = Counter(current)
    close: list[int] = []
    for record in sorted(open_records, key=lambda r: r.id):
        if wanted[record.holding] > 0:
            wanted[record.holding] -= 1
        else:
            close.append(record.id)
    opening = sorted((holding for holding, count in wanted.items() for _ in range(count)), key=HOLDING_ORDER)
    return UsagePlan(close=tuple(close), open=tuple(opening))
